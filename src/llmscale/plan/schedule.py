"""Pipeline-parallel schedules as explicit per-rank op lists, and a discrete-event simulator.

`schedule_ops` gives the ordered forward (F) / backward (B) ops each pipeline rank runs for
GPipe, 1F1B and interleaved 1F1B, in the order torch.distributed.pipelining executes them
(Schedule{GPipe,1F1B,Interleaved1F1B}), which for 1F1B and interleaved 1F1B is also
Megatron-Core's order. Where torch has none (1F1B with microbatches < pp) we follow Megatron-Core;
docs/schedule.md lists every difference. `simulate` replays those orders against the data
dependencies between stages and reports makespan, bubble and activations held.

Stages are numbered loop-style, as torch and Megatron do: rank r holds chunks c = 0..v-1, i.e.
global stages s = c * pp + r, so microbatch i visits rank 0, 1, ..., pp-1, 0, 1, ... in forward.

Cost convention: a scalar `t_fwd` / `t_bwd` is the time for one microbatch through *one rank's
whole model slice* (all of its chunks), so with v chunks one chunk op costs t / v and the total
work per rank does not depend on v. A sequence gives the cost of one op on each global stage
(length pp * v), for unequal stages. `t_p2p` is added to every dependency that crosses ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from llmscale.config import PP_SCHEDULES
from llmscale.errors import ConfigError

OpKind = Literal["F", "B"]
Costs = float | Sequence[float]


@dataclass(frozen=True)
class Op:
    """One forward or backward of one microbatch through one stage (model chunk) on one rank."""

    kind: OpKind
    stage: int
    rank: int
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        # torch's _Action spelling: stage, kind, microbatch ("4B0").
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class TimedOp:
    """An op as the simulator placed it on its rank's timeline."""

    rank: int
    op: Op
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Outcome of simulating one pipeline step (all microbatches through forward and backward)."""

    schedule: str
    pp: int
    microbatches: int
    chunks: int
    makespan: float
    bubble_fraction: float  # idle share of rank-time: 1 - sum(busy) / (pp * makespan)
    busy: tuple[float, ...]  # per rank
    idle: tuple[float, ...]  # per rank: makespan - busy
    # Per rank, the most microbatch-chunks whose forward has finished and backward has not
    # (activations held); one unit is one chunk's activations, 1/v of the rank's slice.
    peak_inflight: tuple[int, ...]
    timeline: tuple[TimedOp, ...]  # sorted by start time, then rank


class DeadlockError(RuntimeError):
    """Per-rank op orders whose data dependencies can never all be met."""


# ---- validation ---------------------------------------------------------------------------


def _positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "an integer >= 1")
    return value


# The most stage-microbatches (pp x chunks x microbatches) `llmscale schedule` simulates: the
# simulator costs ~12 us per op (2 per stage-microbatch), so this answers in ~1.6 s on a CPU
# core (measured: 64 x 1024 in 1.6 s, 64 x 4096 in 15 s). The planner's own calls are not capped.
MAX_STAGE_MICROBATCHES = 65_536


def check_size(pp: int, microbatches: int, chunks: int = 1) -> None:
    """Refuse a schedule too large to simulate within a few seconds."""
    for field, value in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        _positive_int(field, value)
    if pp * chunks * microbatches > MAX_STAGE_MICROBATCHES:
        raise ConfigError(
            "microbatches",
            microbatches,
            f"pp x chunks x microbatches <= {MAX_STAGE_MICROBATCHES:,} "
            f"(got {pp} x {chunks} x {microbatches})",
        )


def _validate(schedule: str, pp: int, microbatches: int, chunks: int) -> None:
    if schedule not in PP_SCHEDULES:
        raise ConfigError("schedule", schedule, " | ".join(PP_SCHEDULES))
    _positive_int("pp", pp)
    _positive_int("microbatches", microbatches)
    _positive_int("chunks", chunks)
    if schedule != "interleaved_1f1b" and chunks != 1:
        raise ConfigError("chunks", chunks, "1 unless schedule = 'interleaved_1f1b'")
    if schedule == "interleaved_1f1b" and microbatches % pp != 0:
        # Megatron-Core asserts this; torch 2.13 relaxes it ("flex_pp"), we do not (see docs).
        raise ConfigError(
            "microbatches",
            microbatches,
            f"a multiple of pp = {pp} for interleaved_1f1b",
        )


# ---- per-rank orders ----------------------------------------------------------------------


def _warmup_forwards(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> int:
    """Forward ops a rank runs before its first backward (torch 2.13 / Megatron-Core counts)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - rank - 1, microbatches)
    # Every rank first fills its earlier chunks with one round of pp microbatches each, then
    # two more forwards per hop from the last rank: one to cover the F and one the B in flight.
    return min((chunks - 1) * pp + 2 * (pp - rank - 1), microbatches * chunks)


def _interleaved_op(kind: OpKind, k: int, pp: int, chunks: int, rank: int) -> Op:
    """The k-th forward (or k-th backward) of a rank in interleaved 1F1B.

    Ops go in rounds of pp microbatches per chunk: chunk 0 for microbatches 0..pp-1, chunk 1
    for the same microbatches, ..., then chunk 0 for pp..2pp-1. Backwards walk chunks in reverse.
    """
    chunk = (k // pp) % chunks
    if kind == "B":
        chunk = chunks - 1 - chunk
    microbatch = (k // (pp * chunks)) * pp + k % pp
    return Op(kind, chunk * pp + rank, rank, chunk, microbatch)


def _rank_order(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> list[Op]:
    total = microbatches * chunks
    warmup = _warmup_forwards(schedule, pp, microbatches, chunks, rank)

    def fwd(k: int) -> Op:
        if schedule == "interleaved_1f1b":
            return _interleaved_op("F", k, pp, chunks, rank)
        return Op("F", rank, rank, 0, k)

    def bwd(k: int) -> Op:
        if schedule == "interleaved_1f1b":
            return _interleaved_op("B", k, pp, chunks, rank)
        return Op("B", rank, rank, 0, k)

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):  # steady state: one forward, then one backward
        order += [fwd(warmup + k), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]  # cool-down
    return order


def schedule_ops(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> list[list[Op]]:
    """The ordered F/B ops of each pipeline rank: `result[rank]` is what that rank runs, in order."""
    _validate(schedule, pp, microbatches, chunks)
    return [_rank_order(schedule, pp, microbatches, chunks, r) for r in range(pp)]


# ---- closed forms -------------------------------------------------------------------------


def bubble_fraction(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """Closed-form bubble for equal stages and free p2p: (p-1)/(m+p-1), or (p-1)/(v*m+p-1)."""
    _validate(schedule, pp, microbatches, chunks)
    v = chunks if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def _closed_peak(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> int:
    # The count peaks right after the first steady-state forward, or at the end of warm-up when
    # warm-up is everything.
    warmup = _warmup_forwards(schedule, pp, microbatches, chunks, rank)
    return min(warmup + 1, microbatches * chunks)


def peak_inflight_closed_form(
    schedule: str, pp: int, microbatches: int, chunks: int = 1
) -> list[int]:
    """Per rank, the most microbatch-chunks with activations held (forward done, backward not)."""
    _validate(schedule, pp, microbatches, chunks)
    return [_closed_peak(schedule, pp, microbatches, chunks, r) for r in range(pp)]


def inflight_units(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> int:
    """Peak micro-batch-chunks whose activations pipeline `rank` holds in a training step.

    From the schedule's warm-up (`_warmup_forwards`, the one formula): GPipe m; 1F1B
    min(pp - rank, m); interleaved 1F1B min((v-1)pp + 2(pp-rank-1) + 1, m v) chunk units, each
    1/v of the rank's layers (on rank 0, pp(1 + (pp-1)/(pp v)) micro-batches' worth: Korthikanti
    et al. 2022 section 4.2.3). pp = 1 runs no schedule, only gradient accumulation: one
    micro-batch (all its chunks) at a time. The memory model (plan/memory.py) reads this.
    """
    if schedule not in PP_SCHEDULES:
        raise ConfigError("parallel.pp_schedule", schedule, " | ".join(PP_SCHEDULES))
    if pp == 1:
        return chunks
    return _closed_peak(schedule, pp, microbatches, chunks, rank)


# ---- simulation ---------------------------------------------------------------------------


def _stage_costs(field: str, t: Costs, n_stages: int, chunks: int) -> tuple[float, ...]:
    if isinstance(t, bool):
        raise ConfigError(field, t, "a finite number > 0")
    if isinstance(t, int | float):
        if not (math.isfinite(t) and t > 0):
            raise ConfigError(field, t, "a finite number > 0")
        return (float(t) / chunks,) * n_stages
    costs = tuple(t)
    if len(costs) != n_stages:
        raise ConfigError(field, list(costs), f"a number, or {n_stages} per-stage numbers")
    for c in costs:
        if (
            isinstance(c, bool)
            or not isinstance(c, int | float)
            or not (math.isfinite(c) and c > 0)
        ):
            raise ConfigError(field, list(costs), "per-stage finite numbers > 0")
    return tuple(float(c) for c in costs)


def _check_orders(orders: Sequence[Sequence[Op]]) -> tuple[int, int, int]:
    """Validate hand-made or built orders; return (pp, chunks, microbatches)."""
    pp = len(orders)
    if pp == 0:
        raise ConfigError("orders", [], "one op list per pipeline rank")
    ops = [op for rank_ops in orders for op in rank_ops]
    if not ops:
        raise ConfigError("orders", "no ops", "at least one F and one B")
    for r, rank_ops in enumerate(orders):
        for op in rank_ops:
            if op.kind not in ("F", "B") or op.rank != r or op.stage != op.chunk * pp + r:
                raise ConfigError(
                    "orders", str(op), f"ops on rank {r} with stage = chunk * {pp} + {r}"
                )
    n_stages = max(op.stage for op in ops) + 1
    microbatches = max(op.microbatch for op in ops) + 1
    if n_stages % pp != 0:
        raise ConfigError("orders", f"{n_stages} stages", f"a multiple of pp = {pp}")
    seen = {(op.kind, op.stage, op.microbatch) for op in ops}
    want = 2 * n_stages * microbatches
    if len(seen) != len(ops) or len(seen) != want or min(op.microbatch for op in ops) < 0:
        raise ConfigError(
            "orders",
            f"{len(ops)} ops, {len(seen)} distinct",
            f"exactly one F and one B per (stage, microbatch): {want}",
        )
    return pp, n_stages // pp, microbatches


def simulate_orders(
    orders: Sequence[Sequence[Op]],
    t_fwd: Costs = 1.0,
    t_bwd: Costs = 2.0,
    t_p2p: float = 0.0,
    schedule: str = "custom",
    op_costs: Mapping[tuple[str, int, int], float] | None = None,
) -> SimResult:
    """Replay given per-rank op orders; each rank runs its ops in order, one at a time.

    An op starts when its rank is free and its inputs are ready: F of stage s for microbatch i
    needs F of stage s-1 for i; B of stage s needs the own F and B of stage s+1 (the last
    stage's B needs only its F: the loss). `t_p2p` is added when the producer is on another rank.
    `op_costs` maps (kind, stage, microbatch) to one op's own cost, over the per-stage costs
    (e.g. every op's measured time, to replay a measured step).
    Raises DeadlockError when some rank waits on an op that can never run.
    """
    pp, chunks, microbatches = _check_orders(orders)
    n_stages = pp * chunks
    cost = {
        "F": _stage_costs("t_fwd", t_fwd, n_stages, chunks),
        "B": _stage_costs("t_bwd", t_bwd, n_stages, chunks),
    }
    if isinstance(t_p2p, bool) or not (math.isfinite(t_p2p) and t_p2p >= 0):
        raise ConfigError("t_p2p", t_p2p, "a finite number >= 0")
    for key, c in (op_costs or {}).items():
        if isinstance(c, bool) or not (math.isfinite(c) and c >= 0):
            raise ConfigError("op_costs", f"{key}: {c}", "finite numbers >= 0")

    end: dict[_Key, float] = {}
    free_at = [0.0] * pp
    nxt = [0] * pp
    timeline: list[TimedOp] = []
    remaining = sum(len(o) for o in orders)
    # Start times are a longest path through a DAG (rank order + data edges), so visiting the
    # ranks round-robin gives the same times as a time-ordered event queue.
    while remaining:
        progressed = False
        for r in range(pp):
            while nxt[r] < len(orders[r]):
                op = orders[r][nxt[r]]
                ready = 0.0
                for key, lat in _deps(op, n_stages, pp, t_p2p):
                    if key not in end:
                        break
                    ready = max(ready, end[key] + lat)
                else:
                    start = max(free_at[r], ready)
                    c = cost[op.kind][op.stage]
                    if op_costs is not None:
                        c = op_costs.get((op.kind, op.stage, op.microbatch), c)
                    finish = start + c
                    end[(op.kind, op.stage, op.microbatch)] = finish
                    free_at[r] = finish
                    timeline.append(TimedOp(r, op, start, finish))
                    nxt[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            raise DeadlockError(_deadlock_message(orders, nxt, end))

    makespan = max(free_at)
    busy = [0.0] * pp
    for t in timeline:
        busy[t.rank] += t.end - t.start
    return SimResult(
        schedule=schedule,
        pp=pp,
        microbatches=microbatches,
        chunks=chunks,
        makespan=makespan,
        bubble_fraction=1.0 - sum(busy) / (pp * makespan),
        busy=tuple(busy),
        idle=tuple(makespan - b for b in busy),
        peak_inflight=tuple(_peak_inflight(o) for o in orders),
        timeline=tuple(sorted(timeline, key=lambda t: (t.start, t.rank))),
    )


_Key = tuple[str, int, int]  # (kind, stage, microbatch)


def _deps(op: Op, n_stages: int, pp: int, t_p2p: float) -> list[tuple[_Key, float]]:
    """The ops `op` waits for, each with the latency between its end and `op`'s start."""
    s, i = op.stage, op.microbatch

    def hop(src: int) -> float:
        return t_p2p if src % pp != s % pp else 0.0

    if op.kind == "F":
        return [] if s == 0 else [(("F", s - 1, i), hop(s - 1))]
    out: list[tuple[_Key, float]] = [(("F", s, i), 0.0)]
    if s < n_stages - 1:
        out.append((("B", s + 1, i), hop(s + 1)))
    return out


def _deadlock_message(
    orders: Sequence[Sequence[Op]], nxt: list[int], end: dict[_Key, float]
) -> str:
    pp = len(orders)
    n_stages = max(op.stage for rank_ops in orders for op in rank_ops) + 1
    stuck = []
    for r, rank_ops in enumerate(orders):
        if nxt[r] < len(rank_ops):
            op = rank_ops[nxt[r]]
            waits = [f"{k[1]}{k[0]}{k[2]}" for k, _ in _deps(op, n_stages, pp, 0.0) if k not in end]
            stuck.append(f"rank {r} at op #{nxt[r]} ({op}) waits for {', '.join(waits)}")
    return "pipeline order deadlocks: " + "; ".join(stuck)


def _peak_inflight(rank_ops: Sequence[Op]) -> int:
    held = peak = 0
    for op in rank_ops:
        held += 1 if op.kind == "F" else -1
        peak = max(peak, held)
    return peak


def simulate(
    schedule: str,
    pp: int,
    microbatches: int,
    chunks: int = 1,
    t_fwd: Costs = 1.0,
    t_bwd: Costs = 2.0,
    t_p2p: float = 0.0,
) -> SimResult:
    """Simulate one step of `schedule`; scalar costs are per whole rank slice (chunk op = t/v)."""
    orders = schedule_ops(schedule, pp, microbatches, chunks)
    return simulate_orders(orders, t_fwd, t_bwd, t_p2p, schedule=schedule)
