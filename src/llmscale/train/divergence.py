"""Stopping a diverged run, and never checkpointing non-finite weights.

A run whose loss or gradient norm stays NaN or inf will not come back: every later step is
wasted, and a checkpoint written then would replace good weights with NaN ones. The guard counts
bad optimizer steps in a row and stops the run after `train.max_bad_steps` of them (exit 3).
fp16's dynamic loss scaling skips a step whose gradients overflowed and lowers the scale; such a
step has a finite loss and is part of normal training, so it does not count. A step whose loss
itself is not finite does, skipped or not.

Every rank decides alike without a collective of its own: the loss, the gradient norm and the
overflow flag in a step's metrics row are already reduced over the whole job. The weights check
before a save is a collective (each rank checks its own shards, then they agree).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from llmscale.parallel.dims import ParallelDims
from llmscale.tensors import local_tensor


def bad_step(row: dict[str, Any]) -> bool:
    """A step whose loss, or (unless fp16 loss scaling skipped it) gradient norm, is NaN/inf."""
    if not math.isfinite(row["loss"]):
        return True
    return not row.get("skipped", False) and not math.isfinite(row["grad_norm"])


class DivergenceGuard:
    """Counts bad optimizer steps in a row; `diverged` after `max_bad_steps` (0: never)."""

    def __init__(self, max_bad_steps: int) -> None:
        self.max_bad_steps = max_bad_steps
        self.in_a_row = 0
        self.first_bad: int | None = None  # step that began the current run of bad steps

    def observe(self, row: dict[str, Any]) -> bool:
        """Take one step's metrics row (reduced over the job); True when the step was bad."""
        bad = bad_step(row)
        if bad:
            if self.in_a_row == 0:
                self.first_bad = int(row["step"])
            self.in_a_row += 1
        else:
            self.in_a_row = 0
            self.first_bad = None
        return bad

    @property
    def diverged(self) -> bool:
        return self.max_bad_steps > 0 and self.in_a_row >= self.max_bad_steps

    def message(self, step: int, last_checkpoint: int | None) -> str:
        """The one line a diverged run stops with."""
        kept = (
            f"the newest checkpoint (step {last_checkpoint}) has finite weights"
            if last_checkpoint is not None
            else "no checkpoint was written"
        )
        return (
            f"diverged: the loss or gradient norm was NaN or inf for {self.in_a_row} steps in a "
            f"row (steps {self.first_bad}-{step}, train.max_bad_steps = {self.max_bad_steps}); "
            f"{kept}"
        )


@torch.no_grad()
def all_finite(tensors: Iterable[Any], dims: ParallelDims, device: torch.device) -> bool:
    """True on every rank when every floating tensor (each rank's own shards) is finite on
    every rank. A collective: every rank calls it."""
    ok = True
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            local = local_tensor(t)
            if local.numel() and not bool(torch.isfinite(local).all()):
                ok = False
                break
    return not dims.agree(not ok, device)
