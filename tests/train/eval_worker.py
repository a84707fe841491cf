"""One rank of test_eval's multi-process test: evaluate each layout before any step.

    torchrun --nproc-per-node N tests/train/eval_worker.py SPEC.json

SPEC: {"out": folder, "base": [overrides...], "layouts": {name: [overrides...]}}. Rank 0 writes
OUT/NAME.json with the validation loss (every rank computes the same value).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from llmscale.config import load_config
from llmscale.train.trainer import Trainer


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    for name, args in spec["layouts"].items():
        cfg = load_config(None, [*spec["base"], "--job.run_dir", str(out / name), *args])
        t = Trainer(cfg)
        val = t.evaluate()
        if dist.get_rank() == 0:
            (out / f"{name}.json").write_text(json.dumps({"val_loss": val}))
        t.close()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
