"""`llmscale ckpt list|verify RUN_DIR`: each checkpoint's step, layout, size and integrity.

Every finished checkpoint folder is verified against its manifest (train/checkpoint.py);
unfinished `.tmp` folders (an interrupted or failed save) are listed as such; a checkpoint
being deleted (renamed to .pruned.tmp or .replaced.tmp, see train/checkpoint.py) is not listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmscale.errors import UsageError
from llmscale.train.checkpoint import (
    Checkpointer,
    is_trash,
    read_manifest,
    verify_checkpoint,
)
from llmscale.ui import human_bytes

_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class CheckpointRow:
    step: int
    path: Path
    layout: str  # "dp_shard=2 (2 ranks)", "single process", "?" without a manifest
    size_bytes: int
    problem: str | None  # None: intact

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def damaged(self) -> bool:
        """A finished checkpoint that fails verification (an unfinished .tmp is not one)."""
        return self.problem is not None and not self.path.name.endswith(".tmp")


def describe_layout(layout: dict[str, int]) -> str:
    if not layout:
        return "?"
    parts = [f"{n}={layout[n]}" for n in _AXES if layout.get(n, 1) > 1]
    world = layout.get("world_size", 1)
    return f"{' '.join(parts) or 'single process'} ({world} rank{'s' if world != 1 else ''})"


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def checkpoint_rows(run_dir: str | Path, folder: str = "checkpoints") -> list[CheckpointRow]:
    """Every checkpoint under RUN_DIR/folder, oldest first (UsageError when there is none)."""
    ckpt_dir = Path(run_dir) / folder
    if not ckpt_dir.is_dir():
        raise UsageError(f"{ckpt_dir} is not a folder: no checkpoints in {run_dir}")
    rows = []
    for found in Checkpointer(ckpt_dir).checkpoints():
        try:
            layout = describe_layout(read_manifest(found.path).get("layout") or {})
        except (OSError, ValueError):
            layout = "?"
        rows.append(
            CheckpointRow(
                step=found.step,
                path=found.path,
                layout=layout,
                size_bytes=_folder_bytes(found.path),
                problem=verify_checkpoint(found.path),
            )
        )
    for tmp in sorted(t for t in ckpt_dir.glob("step-*.tmp") if not is_trash(t)):
        digits = tmp.name.removeprefix("step-").split(".", 1)[0]
        rows.append(
            CheckpointRow(
                step=int(digits) if digits.isdigit() else -1,
                path=tmp,
                layout="?",
                size_bytes=_folder_bytes(tmp),
                problem="unfinished save (.tmp): never used",
            )
        )
    return sorted(rows, key=lambda r: (r.step, r.path.name))


def print_rows(rows: list[CheckpointRow], title: str) -> None:
    from rich.table import Table

    from llmscale.ui import console

    t = Table(title=title)
    for col in ("step", "folder", "layout", "size", "integrity"):
        t.add_column(col, justify="right" if col in ("step", "size") else "left")
    for r in rows:
        if r.ok:
            state = "[green]ok[/]"
        else:
            state = f"[red]damaged[/]: {r.problem}" if r.damaged else f"[yellow]{r.problem}[/]"
        t.add_row(str(r.step), r.path.name, r.layout, human_bytes(r.size_bytes), state)
    out = console()
    if rows:
        out.print(t)
    else:
        out.print(f"{title}: no checkpoints")
