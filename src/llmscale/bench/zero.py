"""ZeRO 1, 2 and 3: step time and FSDP traffic per step of dp_shard 2 x accumulation 8.

Three runs of the same job on 2 ranks (gloo on the CPU, NCCL on GPUs; one thread each on the
CPU), differing only in `parallel.zero_stage`. Each run's rank 0 writes the planner's
prediction (`prediction.json`: step time on this machine, calibrated as `llmscale train` does,
and the collectives of `stack.residency`) before training and the counted collectives in every
metrics row. Measured step time: the median of the timed steps (after `--warmup`); collectives:
the last step's row (rank 0).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from llmscale.bench.report import Row, SuiteResult
from llmscale.bench.runner import BenchOptions
from llmscale.config import JobConfig, to_toml
from llmscale.train.metrics import read_jsonl

SUITE = "zero"
DP_SHARD = 2
ACCUM = 8
STAGES = (1, 2, 3)


def job(opts: BenchOptions, zero_stage: int) -> JobConfig:
    """dp_shard 2, micro-batches of 1, 8 per rank per step."""
    return opts.job(
        "--parallel.dp_shard", str(DP_SHARD), "--parallel.zero_stage", str(zero_stage),
        "--train.micro_batch_size", "1", "--train.global_batch_size", str(DP_SHARD * ACCUM),
        "--train.eval_sequences", "0", "--metrics.activation_memory", "false",
        run=f"zero{zero_stage}",
    )  # fmt: skip


def _launch(cfg: JobConfig) -> None:
    path = Path(cfg.job.run_dir).with_suffix(".toml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(cfg))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(DP_SHARD), "-m", "llmscale", "train", "--config", str(path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(
            f"zero bench: torchrun failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        )


def run(opts: BenchOptions) -> SuiteResult:
    res = SuiteResult(
        SUITE,
        f"ZeRO stages: step time and FSDP traffic per step, dp_shard {DP_SHARD} x accumulation "
        f"{ACCUM} ({opts.model}, seq {opts.seq_len}, micro-batch 1)",
    )
    table: list[list[str]] = []
    load_before = os.getloadavg()
    for z in STAGES:
        cfg = job(opts, z)
        _launch(cfg)
        run_dir = Path(cfg.job.run_dir)
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
        timed = rows[opts.warmup :] or rows
        pred = json.loads((run_dir / "prediction.json").read_text())
        coll = pred.get("collectives") or {}
        last = rows[-1]
        label = f"zero {z}"
        step = statistics.median(r["step_time_s"] for r in timed)
        res.rows += [
            Row(SUITE, label, "step time", "s", step, pred.get("step_time_s")),
            Row(SUITE, label, "all-gather bytes / step", "B", last["param_allgather_bytes"],
                coll.get("param_allgather_bytes")),
            Row(SUITE, label, "reduce-scatter bytes / step", "B", last["grad_reduce_bytes"],
                coll.get("grad_reduce_bytes")),
        ]  # fmt: skip
        table.append(
            [
                label,
                f"{last['param_allgathers']} / {coll.get('param_allgathers')}",
                f"{last['grad_reduces']} / {coll.get('grad_reduces')}",
                f"{1000 * step:.0f} / {1000 * (pred.get('step_time_s') or 0):.0f}",
            ]
        )
    res.tables["per optimizer step, rank 0: measured / predicted"] = (
        ["zero stage", "all-gathers", "reduce-scatters", "step time (ms)"],
        table,
    )
    load_after = os.getloadavg()
    res.notes += [
        "Predicted collectives: stack/residency.py (the rule the runtime's switches come from); "
        "measured: counted from FSDP2's own collectives (parallel/data_parallel.py's "
        "CollectiveCounter), the last step's row of rank 0. Predicted step time: each run's "
        "prediction.json (the planner on this machine's calibrated kernels; it charges each "
        "stage's collectives (stack.param_residency) at the rates of the h100 node's links, "
        "which stand in for the unmeasured local ones, so they cost it well under a "
        "millisecond against seconds of CPU compute).",
        f"Load average (1, 5, 15 min) before {_load(load_before)}, after {_load(load_after)} on "
        f"{os.cpu_count()} cores: measured step times include other work on the machine.",
    ]
    return res


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.1f}" for x in avg)
