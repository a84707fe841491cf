"""One rank of the pipeline benchmark: train several configurations in turn in one process group.

    torchrun --nproc-per-node N -m llmscale.bench.pipeline_worker SPEC.json

SPEC: {"configs": [path to a job's config.toml, ...]}, each with `metrics.pipeline_timeline`
on, so that `Trainer.fit` leaves run_dir/pipeline_timeline.json behind. One torchrun start for
many configurations: process start-up and gloo rendezvous cost more than a short run.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from llmscale.config import load_config
from llmscale.train.trainer import Trainer


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    for path in spec["configs"]:
        # Closed before the next one starts: nothing of it holds a process group any more.
        with Trainer(load_config(path)) as trainer:
            trainer.fit()
        dist.barrier()
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    if world() is not None:
        # Destroyed later, under a finalising interpreter, gloo can abort the rank (SIGABRT,
        # "terminate called without an active exception"): fail here, with the reason.
        raise RuntimeError(
            "the process group outlived destroy_process_group(): something still refers to it "
            "(a pipeline stage or mesh of a trainer that was not closed?)"
        )


if __name__ == "__main__":
    main()
