"""One rank of the context-parallel benchmark: calibrate, then train each configuration in turn.

    torchrun --nproc-per-node 2 -m llmscale.bench.cp_worker SPEC.json

SPEC: {"model": preset, "micro_batch": b, "cp_micro_batch": cp's b, "seq_len": s, "cp": c,
"out": folder, "effort": [trials, min_seconds], "repetitions": [[path to a job's config.toml,
...], ...]}. Each repetition first measures the device on every rank at once (ranks share the
machine's cores, as they do when they train): train/calibration.py's figures for one rank's
micro-batch (b x s tokens, fp32), the runtime's ring blocks for cp's micro-batch at c ranks'
chunk size, and the link between the ranks (a ring pass over gloo); rank 0 writes them to
out/calibration-REP.json. Then it trains the repetition's configurations one after the other
(their order alternates between repetitions, the suite's choice).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from llmscale.config import load_config
from llmscale.instrument import calibrate
from llmscale.model.config import get_preset
from llmscale.train import calibration
from llmscale.train.trainer import Trainer


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # a ring of this rank only
    device = torch.device("cpu")
    model = get_preset(spec["model"])
    b, s, cp = spec["micro_batch"], spec["seq_len"], spec["cp"]
    effort = calibration.Effort(*spec["effort"])
    for rep, paths in enumerate(spec["repetitions"]):
        dist.barrier()
        figures = calibration.measure(model, b, s, "fp32", device, effort=effort)
        figures["ring_attention_flops"] = calibration.ring_attention_flops_per_s(
            model, spec["cp_micro_batch"], s, cp, device, effort, alone
        )
        dist.barrier()
        figures.update(calibrate.measured_link(dist.group.WORLD))
        if rank == 0:
            out = Path(spec["out"]) / f"calibration-{rep}.json"
            calibrate.write_json(out, figures)
        for path in paths:
            with Trainer(load_config(path)) as trainer:
                trainer.fit()
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
