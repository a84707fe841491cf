"""One rank of a multi-process test: train several layouts in turn in one process group.

    torchrun --nproc-per-node N tests/parallel/layout_worker.py SPEC.json

SPEC: {"out": folder, "base": [overrides...], "layouts": [{"name", "args", "run"?}, ...]}.
For each layout the rank holding the loss of pipeline stage s (dp, tp and cp rank 0) writes
OUT/NAME.stage{s}.pt with the per-step losses, the final validation loss and this stage's
parameters gathered to full tensors; rank 0 also writes the metrics rows it logged. Collective
counts of the first step are recorded when the layout asks for them ("count": true).

`train_layouts` is the loop itself; another worker (tied_worker.py) passes a hook that adds its
own entries to the same payload.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmscale.config import load_config
from llmscale.parallel import full_parameters
from llmscale.parallel.pipeline import schedule_op_order
from llmscale.train import trainer as trainer_mod
from llmscale.train.trainer import Trainer


class FirstStepEvents:
    """Records, during a trainer's first step, gradient-sync switches and gradient reductions.

    Gradient reductions are the reduce-scatters (FSDP2) and all-reduces (replicate, HSDP) issued
    on a mesh sub-group; the trainer's own loss / norm / overflow all-reduces use the default
    group and are left out.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.events: list[str] = []
        self.first_row: dict | None = None  # this rank's metrics row of its first step
        # Recording starts with the first step: what runs before it (the shared-core
        # calibration's own collectives and overhead step) is not the step's.
        self.active = False
        self._started = False
        self._undo: list[tuple[object, str, object]] = []
        for name, tag in (
            ("reduce_scatter_single", "reduce_scatter"),
            ("all_reduce", "all_reduce"),
        ):
            self._wrap(dist, name, self._collective(getattr(dist, name), tag))
        orig_controls = trainer_mod.apply_micro_batch_controls

        def controls(parts, zero_stage, shard, last, grads_once=False):
            flag = orig_controls(parts, zero_stage, shard, last, grads_once)
            if self.active:
                self.events.append(f"sync={flag}")
            return flag

        self._wrap(trainer_mod, "apply_micro_batch_controls", controls)
        orig_step = trainer.train_step

        def first_step():
            if not self._started:
                self._started = self.active = True
            row = orig_step()
            if self.first_row is None:
                self.first_row = dict(row)
            self.stop()
            return row

        trainer.train_step = first_step

    def _collective(self, orig, tag):
        def wrapper(*args, **kwargs):
            if self.active and kwargs.get("group") is not None:
                self.events.append(tag)
            return orig(*args, **kwargs)

        return wrapper

    def _wrap(self, owner, name, new):
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def stop(self) -> None:
        if self._undo:
            self.active = False
            for owner, name, orig in reversed(self._undo):
                setattr(owner, name, orig)
            self._undo.clear()


def after_each_step(trainer: Trainer, note: Callable[[dict], None]) -> None:
    """Call `note` with each step's metrics row once the step has run."""
    orig = trainer.train_step

    def step():
        row = orig()
        note(row)
        return row

    trainer.train_step = step


def _record_rows(trainer: Trainer) -> list[dict]:
    """Every step's metrics row as this rank computed it (rank 0 alone writes metrics.jsonl)."""
    rows: list[dict] = []
    after_each_step(trainer, lambda row: rows.append(dict(row)))
    return rows


# Called with each layout's trainer before it trains (to wrap its steps); what it returns is
# called after training on every rank and its entries join that rank's payload.
Hook = Callable[[Trainer], Callable[[], dict[str, Any]]]


def train_layouts(spec_path: str, hook: Hook | None = None) -> None:
    """Train every layout of the spec in turn; the writing ranks save their payloads."""
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    for layout in spec["layouts"]:
        run_dir = out / layout.get("run", layout["name"])
        cfg = load_config(None, [*spec["base"], "--job.run_dir", str(run_dir), *layout["args"]])
        t = Trainer(cfg)
        recorder = FirstStepEvents(t)
        rows = _record_rows(t)
        extra = hook(t) if hook is not None else dict
        result = t.fit()
        params = full_parameters(t.model_parts)
        more = extra()
        d = t.dims
        if d.dp_rank == 0 and d.tp_rank == 0 and d.cp_rank == 0:
            payload = {
                "losses": result.losses,
                "val_loss": result.val_loss,
                "steps_done": result.steps_done,
                "params": params,
                "stage_ids": t.parallel.stage_ids,
                "events": recorder.events,
                "activation_peak": t.activation_peak,  # the last step's (pipelines)
                "first_row": recorder.first_row,
                "rows": rows,  # this rank's metrics row of every step
                # torch's own per-rank op order (multi-stage schedules), for the timeline tests
                "torch_order": (
                    schedule_op_order(t.pp_schedule)
                    if getattr(t.pp_schedule, "pipeline_order", None)
                    else None
                ),
                **more,
            }
            torch.save(payload, out / f"{layout['name']}.stage{d.pp_rank}.pt")
        t.close()  # its stages and meshes hold process groups: gone before destroy_process_group
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    train_layouts(sys.argv[1])


if __name__ == "__main__":
    main()
