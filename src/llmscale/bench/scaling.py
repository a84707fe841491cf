"""Data-parallel throughput for 1, 2, 4 processes on this machine (figures, not asserts).

    python bench/scaling.py [--procs 1 2 4] [--mode fsdp|ddp] [--model tiny] [--steps 12]
    python -m llmscale.bench.scaling [same flags]

Each point is a `torchrun --standalone --nproc-per-node N -m llmscale train` run with N-way data
parallelism (fsdp: dp_shard = N, ZeRO-3; ddp: dp_replicate = N) and a fixed per-rank batch
(weak scaling: global batch = N x micro_batch_size). Reported: the median of the job's tokens/s
over the steps after --warmup, the speed-up over one process and the scaling efficiency
(speed-up / N). On CPU, ranks share the machine's cores (one thread each), so efficiency falls as
soon as N exceeds the core count; on GPUs each rank has its own device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmscale.bench.jobs import short_job


def run_point(n: int, args: argparse.Namespace, root: Path) -> dict[str, float]:
    run_dir = root / f"dp{n}"
    degree = "parallel__dp_shard" if args.mode == "fsdp" else "parallel__dp_replicate"
    job = short_job(
        model__name=args.model,
        job__run_dir=run_dir,
        data__seq_len=args.seq,
        data__max_files=200,
        train__steps=args.steps + args.warmup,
        train__micro_batch_size=args.batch,
        train__global_batch_size=args.batch * n,
        train__eval_sequences=0,
        **{degree: n},
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
        "-m", "llmscale", "train", *job,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{n} processes failed:\n{r.stderr[-3000:]}")
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    train = [x for x in rows if x.get("kind") == "train"][args.warmup :]
    return {
        "tokens_per_s": statistics.median(x["tokens_per_s"] for x in train),
        "step_s": statistics.median(x["step_time_s"] for x in train),
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mode", choices=("fsdp", "ddp"), default="fsdp")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    args = ap.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="llmscale-scaling-"))
    print(
        f"{args.mode} data parallelism, model {args.model}, {args.batch} x {args.seq} tokens per "
        f"rank per step, {os.cpu_count()} CPU cores, {args.threads} thread(s) per rank"
    )
    print(
        f"{'procs':>5}  {'global batch':>12}  {'tokens/s':>10}  {'step s':>7}  {'speed-up':>8}  {'efficiency':>10}"
    )
    one_proc: float | None = None  # tokens/s of one process (estimated if 1 is not in --procs)
    for n in args.procs:
        p = run_point(n, args, root)
        if one_proc is None:
            one_proc = p["tokens_per_s"] / n
        speedup = p["tokens_per_s"] / one_proc
        print(
            f"{n:>5}  {args.batch * n:>12}  {p['tokens_per_s']:>10,.0f}  {p['step_s']:>7.3f}  "
            f"{speedup:>7.2f}x  {speedup / n:>9.0%}"
        )


if __name__ == "__main__":
    main()
