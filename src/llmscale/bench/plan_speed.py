"""How long `llmscale plan`'s search takes, cold, as the CLI runs it (issue 25's targets).

    python -m llmscale.bench.plan_speed [--repeat N]
    python -m llmscale.bench.plan_speed --model llama2-7b --gpus 8 --gpu h200 --seq 2048 \\
        --global-batch 64   # one search of your own (no target)

Each search runs through `report.search_report.plan_report` (what `llmscale plan` calls) with
the planner's caches emptied first, so it starts cold as a new CLI process does. Printed: wall
and CPU seconds (the best of `--repeat` runs), the plans whose memory was costed, those that
fit, and the target. A script, not a timed test: on a shared machine wall time grows with
the load, CPU time much less; the targets are wall seconds on a quiet machine.
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

from llmscale.plan import cache
from llmscale.report.search_report import plan_report


class Case(NamedTuple):
    model: str
    gpus: int
    gpu: str
    seq: int
    global_batch: int
    target_s: float | None  # wall seconds (None: no target)

    def label(self) -> str:
        return (
            f"{self.model} on {self.gpus} {self.gpu}, seq {self.seq}, "
            f"global batch {self.global_batch}"
        )


# Issue 25: "a full search for llama2-70b on 64 H200 in at most 1.0 s of wall time on this
# machine, llama3-70b on 4,096 H100 at most 0.5 s".
CASES = (
    Case("llama2-70b", 64, "h200", 4096, 1024, 1.0),
    Case("llama3-70b", 4096, "h100", 8192, 2048, 0.5),
)


class Timing(NamedTuple):
    wall_s: float
    cpu_s: float
    costed: int  # plans whose memory was computed
    fit: int
    best: str


def time_search(case: Case, repeat: int = 1) -> Timing:
    """The best of `repeat` cold runs of `case`'s search (wall and CPU seconds each the least)."""
    walls, cpus = [], []
    for _ in range(max(1, repeat)):
        cache.clear_all()
        t0, c0 = time.perf_counter(), time.process_time()
        rep = plan_report(case.model, case.gpus, case.gpu, case.seq, case.global_batch, top=5)
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - t0)
    res = rep.result
    best = "none fits"
    if res.candidates:
        c = res.candidates[0]
        p = c.plan
        best = (
            f"tp{p.tp} pp{p.pp} dp{p.dp} mbs{p.micro_batch_size} {p.recompute} "
            f"{p.pp_schedule if p.pp > 1 else ''}".rstrip()
            + f": {c.time.seconds:.2f} s/step"
        )
    return Timing(min(walls), min(cpus), res.evaluated, res.feasible, best)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.bench.plan_speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--repeat", type=int, default=1, help="cold runs per search, best kept")
    ap.add_argument("--model", help="time this search instead of the targets' (a preset)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=1024)
    args = ap.parse_args(argv)
    cases: tuple[Case, ...] = CASES
    if args.model is not None:
        cases = (Case(args.model, args.gpus, args.gpu, args.seq, args.global_batch, None),)
    print(f"{'search':56} {'wall s':>7} {'cpu s':>6} {'costed':>7} {'fit':>5}  {'target':14} best")
    for case in cases:
        t = time_search(case, args.repeat)
        target = "-"
        if case.target_s is not None:
            verdict = "met" if t.wall_s <= case.target_s else "OVER"
            target = f"<= {case.target_s:g} s {verdict}"
        print(
            f"{case.label():56} {t.wall_s:7.3f} {t.cpu_s:6.3f} {t.costed:7d} {t.fit:5d}  "
            f"{target:14} {t.best}"
        )


if __name__ == "__main__":
    main()
