"""One rank of the pipeline benchmark: train several configurations in turn in one process group.

    torchrun --nproc-per-node N -m llmscale.bench.pipeline_worker SPEC.json

SPEC: {"configs": [path to a job's config.toml, ...]}, each with `metrics.pipeline_timeline`
on, so that `Trainer.fit` leaves run_dir/pipeline_timeline.json behind. One torchrun start for
many configurations: process start-up and gloo rendezvous cost more than a short run.
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
    for path in spec["configs"]:
        Trainer(load_config(path)).fit()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
