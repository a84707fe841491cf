"""One rank of a multi-process test: train several layouts in turn in one process group.

    torchrun --nproc-per-node N tests/parallel/layout_worker.py SPEC.json

SPEC: {"out": folder, "base": [overrides...], "layouts": [{"name", "args", "run"?}, ...]}.
For each layout the rank holding the loss of pipeline stage s (dp rank 0, tp rank 0) writes
OUT/NAME.stage{s}.pt with the per-step losses, the final validation loss and this stage's
parameters gathered to full tensors; rank 0 also writes the metrics rows it logged. Collective
counts of the first step are recorded when the layout asks for them ("count": true).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from llmscale.config import load_config
from llmscale.parallel import full_parameters
from llmscale.train.trainer import Trainer


def _counting(counts: Counter[str]) -> list[tuple[str, object]]:
    """Wrap the collectives FSDP2 uses for gradients so that calls are counted."""
    patched = []
    for name in ("reduce_scatter_tensor", "all_reduce", "reduce_scatter_single"):
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def wrapper(*args, __orig=orig, __name=name, **kwargs):
            counts[__name] += 1
            return __orig(*args, **kwargs)

        setattr(dist, name, wrapper)
        patched.append((name, orig))
    return patched


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    for layout in spec["layouts"]:
        run_dir = out / layout.get("run", layout["name"])
        cfg = load_config(None, [*spec["base"], "--job.run_dir", str(run_dir), *layout["args"]])
        t = Trainer(cfg)
        result = t.fit()
        params = full_parameters(t.model_parts)
        d = t.dims
        if d.dp_rank == 0 and d.tp_rank == 0:
            payload = {
                "losses": result.losses,
                "val_loss": result.val_loss,
                "steps_done": result.steps_done,
                "params": params,
                "stage_ids": t.parallel.stage_ids,
            }
            torch.save(payload, out / f"{layout['name']}.stage{d.pp_rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
