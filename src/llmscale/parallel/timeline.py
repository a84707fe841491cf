"""Measured pipeline timelines, analysed: the records of `instrument/pipeline.py` in the
simulator's terms.

`PipelineTimeline.load` reads a run's pipeline_timeline.json; `step_stats`, `stage_op_times`,
`op_waits`, `replay`, `rank_op_orders`, ... are plain Python over its records (no torch).

Ops are F, B and W (the weight-gradient half of a split backward: zero_bubble, zbv, dualpipev);
a step's per-rank order (`rank_op_orders`) is what the simulator's op lists and torch's own
`pipeline_order` (`parallel.pipeline.schedule_op_order`) are compared with.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from llmscale.plan.schedule import Op, SimResult, TimedOp, simulate_orders


@dataclass(frozen=True)
class OpRecord:
    """One forward (F), backward (B) or weight-gradient (W) op of one microbatch through one
    stage, as it ran."""

    rank: int  # pipeline rank
    kind: str  # "F" | "B" | "W"
    stage: int  # global stage index
    microbatch: int
    start: float  # seconds on the shared clock
    end: float
    # The stage's place among its rank's stages (0, 1, ...); None in files written before it was
    # recorded, where the placement was loop style (chunk = stage // pp).
    chunk: int | None = None

    def chunk_of(self, pp: int) -> int:
        return self.chunk if self.chunk is not None else self.stage // pp

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
                OpRecord(
                    o["rank"],
                    o["kind"],
                    o["stage"],
                    o["microbatch"],
                    o["start"],
                    o["end"],
                    o.get("chunk"),
                )
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
    """Mean forward and backward op time of each global stage over the given steps (W ops
    left out: `stage_kind_times(..., "W")`)."""
    return stage_kind_times(steps, n_stages, "F"), stage_kind_times(steps, n_stages, "B")


def stage_kind_times(steps: Sequence[Sequence[OpRecord]], n_stages: int, kind: str) -> list[float]:
    """Mean time of the `kind` ops ("F", "B" or "W") of each global stage over the given steps."""
    t: list[list[float]] = [[] for _ in range(n_stages)]
    for ops in steps:
        for o in ops:
            if o.kind == kind:
                t[o.stage].append(o.duration)
    return [statistics.fmean(x) for x in t]


class OrderedOp(NamedTuple):
    """One op of a rank's order, as the simulator and torch's pipeline_order name it."""

    kind: str  # "F" | "B" | "W"
    stage: int
    microbatch: int


def rank_op_orders(ops: Sequence[OpRecord], pp: int) -> list[list[OrderedOp]]:
    """Each pipeline rank's ops of one step in the order they started: (kind, stage,
    microbatch) tuples, one list per rank."""
    out: list[list[OrderedOp]] = [[] for _ in range(pp)]
    for o in sorted(ops, key=lambda o: o.start):
        out[o.rank].append(OrderedOp(o.kind, o.stage, o.microbatch))
    return out


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
    F of s-1; B of s on its own F and B of s+1; W of s on its own B)."""
    n_stages = 1 + max(o.stage for o in ops)
    t0 = min(o.start for o in ops)
    end = {(o.kind, o.stage, o.microbatch): o.end for o in ops}
    rank_of = {o.stage: o.rank for o in ops}  # loop style or a V: as recorded
    out = []
    for r in range(pp):
        free = t0
        for o in sorted((o for o in ops if o.rank == r), key=lambda o: o.start):
            if o.kind == "F":
                deps = [("F", o.stage - 1, o.microbatch)] if o.stage > 0 else []
            elif o.kind == "W":
                deps = [("B", o.stage, o.microbatch)]
            else:
                deps = [("F", o.stage, o.microbatch)]
                if o.stage < n_stages - 1:
                    deps.append(("B", o.stage + 1, o.microbatch))
            ready = max((end[d] for d in deps), default=free)
            cross = any(rank_of.get(d[1], r) != r for d in deps)
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
    costs = {(o.kind, o.stage, o.microbatch): o.duration for o in ops}
    split = any(o.kind == "W" for o in ops)
    orders: list[list[Op]] = []
    for r in range(pp):
        order: list[Op] = []
        for o in sorted((o for o in ops if o.rank == r), key=lambda o: o.start):
            order.append(Op(o.kind, o.stage, r, o.chunk_of(pp), o.microbatch))  # type: ignore[arg-type]
            if split and o.kind == "B" and ("W", o.stage, o.microbatch) not in costs:
                # A backward torch ran whole (dualpipev): the simulator's B and a joined W,
                # the W costing nothing (its work is in the measured B).
                order.append(Op("W", o.stage, r, o.chunk_of(pp), o.microbatch, joined=True))
        orders.append(order)
    costs.update(
        {("W", op.stage, op.microbatch): 0.0 for order in orders for op in order if op.joined}
    )
    return simulate_orders(orders, t_p2p=t_p2p, schedule="replay", op_costs=costs)


def as_sim_result(
    ops: Sequence[OpRecord], schedule: str, pp: int, microbatches: int, chunks: int
) -> SimResult:
    """A measured step in the simulator's result type (time 0 = first op start), for plotting."""
    st = step_stats(ops, pp)
    t0 = min(o.start for o in ops)
    timeline = tuple(
        TimedOp(o.rank, Op(o.kind, o.stage, o.rank, o.chunk_of(pp), o.microbatch),  # type: ignore[arg-type]
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
    """Most microbatch-chunks held at once: from the end of an F to its W where the backward is
    split, else to its B (names "1F3", "1B3", "1W3")."""
    split = {name.replace("W", "B") for name in order if "W" in name}
    held = peak = 0
    for name in order:
        if "F" in name:
            held += 1
        elif "W" in name or name not in split:
            held -= 1
        peak = max(peak, held)
    return peak
