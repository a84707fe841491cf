"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP), written atomically.

Layout: RUN_DIR/checkpoints/step-000010/ (DCP files + .metadata). Every rank writes into
step-000010.tmp/; once all have finished, rank 0 renames it, so a checkpoint folder without the
suffix is always complete. An interrupted save leaves only a .tmp folder, which is ignored and
removed by the next save. Only the newest `keep_last` checkpoints are kept. DCP stores each
rank's shards with their global layout, so a checkpoint saved under one parallel layout loads
under another. The folder must be on a file system every rank sees.
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Checkpointer:
    """Saves and finds checkpoints under one folder."""

    def __init__(self, folder: str | Path, keep_last: int = 2) -> None:
        self.folder = Path(folder)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.folder / f"step-{step:06d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / ".metadata").is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` (tensors, DTensors, Stateful objects, plain values) for `step`."""
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
                shutil.rmtree(final)
        _barrier()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(tmp))
        _barrier()
        if _rank() == 0:
            tmp.rename(final)
            for _, old in self.checkpoints()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, path: str | Path, state: dict[str, Any]) -> None:
        """Fill `state` in place from a checkpoint (resharding to the current layout)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))
