"""How long `llmscale plan`'s search takes: Llama 2 70B (and 405B) from 8 to 4096 GPUs.

    .venv/bin/python bench/plan_speed.py [--max-gpus N]
    python -m llmscale.bench.plan_speed [same flags]

A script, not a timed test: wall times depend on the machine and its load. The target is a 70B
model over up to 4096 GPUs in under one second. Each size runs twice: cold (empty caches, as
the CLI sees it) and warm; CPU time is reported too, since a shared machine inflates wall time.
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

from llmscale.model.config import get_preset
from llmscale.plan import cache
from llmscale.plan.cluster import Cluster
from llmscale.plan.search import SearchResult, search

CASES = [
    ("llama2-70b", "h200", 8, 64),
    ("llama2-70b", "h200", 64, 1024),
    ("llama2-70b", "h200", 512, 2048),
    ("llama2-70b", "h200", 4096, 4096),
    ("llama2-70b", "h100", 4096, 4096),
    ("llama3-405b", "h200", 4096, 4096),
]


def clear_planner_caches() -> None:
    """Empty the planner's memo caches, so that the next search starts cold as the CLI's does."""
    cache.clear_all()


class Timing(NamedTuple):
    """One search timed: wall seconds cold (empty caches) and its CPU seconds, wall seconds warm,
    and the search's result."""

    cold: float
    cpu: float
    warm: float
    result: SearchResult


def time_search(name: str, gpu: str, gpus: int, batch: int, seq: int = 4096) -> Timing:
    """Search `name` on `gpus` x `gpu` twice, cold then warm (`make docs` quotes it too)."""
    model, cluster = get_preset(name), Cluster.of(gpu)
    clear_planner_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    r = search(model, gpus, cluster, seq, batch)
    cold, cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    search(model, gpus, cluster, seq, batch)
    return Timing(cold, cpu, time.perf_counter() - t0, r)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--max-gpus", type=int, default=None, help="only the cases of at most N GPUs (default: all)"
    )
    args = ap.parse_args(argv)
    cases = [c for c in CASES if args.max_gpus is None or c[2] <= args.max_gpus]
    print(f"{'model':12} {'gpu':5} {'GPUs':>5} {'batch':>5} {'cold s':>7} {'cpu s':>6} {'warm s':>7} "
          f"{'costed':>7} {'fit':>6}  best")  # fmt: skip
    worst_70b = 0.0
    for name, gpu, gpus, batch in cases:
        cold, cpu, warm, r = time_search(name, gpu, gpus, batch)
        if name == "llama2-70b":
            worst_70b = max(worst_70b, cpu)
        best = r.candidates[0] if r.candidates else None
        desc = (
            "-"
            if best is None
            else (
                f"tp{best.plan.tp} pp{best.plan.pp} dp{best.plan.dp} mbs{best.plan.micro_batch_size} "
                f"{best.plan.recompute}: {best.time.seconds:.2f} s/step, MFU {best.time.mfu:.1%}"
            )
        )
        print(f"{name:12} {gpu:5} {gpus:5d} {batch:5d} {cold:7.3f} {cpu:6.3f} {warm:7.3f} "
              f"{r.evaluated:7d} {r.feasible:6d}  {desc}")  # fmt: skip
    verdict = "under" if worst_70b < 1.0 else "OVER"
    print(f"slowest 70B search (cold, CPU time): {worst_70b:.3f} s, {verdict} the 1 s target")


if __name__ == "__main__":
    main()
