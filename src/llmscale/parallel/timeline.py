"""Measured pipeline timelines, analysed: the records of `instrument/pipeline.py` in the
simulator's terms.

`PipelineTimeline.load` reads a run's pipeline_timeline.json; `step_stats`, `stage_op_times`,
`op_waits`, `replay`, ... are plain Python over its records (no torch).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmscale.plan.schedule import Op, SimResult, TimedOp, simulate_orders


@dataclass(frozen=True)
class OpRecord:
    """One forward (F) or backward (B) of one microbatch through one stage, as it ran."""

    rank: int  # pipeline rank
    kind: str  # "F" | "B"
    stage: int  # global stage index (loop style: chunk * pp + rank)
    microbatch: int
    start: float  # seconds on the shared clock
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class PipelineTimeline:
    """A pipeline_timeline.json: the layout and, per recorded step, every op."""

    schedule: str
    pp: int
    chunks: int
    microbatches: int
    steps: dict[int, list[OpRecord]]

    @classmethod
    def load(cls, path: str | Path) -> PipelineTimeline:
        d = json.loads(Path(path).read_text())
        steps = {
            s["step"]: [
                OpRecord(o["rank"], o["kind"], o["stage"], o["microbatch"], o["start"], o["end"])
                for o in s["ops"]
            ]
            for s in d["steps"]
        }
        return cls(d["schedule"], d["pp"], d["chunks"], d["microbatches"], steps)


@dataclass(frozen=True)
class StepStats:
    """One measured step, in the simulator's terms."""

    makespan: float  # first op start to last op end
    busy: tuple[float, ...]  # per rank: the sum of its op durations
    bubble_fraction: float  # 1 - sum(busy) / (pp * makespan)
    orders: tuple[tuple[str, ...], ...]  # per rank, its ops by start time ("1F3" spelling)


def step_stats(ops: Sequence[OpRecord], pp: int) -> StepStats:
    """Makespan, busy time, bubble and per-rank op order of one step's records."""
    if not ops:
        raise ValueError("no ops recorded in this step")
    t0 = min(o.start for o in ops)
    makespan = max(o.end for o in ops) - t0
    busy = [0.0] * pp
    orders: list[list[str]] = [[] for _ in range(pp)]
    for o in sorted(ops, key=lambda o: o.start):
        busy[o.rank] += o.duration
        orders[o.rank].append(f"{o.stage}{o.kind}{o.microbatch}")
    return StepStats(
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=1.0 - sum(busy) / (pp * makespan),
        orders=tuple(tuple(r) for r in orders),
    )


def stage_op_times(
    steps: Sequence[Sequence[OpRecord]], n_stages: int
) -> tuple[list[float], list[float]]:
    """Mean forward and backward op time of each global stage over the given steps."""
    f: list[list[float]] = [[] for _ in range(n_stages)]
    b: list[list[float]] = [[] for _ in range(n_stages)]
    for ops in steps:
        for o in ops:
            (f if o.kind == "F" else b)[o.stage].append(o.duration)
    return [statistics.fmean(x) for x in f], [statistics.fmean(x) for x in b]


@dataclass(frozen=True)
class OpWait:
    """When an op could have started: its rank free (`free`) and its inputs there (`ready`)."""

    op: OpRecord
    free: float  # end of the rank's previous op (the step's first start for its first op)
    ready: float  # end of the ops it depends on (`free` when it depends on none)
    cross_rank: bool  # its input came from another rank

    @property
    def slack(self) -> float:
        """Idle with the rank free and the inputs there: p2p, Python between ops, CPU sharing."""
        return self.op.start - max(self.free, self.ready)


def op_waits(ops: Sequence[OpRecord], pp: int) -> list[OpWait]:
    """Each op with what it waited for, by the simulator's dependency rules (F of stage s on
    F of s-1; B of s on its own F and B of s+1)."""
    n_stages = 1 + max(o.stage for o in ops)
    t0 = min(o.start for o in ops)
    end = {(o.kind, o.stage, o.microbatch): o.end for o in ops}
    out = []
    for r in range(pp):
        free = t0
        for o in sorted((o for o in ops if o.rank == r), key=lambda o: o.start):
            if o.kind == "F":
                deps = [("F", o.stage - 1, o.microbatch)] if o.stage > 0 else []
            else:
                deps = [("F", o.stage, o.microbatch)]
                if o.stage < n_stages - 1:
                    deps.append(("B", o.stage + 1, o.microbatch))
            ready = max((end[d] for d in deps), default=free)
            cross = any(d[1] % pp != r for d in deps)
            out.append(OpWait(o, free, ready, cross))
            free = o.end
    return out


def p2p_gaps(ops: Sequence[OpRecord], pp: int) -> list[float]:
    """For each op that sat waiting on another rank's output (its rank was free first), the
    time from that output's end to this op's start: send, receive and the bookkeeping between."""
    return [w.op.start - w.ready for w in op_waits(ops, pp) if w.cross_rank and w.free <= w.ready]


def slack_fraction(ops: Sequence[OpRecord], pp: int) -> float:
    """Share of rank-time (pp x makespan) spent idle while the next op could have run."""
    st = step_stats(ops, pp)
    return sum(max(0.0, w.slack) for w in op_waits(ops, pp)) / (pp * st.makespan)


def replay(ops: Sequence[OpRecord], pp: int, t_p2p: float = 0.0) -> SimResult:
    """The simulator run on a measured step: its per-rank orders, every op its measured time.

    What is left between this and the measured step is idle the dependency model does not hold
    (slack); between this and a simulation from per-stage means, the ops' spread in time.
    """
    orders = [
        [Op(o.kind, o.stage, r, o.stage // pp, o.microbatch)  # type: ignore[arg-type]
         for o in sorted((o for o in ops if o.rank == r), key=lambda o: o.start)]
        for r in range(pp)
    ]  # fmt: skip
    costs = {(o.kind, o.stage, o.microbatch): o.duration for o in ops}
    return simulate_orders(orders, t_p2p=t_p2p, schedule="replay", op_costs=costs)


def as_sim_result(
    ops: Sequence[OpRecord], schedule: str, pp: int, microbatches: int, chunks: int
) -> SimResult:
    """A measured step in the simulator's result type (time 0 = first op start), for plotting."""
    st = step_stats(ops, pp)
    t0 = min(o.start for o in ops)
    timeline = tuple(
        TimedOp(o.rank, Op(o.kind, o.stage, o.rank, o.stage // pp, o.microbatch),  # type: ignore[arg-type]
                o.start - t0, o.end - t0)
        for o in sorted(ops, key=lambda o: (o.start, o.rank))
    )  # fmt: skip
    return SimResult(
        schedule=schedule,
        pp=pp,
        microbatches=microbatches,
        chunks=chunks,
        makespan=st.makespan,
        bubble_fraction=st.bubble_fraction,
        busy=st.busy,
        idle=tuple(st.makespan - b for b in st.busy),
        peak_inflight=tuple(_peak_held(order) for order in st.orders),
        timeline=timeline,
    )


def _peak_held(order: Sequence[str]) -> int:
    held = peak = 0
    for name in order:
        held += 1 if "F" in name else -1
        peak = max(peak, held)
    return peak
