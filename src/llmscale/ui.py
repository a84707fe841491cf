"""Console output shared by the commands (rich, torch-free)."""

from __future__ import annotations

import sys

from rich.console import Console


def console(stderr: bool = False) -> Console:
    """A rich Console; when output is not a terminal (a pipe, a log) lines are not cut at 80."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, highlight=False, soft_wrap=True)
