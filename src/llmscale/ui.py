"""Console output shared by the commands (rich, torch-free)."""

from __future__ import annotations

import sys

from rich.console import Console


def console(stderr: bool = False) -> Console:
    """A rich Console; when output is not a terminal (a pipe, a log) lines are not cut at 80."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, highlight=False, soft_wrap=True)


def value_range(values: list[float], digits: int) -> str:
    """The smallest and largest of `values` to `digits` decimals ("0.81–0.87"), or the one
    value where both read the same."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def human_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit (B to TiB) in which it reads below 1024."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
