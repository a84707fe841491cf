"""Pipeline-parallel schedules as explicit per-rank op lists, and a discrete-event simulator.

`schedule_ops` gives the ordered forward (F), backward (B) and weight-gradient (W) ops each
pipeline rank runs for GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble, ZB-V and DualPipeV,
in the order torch.distributed.pipelining 2.13 executes them (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
ScheduleDualPipeV); for 1F1B and interleaved 1F1B that is also Megatron-Core's order. Where torch
has none (1F1B with microbatches < pp) we follow Megatron-Core; docs/schedule.md lists every
difference. `simulate` replays those orders against the data dependencies between stages and
reports makespan, bubble and activations held.

B and W. GPipe, 1F1B and interleaved 1F1B run each backward whole: one B op (input and weight
gradients). The zero-bubble schedules (`SPLIT_BACKWARD_SCHEDULES`) split it, as torch's
BACKWARD_INPUT and BACKWARD_WEIGHT: B computes the input gradient (what the previous stage
waits for) and W the weight gradient, run later to fill bubbles. Where such a schedule runs a
full backward (torch's FULL_BACKWARD, in DualPipeV) it is a B and its W back to back, the W
`joined` to the B; DualPipeV's overlapped forward-and-backward actions (OVERLAP_F_B) are their
F, then B and W, back to back and joined: torch runs the two sub-actions one after the other
and sends their outputs when the whole action ends, and so does the simulator.

Stages: loop-style for GPipe, 1F1B, interleaved 1F1B and zero bubble, as torch and Megatron
number them (rank r holds chunks c = 0..v-1, global stages s = c * pp + r); a V for ZB-V and
DualPipeV (rank r holds stage r and stage 2 pp - 1 - r: `model.config.stage_ids(v_shape=True)`).

Cost convention: a scalar `t_fwd` / `t_bwd` is the time for one microbatch through *one rank's
whole model slice* (all of its chunks), so with v chunks one chunk op costs t / v and the total
work per rank does not depend on v. `t_bwd` is always the whole backward; `t_w` is the weight
gradient's part of it (default half), so a split schedule's B costs t_bwd - t_w and its W t_w.
A sequence gives the cost of one op on each global stage (length pp * v), for unequal stages.
`t_p2p` is added to every dependency that crosses ranks.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from llmscale.config import (
    LOOP_MULTI_CHUNK_SCHEDULES,
    PP_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    V_SCHEDULES,
)
from llmscale.errors import ConfigError
from llmscale.model.config import stage_ids
from llmscale.plan.cache import Memo, memoize_values

OpKind = Literal["F", "B", "W"]
Costs = float | Sequence[float]


@dataclass(frozen=True)
class Op:
    """One forward, backward (input gradient; the whole backward in unsplit schedules) or
    weight-gradient op of one microbatch through one stage (model chunk) on one rank.

    `joined`: run in one torch action with the op before it on its rank (a full backward's W
    after its B; an overlapped action's B and W after its F). The action's outputs leave the
    rank when its last op ends."""

    kind: OpKind
    stage: int
    rank: int
    chunk: int
    microbatch: int
    joined: bool = False

    def __str__(self) -> str:
        # torch's _Action spelling: stage, kind, microbatch ("4B0").
        return f"{self.stage}{self.kind}{self.microbatch}"


class TimedOp(NamedTuple):
    """An op as the simulator placed it on its rank's timeline (a named tuple: a step of a
    large pipeline places tens of thousands)."""

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
    # Per rank, the most microbatch-chunks whose forward has finished and whose activations are
    # still held: until the B (unsplit) or the W (split backward); one unit is one chunk's
    # activations, 1/v of the rank's slice.
    peak_inflight: tuple[int, ...]
    timeline: tuple[TimedOp, ...]  # sorted by start time, then rank
    split_backward: bool = False  # W ops apart from B (zero-bubble schedules)


class DeadlockError(RuntimeError):
    """Per-rank op orders whose data dependencies can never all be met."""


# ---- validation ---------------------------------------------------------------------------


def _positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "an integer >= 1")
    return value


# The most stage-microbatches (pp x chunks x microbatches) `llmscale schedule` simulates: the
# simulator costs ~12 us per op (2 per stage-microbatch, 3 with W), so this answers in ~2 s on
# a CPU core (measured: 64 x 1024 in 1.6 s, 64 x 4096 in 15 s). The planner's own calls are
# not capped.
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


def zero_bubble_rounds(pp: int, microbatches: int) -> int:
    """Rounds of ScheduleInterleavedZeroBubble (and torch's flex interleaved 1F1B):
    max(1, m // pp); the microbatches must divide into them."""
    return max(1, microbatches // pp)


def _validate(schedule: str, pp: int, microbatches: int, chunks: int) -> None:
    if schedule not in PP_SCHEDULES:
        raise ConfigError("schedule", schedule, " | ".join(PP_SCHEDULES))
    _positive_int("pp", pp)
    _positive_int("microbatches", microbatches)
    _positive_int("chunks", chunks)
    if schedule in V_SCHEDULES:
        if chunks != 2:
            raise ConfigError("chunks", chunks, f"2 for {schedule} (two chunks in a V)")
        if pp < 2:
            raise ConfigError("pp", pp, f">= 2 for {schedule}")
    elif schedule not in LOOP_MULTI_CHUNK_SCHEDULES and chunks != 1:
        multi = " | ".join(LOOP_MULTI_CHUNK_SCHEDULES)
        raise ConfigError("chunks", chunks, f"1 unless schedule is {multi}")
    if schedule == "interleaved_1f1b" and microbatches % pp != 0:
        # Megatron-Core asserts this; torch 2.13 relaxes it ("flex_pp"), we do not (see docs).
        raise ConfigError(
            "microbatches",
            microbatches,
            f"a multiple of pp = {pp} for interleaved_1f1b",
        )
    if schedule == "zero_bubble":
        rounds = zero_bubble_rounds(pp, microbatches)
        if microbatches % rounds:
            raise ConfigError(
                "microbatches",
                microbatches,
                f"a multiple of torch's rounds max(1, m // pp) = {rounds} for zero_bubble",
            )
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise ConfigError("microbatches", microbatches, f">= 2 x pp = {2 * pp} for dualpipev")


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


# An op of a rank's order without its rank: (kind, stage, chunk, microbatch, joined). The
# builders below give these (cheaper than `Op`s: the simulator's graph and the held-memory
# frontier read tens of thousands); `_order` makes them `Op`s.
_Action = tuple[OpKind, int, int, int, bool]


def _interleaved_op(kind: OpKind, k: int, pp: int, chunks: int, rank: int) -> _Action:
    """The k-th forward (or k-th backward) of a rank in interleaved 1F1B.

    Ops go in rounds of pp microbatches per chunk: chunk 0 for microbatches 0..pp-1, chunk 1
    for the same microbatches, ..., then chunk 0 for pp..2pp-1. Backwards walk chunks in reverse.
    """
    chunk = (k // pp) % chunks
    if kind == "B":
        chunk = chunks - 1 - chunk
    microbatch = (k // (pp * chunks)) * pp + k % pp
    return (kind, chunk * pp + rank, chunk, microbatch, False)


def _rank_order(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> list[_Action]:
    total = microbatches * chunks
    warmup = _warmup_forwards(schedule, pp, microbatches, chunks, rank)
    # the k-th forward and the k-th backward
    if schedule == "interleaved_1f1b":
        fwds = [_interleaved_op("F", k, pp, chunks, rank) for k in range(total)]
        bwds = [_interleaved_op("B", k, pp, chunks, rank) for k in range(total)]
    else:
        fwds = [("F", rank, 0, k, False) for k in range(total)]
        bwds = [("B", rank, 0, k, False) for k in range(total)]
    order = fwds[:warmup]
    for f, b in zip(fwds[warmup:], bwds, strict=False):  # steady state: a forward, a backward
        order += (f, b)
    order += bwds[total - warmup :]  # cool-down
    return order


def _zero_bubble_order(pp: int, microbatches: int, chunks: int, rank: int) -> list[_Action]:
    """ScheduleInterleavedZeroBubble (ZB1P over v loop-style chunks): interleaved 1F1B's
    rounds, one forward less per hop in warm-up, B = input gradient only, and from the
    (rank+1)-th steady step on each B followed by the W of the oldest B whose W is pending;
    the remaining Ws at the end (torch's `_get_1f1b_rank_ops(enable_zero_bubble=True)`)."""
    counts: dict[tuple[str, int], int] = {}
    order: list[_Action] = []
    for kind, stage in _zero_bubble_actions(pp, microbatches, chunks, rank):
        mb = counts.get((kind, stage), 0)
        counts[(kind, stage)] = mb + 1
        order.append((kind, stage, stage // pp, mb, False))
    return order


def _zero_bubble_actions(
    pp: int, microbatches: int, chunks: int, rank: int, forwards: bool = True
) -> list[tuple[OpKind, int]]:
    """`_zero_bubble_order` as (kind, stage) pairs (the held-memory frontier reads only these;
    `forwards` False leaves the Fs out). Step k's F runs stage ((k // r) % v) pp + rank, with
    r micro-batches per round; from the warm-up's end its B runs the chunks in reverse, and
    each W the stage of the oldest B whose W is pending."""
    per_round = microbatches // zero_bubble_rounds(pp, microbatches)
    total = microbatches * chunks
    warmup = min((chunks - 1) * per_round + (pp - 1 - rank), total)
    top = (chunks - 1) * pp + rank  # the last chunk's stage, where the Bs start

    order: list[tuple[OpKind, int]] = []
    add = order.append
    b_stages: list[int] = []  # each B's stage, in order: the Ws follow them
    w_done = 0
    if forwards:
        for step in range(warmup):
            add(("F", ((step // per_round) % chunks) * pp + rank))
    for step in range(warmup, total + warmup):
        if forwards and step < total:
            add(("F", ((step // per_round) % chunks) * pp + rank))
        stage = top - (((step - warmup) // per_round) % chunks) * pp
        add(("B", stage))
        b_stages.append(stage)
        if step - warmup >= rank:  # torch's num_1f1b_microbatches = rank
            add(("W", b_stages[w_done]))
            w_done += 1
    for stage in b_stages[w_done:]:
        add(("W", stage))
    return order


def _zbv_actions(pp: int, microbatches: int, rank: int) -> list[_Action]:
    """ScheduleZBVZeroBubble (Qi et al. 2023, section 6): V placement, chunk 0 forwards to fill
    the V, then F/B/W of chunk 1 and chunk 0 in turn; planned for max(2pp - 1, m) microbatches
    and the extra ones dropped, as torch does."""
    n = max(2 * pp - 1, microbatches)
    s0, s1 = stage_ids(rank, pp, 2, v_shape=True)
    order: list[_Action] = []
    f0 = f1 = b0 = b1 = 0

    def add(kind: OpKind, stage: int, mb: int) -> None:
        if mb < microbatches:
            order.append((kind, stage, 0 if stage == s0 else 1, mb, False))

    for _ in range(2 * (pp - rank) - 1):
        add("F", s0, f0)
        f0 += 1
    for _ in range(rank):
        add("F", s1, f1)
        f1 += 1
        add("F", s0, f0)
        f0 += 1
    for _ in range(pp - rank):
        add("F", s1, f1)
        f1 += 1
        add("B", s1, b1)
        add("W", s1, b1)
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            add("F", s0, f0)
            f0 += 1
        add("B", s0, b0)
        add("W", s0, b0)
        b0 += 1
        add("F", s1, f1)
        f1 += 1
        add("B", s1, b1)
        add("W", s1, b1)
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        add("B", s0, b0)
        b0 += 1
        add("B", s1, b1)
        b1 += 1
    for _ in range(pp - rank):
        add("B", s0, b0)
        b0 += 1
        add("W", s0, w0)
        w0 += 1
    for w in range(w1, b1):
        add("W", s1, w)
    for w in range(w0, b0):
        add("W", s0, w)
    return order


def _dualpipev_actions(pp: int, microbatches: int, rank: int) -> list[_Action]:
    """ScheduleDualPipeV (DeepSeek-V3's DualPipe cut to a V, as torch 2.13 builds it): eight
    phases of forwards, zero-bubble B/W pairs, overlapped F+B actions of different
    microbatches (F, then the full backward's B and W, joined) and full backwards (B, W
    joined); the Ws of split backwards wait in a queue and run in its order."""
    s0, s1 = stage_ids(rank, pp, 2, v_shape=True)
    count: dict[tuple[str, int], int] = {}
    queue: list[tuple[int, int]] = []  # pending (stage, microbatch) weight gradients
    order: list[_Action] = []

    def op(kind: OpKind, stage: int, mb: int, joined: bool = False) -> _Action:
        return (kind, stage, 0 if stage == s0 else 1, mb, joined)

    def forward(stage: int, joined: bool = False) -> None:
        mb = count.get(("F", stage), 0)
        count[("F", stage)] = mb + 1
        order.append(op("F", stage, mb, joined))

    def backward(stage: int, full: bool, joined: bool = False) -> None:
        mb = count.get(("B", stage), 0)
        count[("B", stage)] = mb + 1
        order.append(op("B", stage, mb, joined))
        if full:
            order.append(op("W", stage, mb, joined=True))
        else:
            queue.append((stage, mb))

    def weight() -> None:
        if queue:
            stage, mb = queue.pop(0)
            order.append(op("W", stage, mb))

    def overlapped(f_stage: int, b_stage: int) -> None:
        forward(f_stage)
        backward(b_stage, full=True, joined=True)

    for _ in range(2 * (pp - rank - 1)):  # 1: F0
        forward(s0)
    for _ in range(rank + 1):  # 2: F0 F1
        forward(s0)
        forward(s1)
    for _ in range(pp - rank - 1):  # 3: B1 W1 F1 (zero bubble)
        backward(s1, full=False)
        weight()
        forward(s1)
    for i in range(microbatches - 2 * pp + rank + 1):  # 4: F0+B1, F1+B0 overlapped
        if i == 0 and rank == pp - 1:  # torch does not overlap these two
            forward(s0)
            backward(s1, full=True)
        else:
            overlapped(s0, s1)
        overlapped(s1, s0)
    for _ in range(pp - rank - 1):  # 5: B1, F1+B0
        backward(s1, full=True)
        overlapped(s1, s0)
    split = False
    for i in range(rank + 1):  # 6: B1 B0, the second half split
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(s1, full=not split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(s0, full=not split)
    for _ in range(pp - rank - 1):  # 7: W B0
        weight()
        backward(s0, full=not split)
    for _ in range(rank + 1):  # 8: W
        weight()
    return order


_ORDERS: dict[str, Callable[[int, int, int, int], list[_Action]]] = {
    "zero_bubble": _zero_bubble_order,
    "zbv": lambda pp, m, v, r: _zbv_actions(pp, m, r),
    "dualpipev": lambda pp, m, v, r: _dualpipev_actions(pp, m, r),
}


def _actions(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> list[_Action]:
    """`rank`'s order as actions, unvalidated: its schedule's own builder, or the warm-up form."""
    build = _ORDERS.get(schedule)
    if build is not None:
        return build(pp, microbatches, chunks, rank)
    return _rank_order(schedule, pp, microbatches, chunks, rank)


def _order(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> list[Op]:
    """`rank`'s order, unvalidated (`_actions` as `Op`s)."""
    actions = _actions(schedule, pp, microbatches, chunks, rank)
    return [Op(k, s, rank, c, mb, j) for k, s, c, mb, j in actions]


@memoize_values
def rank_ops(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> tuple[Op, ...]:
    """`schedule_ops(...)[rank]` without the other ranks, unvalidated, cached: the memory
    model walks one rank's order for several quantities."""
    return tuple(_order(schedule, pp, microbatches, chunks, rank))


def schedule_ops(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> list[list[Op]]:
    """The ordered F/B(/W) ops of each pipeline rank: `result[rank]` is what that rank runs."""
    _validate(schedule, pp, microbatches, chunks)
    return [_order(schedule, pp, microbatches, chunks, r) for r in range(pp)]


def schedule_actions(
    schedule: str, pp: int, microbatches: int, chunks: int = 1
) -> list[list[tuple[str, int]]]:
    """`schedule_ops` as each rank's (kind, stage) pairs, without building `Op`s (the time
    model replays FSDP's all-gathers on orders of thousands of ops)."""
    return [rank_actions(schedule, pp, microbatches, chunks, r) for r in range(pp)]


def rank_actions(
    schedule: str, pp: int, microbatches: int, chunks: int, rank: int
) -> list[tuple[str, int]]:
    """`schedule_actions(...)[rank]`, that rank's alone."""
    _validate(schedule, pp, microbatches, chunks)
    if schedule == "zero_bubble":  # its pairs come without micro-batch numbers
        return [(k, s) for k, s in _zero_bubble_actions(pp, microbatches, chunks, rank)]
    return [(a[0], a[1]) for a in _actions(schedule, pp, microbatches, chunks, rank)]


# ---- closed forms -------------------------------------------------------------------------


def bubble_fraction(
    schedule: str,
    pp: int,
    microbatches: int,
    chunks: int = 1,
    t_fwd: float = 1.0,
    t_bwd: float = 2.0,
    t_w: float | None = None,
) -> float:
    """Closed-form bubble for equal stages and free p2p (costs per rank slice, as `simulate`).

    GPipe, 1F1B: (p-1)/(m+p-1); interleaved 1F1B: (p-1)/(v m+p-1), whatever the costs. The
    zero-bubble schedules: idle time per rank over idle plus work, the idle time from the papers
    with chunk costs F, B (input gradient), W: zero_bubble (ZB-H1, Qi et al. 2023 Table 2, over
    v chunks) (p-1)(F + B - W); zbv (ZB-V, their section 6) (p-1)(F + B - 2W) plus the one
    step's (p-1) F of skew; dualpipev (DeepSeek-V3 report, the DualPipe README's DualPipeV
    row with 2p stages) (p-1)(F&B + B_full - 3W), F&B = F + B_full (overlap not modelled).
    zero_bubble's equals the simulator's for any costs; zbv's and dualpipev's at F = B = W
    (the papers' assumption) with m >= 2p (docs/schedule.md has the figures).
    """
    _validate(schedule, pp, microbatches, chunks)
    slots = idle_slots(schedule, pp, chunks)
    if slots is not None:
        return slots / (microbatches + slots)
    idle = bubble_time(schedule, pp, chunks, t_fwd, t_bwd, t_w)
    assert idle is not None  # a split-backward schedule
    work = microbatches * (t_fwd + t_bwd)
    return idle / (idle + work)


def idle_slots(schedule: str, pp: int, chunks: int) -> float | None:
    """Idle slots per rank, each one micro-batch's forward and backward, of the schedules whose
    bubble is a ratio of counts (`bubble_fraction`): pp - 1 for GPipe and 1F1B, (pp - 1) / v
    interleaved; None for the split-backward ones, whose idle time `bubble_time` gives."""
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        return None
    return (pp - 1) / chunks if schedule == "interleaved_1f1b" else float(pp - 1)


def default_t_w(t_bwd: float) -> float:
    """The weight-gradient share of a backward when none is given: half (a linear's backward
    is two GEMMs of equal size, dX = dY W^T and dW = X^T dY)."""
    return t_bwd / 2


def bubble_time(
    schedule: str, pp: int, chunks: int, t_fwd: float, t_bwd: float, t_w: float | None = None
) -> float | None:
    """Idle time per rank of the zero-bubble schedules' closed forms (see `bubble_fraction`),
    from costs per rank slice; None for the schedules whose bubble is a ratio of counts."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return None
    w_total = default_t_w(t_bwd) if t_w is None else t_w
    f, b, w = t_fwd / chunks, (t_bwd - w_total) / chunks, w_total / chunks
    if schedule == "zero_bubble":
        idle = (pp - 1) * (f + b - w)
    elif schedule == "zbv":
        # The paper's (p-1)(F + B - 2W) counts a repeating step with no optimizer sync (its
        # parallelogram); one synchronous step also has the (p-1) F of skew before the last
        # rank's first forward.
        idle = (pp - 1) * (max(0.0, f + b - 2 * w) + f)
    else:  # dualpipev
        full = b + w
        idle = (pp - 1) * ((f + full) + full - 3 * w)
    return max(0.0, idle)


def _closed_peak(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> int:
    # The count peaks right after the first steady-state forward, or at the end of warm-up when
    # warm-up is everything.
    if schedule in _ORDERS:
        return _split_peak(schedule, pp, microbatches, chunks, rank)
    warmup = _warmup_forwards(schedule, pp, microbatches, chunks, rank)
    return min(warmup + 1, microbatches * chunks)


def _split_peak(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> int:
    """Peak activations held (F to W) in a zero-bubble schedule, on every rank alike: interleaved
    zero bubble min((v-1) r + p, m v) with r microbatches per round (warm-up (v-1) r + p-1-rank,
    then rank + 1 steady forwards before the first W); ZB-V 2p once m >= 2p - 1; DualPipeV 2p + 1.
    Elsewhere (ZB-V with fewer microbatches) counted on the order. The search asks this for
    thousands of micro-batches; tests/plan/test_schedule_zero_bubble.py checks each formula
    against the order's own count."""
    if schedule == "zero_bubble":
        per_round = microbatches // zero_bubble_rounds(pp, microbatches)
        return min((chunks - 1) * per_round + pp, microbatches * chunks)
    if schedule == "dualpipev":
        return 2 * pp + 1
    if microbatches >= 2 * pp - 1:
        return 2 * pp
    return order_peak(schedule, pp, microbatches, chunks, rank)


@memoize_values
def order_peak(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> int:
    """Peak activations held in a zero-bubble schedule's order (F to W), counted on the order
    itself: the orders have no one-line warm-up count to read it from."""
    return _peak_inflight(rank_ops(schedule, pp, microbatches, chunks, rank))


def peak_inflight_closed_form(
    schedule: str, pp: int, microbatches: int, chunks: int = 1
) -> list[int]:
    """Per rank, the most microbatch-chunks with activations held (forward done, backward not;
    for the split schedules, weight gradient not)."""
    _validate(schedule, pp, microbatches, chunks)
    return [_closed_peak(schedule, pp, microbatches, chunks, r) for r in range(pp)]


def inflight_units(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> int:
    """Peak micro-batch-chunks whose activations pipeline `rank` holds in a training step.

    From the schedule's warm-up (`_warmup_forwards`, the one formula): GPipe m; 1F1B
    min(pp - rank, m); interleaved 1F1B min((v-1)pp + 2(pp-rank-1) + 1, m v) chunk units, each
    1/v of the rank's layers (on rank 0, pp(1 + (pp-1)/(pp v)) micro-batches' worth: Korthikanti
    et al. 2022 section 4.2.3). The zero-bubble schedules hold a microbatch's activations from
    its F until its W, counted on their op orders. pp = 1 runs no schedule, only gradient
    accumulation: one micro-batch (all its chunks) at a time. The memory model
    (plan/memory.py) reads this.
    """
    if schedule not in PP_SCHEDULES:
        raise ConfigError("parallel.pp_schedule", schedule, " | ".join(PP_SCHEDULES))
    if pp == 1:
        return chunks
    return _closed_peak(schedule, pp, microbatches, chunks, rank)


def split_backward_events(
    schedule: str, pp: int, microbatches: int, chunks: int, rank: int
) -> tuple[tuple[int, int], ...]:
    """`rank`'s split backwards in its op order, as (chunk, +1) at each B whose W runs later
    and (chunk, -1) at that W; a B with its W joined (torch's full backward: DualPipeV's full
    and overlapped actions) keeps nothing and is left out. Empty for the unsplit schedules."""
    if schedule not in _ORDERS:
        return ()
    return _split_events(schedule, pp, microbatches, chunks, rank)


@memoize_values
def _split_events(
    schedule: str, pp: int, microbatches: int, chunks: int, rank: int
) -> tuple[tuple[int, int], ...]:
    ops = _backward_actions(schedule, pp, microbatches, chunks, rank)
    if not any(joined for _, _, joined in ops):  # every B split, every W apart
        return tuple([(chunk, 1 if kind == "B" else -1) for kind, chunk, _ in ops])
    events: list[tuple[int, int]] = []
    for k, (kind, chunk, joined) in enumerate(ops):
        if kind == "B":
            if not _whole_backward(ops, k):
                events.append((chunk, 1))
        elif not joined:
            events.append((chunk, -1))
    return tuple(events)


def _first_steady(schedule: str, pp: int, microbatches: int) -> int:
    """The smallest count from which the held-gradient flags of `schedule` stay the same:
    2pp + 2 for the Vs (`_steady_period`'s), 3pp for zero_bubble's multiples of pp (walked
    against every multiple to pp x max(pp, 4) for pp up to 16, and to 8pp at 24 and 32:
    tests/plan/test_schedule_grads.py); other counts are walked up to
    `EXACT_HELD_MICROBATCHES`, past it taken as 3pp's."""
    if schedule in ("zbv", "dualpipev"):
        return 2 * pp + 2
    if microbatches % pp == 0 or microbatches > EXACT_HELD_MICROBATCHES:
        return 3 * pp
    return microbatches


def held_grad_points(
    schedule: str, pp: int, microbatches: int, chunks: int, rank: int, tied_v: bool
) -> tuple[tuple[int, ...], ...]:
    """When FSDP2's unsharded gradients can peak on pipeline `rank` under torch's schedules
    (gradient sync off for every micro-batch, one reduction per stage at the step's end:
    `perform_reduce_grad`), walking the rank's op order. Each point is 0/1 flags: per chunk
    whether its reduce-dtype accumulator exists, then per chunk whether param-dtype gradients
    wait beside it, then whether a tied V's embedding gradient waits (the memory model weighs
    them by the chunks' parameters; tests/parallel/test_fsdp_pipeline_memory.py measures them):

    - FSDP2's post-backward (`FSDPParamGroup.post_backward`, run when a stage's input gradient
      is computed) adds the gradients autograd left on the parameters into the accumulator,
      creating it from the first ones it finds;
    - a full backward computes the weight gradients before its post-backward: nothing waits;
    - a split backward's B runs the post-backward before its W computes the weight gradients,
      which wait in param dtype until the chunk's next B or its reduction. The first stage's B
      computes nothing (no input needs a gradient), so its W is its whole backward;
    - each chunk is reduced after its last op; in a tied V the last stage after the first
      (`reduce_shared_tied_weight_last`), whose embedding lookup adds its gradient to the last
      stage's tied weight after that stage's post-backward: it waits until the last stage's
      next post-backward or reduction (inside the last stage's own waiting gradients if any).

    Without split backwards nothing waits: one stage per rank holds its accumulator alone;
    interleaved chunks each hold theirs at once from two rounds of pp micro-batches on (chunk 0's
    first backward comes before the last chunk's last), one at a time with a single round. Past
    the first count with steady periods (`_steady_period`) that count's order is walked: another
    period repeats the same flags (tests/plan/test_schedule_grads.py walks both)."""
    walked = held_grads_order(schedule, pp, microbatches, chunks)
    if walked is None:
        return ((1,) * chunks + (0,) * chunks + (0,),)
    return _held_grad_points(walked[0], pp, walked[1], chunks, rank, tied_v)


def held_grads_order(
    schedule: str, pp: int, microbatches: int, chunks: int
) -> tuple[str, int] | None:
    """The (schedule, micro-batch count) whose order `held_grad_points` walks; None where every
    chunk of a rank holds its accumulator at once and nothing waits (no split backwards, and one
    chunk or two rounds of pp micro-batches or more). Plans with equal answers hold their
    gradients alike (`Plan.states_key`)."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return None if chunks == 1 or microbatches >= 2 * pp else (schedule, microbatches)
    # from the first steady count on, the flags are those of that count
    return schedule, min(microbatches, _first_steady(schedule, pp, microbatches))


@memoize_values
def _held_grad_points(
    schedule: str, pp: int, m: int, chunks: int, rank: int, tied_v: bool
) -> tuple[tuple[int, ...], ...]:
    ops = _backward_actions(schedule, pp, m, chunks, rank)
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    n_stages = pp * chunks
    ids = stage_ids(rank, pp, chunks, schedule in V_SCHEDULES)
    first = ids.index(0) if 0 in ids else None
    last_chunk = ids.index(n_stages - 1) if n_stages - 1 in ids else None
    tied_v = tied_v and first is not None and last_chunk is not None
    final = {c: k for k, (_, c, _) in enumerate(ops)}
    accum, pending = [0] * chunks, [0] * chunks
    tied = 0
    points: set[tuple[int, ...]] = set()
    # Whether the flags changed since the last point taken: an unchanged point is in `points`
    # already (each op takes one; most change a flag or none).
    changed = True

    def point() -> None:
        nonlocal changed
        if changed:
            waiting = tied if last_chunk is not None and not pending[last_chunk] else 0
            points.add((*accum, *pending, waiting))
            changed = False

    def reduce(c: int) -> None:
        nonlocal tied, changed
        point()
        accum[c] = pending[c] = 0
        if c == last_chunk:
            tied = 0
        changed = True

    deferred: int | None = None
    n_ops = len(ops)
    for k, (kind, c, joined) in enumerate(ops):
        found: bool | None = None  # FSDP2's post-backward runs: whether it finds gradients
        if kind == "B":
            # a full backward: its W joined to it (`_whole_backward`)
            whole = not split or (k + 1 < n_ops and ops[k + 1][0] == "W" and ops[k + 1][2])
            if whole or c != first:
                found = whole or pending[c] == 1
        elif not joined:  # a W run apart
            if c == first:  # the first stage's whole backward
                found = True
            elif not pending[c]:
                pending[c] = 1
                changed = True
        if found is not None:  # the post-backward
            if found and not accum[c]:
                accum[c] = 1
                changed = True
            if pending[c]:
                pending[c] = 0
                changed = True
            if c == last_chunk and tied:
                tied = 0
                changed = True
        if tied_v and c == first and kind == "W" and not tied:  # the lookup's gradient
            tied = 1
            changed = True
        if changed:
            point()
        if final[c] == k:
            if tied_v and c == last_chunk:
                deferred = c
                continue
            reduce(c)
            if deferred is not None and c == first:
                reduce(deferred)
                deferred = None
    if deferred is not None:
        reduce(deferred)
    return _undominated(points)


def _whole_backward(ops: Sequence[tuple[OpKind, int, bool]], k: int) -> bool:
    """Is the B at `ops[k]` a full backward (its W joined to it, run in one torch action)?"""
    return k + 1 < len(ops) and ops[k + 1][0] == "W" and ops[k + 1][2]


def _backward_actions(
    schedule: str, pp: int, m: int, chunks: int, rank: int
) -> list[tuple[OpKind, int, bool]]:
    """`rank`'s B and W ops in its order as (kind, chunk, joined to the op before), from the
    orders' plain-tuple forms where there are (forwards change no gradient)."""
    if schedule == "zero_bubble":
        return [(kind, stage // pp, False)
                for kind, stage in _zero_bubble_actions(pp, m, chunks, rank, forwards=False)]  # fmt: skip
    return [(a[0], a[2], a[4]) for a in _actions(schedule, pp, m, chunks, rank) if a[0] != "F"]


def split_b_count(schedule: str, microbatches: int) -> int | None:
    """Split Bs (W run apart) per chunk in each rank's order, where the schedule says without
    its order being walked: every one of zero_bubble's and zbv's (neither joins a W to its B);
    None elsewhere (dualpipev runs some backwards whole)."""
    return microbatches if schedule in ("zero_bubble", "zbv") else None


def held_after_b_peak(
    schedule: str,
    pp: int,
    microbatches: int,
    chunks: int,
    rank: int,
    until_w: Sequence[float],
    until_step_end: Sequence[float] = (),
) -> float:
    """The most a rank holds at once for its split backwards: per chunk c, `until_w[c]` for
    each micro-batch between its B and its W (the gradients W starts from) and
    `until_step_end[c]` for each micro-batch past its B (the input gradient torch leaves on
    the received activation until the next step), counted on the schedule's op order
    (`split_backward_events`). 0 for gpipe, 1f1b and interleaved_1f1b. Weights must be >= 0."""
    kept = tuple(until_step_end) or (0.0,) * len(until_w)
    weights = (*until_w, *kept)
    frontier = _held_frontier(schedule, pp, microbatches, chunks, rank)
    return max((sum(n * w for n, w in zip(c, weights, strict=True)) for c in frontier), default=0.0)


# Past this many micro-batches `held_grad_points` takes a count that is not a multiple of pp as
# 3pp's (`_first_steady`; the search asks for up to 10^6 micro-batches; walking that order
# takes minutes per rank).
EXACT_HELD_MICROBATCHES = 256


def _steady_period(schedule: str, pp: int, microbatches: int) -> tuple[int, int] | None:
    """(m1, P): a smaller micro-batch count whose order is `microbatches`' with whole steady
    periods of P micro-batches taken out (m - m1 a multiple of P), or None where the order has
    no such form: interleaved zero bubble once its rounds hold pp micro-batches each (m >= pp^2,
    m a multiple of pp), ZB-V and DualPipeV from 2pp + 2."""
    if schedule == "zero_bubble":
        if microbatches < pp * pp or microbatches % pp:
            return None
        period, m1 = pp, pp * max(pp, 4)
    elif schedule in ("zbv", "dualpipev"):
        period, m1 = 1, 2 * pp + 2
    else:
        return None
    if microbatches < m1 + 3 * period:
        return None
    return m1, period


@memoize_values
def _held_frontier(
    schedule: str, pp: int, microbatches: int, chunks: int, rank: int
) -> tuple[tuple[int, ...], ...]:
    """The counts (pending per chunk, then B done per chunk) after each split B of the order,
    only those no other count dominates: with weights >= 0 the peak is at one of them (the
    search asks for thousands of plans; the frontier is a handful of points). Counts with a
    steady period are extended from three smaller ones (`held_frontier_extended`), whose walks
    every larger count of the rank shares: the same points as the whole order's at every count
    to 256 (walked for pp 2 to 16 on every rank and pp 18 to 64 on seven, zero_bubble over 1, 2
    and 4 chunks, when this was written; tests/plan/test_schedule_speed.py walks pp 5 and 8)."""
    extended = held_frontier_extended(schedule, pp, microbatches, chunks, rank)
    if extended is not None:
        return extended
    return held_frontier_exact(schedule, pp, microbatches, chunks, rank)


def held_frontier_exact(
    schedule: str, pp: int, microbatches: int, chunks: int, rank: int
) -> tuple[tuple[int, ...], ...]:
    """`_held_frontier` counted on the whole order."""
    # Each B leaves one more B done than the one before, so only a later point can dominate
    # a point, and one does exactly when its pending counts are no lower: of the points with
    # equal pending counts only the last can be undominated, and of those the ones no later
    # one's pending counts cover (found walking back), before the general pass.
    pending, done = [0] * chunks, [0] * chunks
    last: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}  # pending -> its last B
    for i, (chunk, step) in enumerate(
        split_backward_events(schedule, pp, microbatches, chunks, rank)
    ):
        pending[chunk] += step
        if step > 0:
            done[chunk] += 1
            last[tuple(pending)] = (i, tuple(done))
    kept: set[tuple[int, ...]] = set()
    later: list[tuple[int, ...]] = []
    for now, (_, did) in sorted(last.items(), key=lambda kv: -kv[1][0]):
        if any(_covers(q, now) for q in later):
            continue
        kept.add((*now, *did))
        later = [q for q in later if not _covers(now, q)]
        later.append(now)
    return _undominated(kept)


def held_frontier_extended(
    schedule: str, pp: int, microbatches: int, chunks: int, rank: int
) -> tuple[tuple[int, ...], ...] | None:
    """`_held_frontier` from the orders of m1, m1 + P and m1 + 2P micro-batches
    (`_steady_period`): another steady period leaves the points of the warm-up as they are
    (A) and moves those of the cool-down by one vector d (more Bs done, as many pending), so
    at m = m1 + kP the frontier is that of A and B + k d. None where the three orders do not
    show that form (the caller then counts the whole order)."""
    found = _steady_period(schedule, pp, microbatches)
    if found is None:
        return None
    m1, period = found
    form = _steady_form(schedule, pp, chunks, rank, m1, period)
    if form is None:
        return None
    fixed, moving, d = form
    if not moving:
        return _undominated(set(fixed))
    k = (microbatches - m1) // period
    shifted = {tuple(a + k * s for a, s in zip(p, d, strict=True)) for p in moving}
    return _undominated(set(fixed) | shifted)


@memoize_values
def _steady_form(
    schedule: str, pp: int, chunks: int, rank: int, m1: int, period: int
) -> tuple[frozenset[tuple[int, ...]], tuple[tuple[int, ...], ...], tuple[int, ...]] | None:
    """`held_frontier_extended`'s form from the orders of m1, m1 + P and m1 + 2P: the points
    they share (A), those that move at m1 (B) and the vector d they move by per period (every
    larger count of the rank reads these); None where the three orders do not show it."""
    fronts = [
        set(held_frontier_exact(schedule, pp, m1 + j * period, chunks, rank)) for j in range(3)
    ]
    fixed = frozenset(fronts[0] & fronts[1] & fronts[2])
    moving = [sorted(f - fixed) for f in fronts]
    if not moving[0]:
        return (fixed, (), ()) if all(not m for m in moving) else None
    if not len(moving[0]) == len(moving[1]) == len(moving[2]):
        return None
    d = tuple(b - a for a, b in zip(moving[0][0], moving[1][0], strict=True))
    for j in (1, 2):
        want = sorted(tuple(a + j * s for a, s in zip(p, d, strict=True)) for p in moving[0])
        if moving[j] != want:
            return None
    return fixed, tuple(moving[0]), d


def _covers(q: tuple[int, ...], p: tuple[int, ...]) -> bool:
    """Every count of `q` at least `p`'s (equal lengths)."""
    return all(map(operator.ge, q, p))


def _undominated(points: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    kept: list[tuple[int, ...]] = []
    for p in sorted(points, key=sum, reverse=True):  # a dominating point sorts first
        if not any(_covers(q, p) for q in kept):
            kept.append(p)
    return tuple(kept)


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
    # A stage may cost nothing (the embedding or the head alone on a stage of its own, its
    # rank's time shared by layers: plan/time.py), not every stage.
    bad = any(
        isinstance(c, bool) or not isinstance(c, int | float) or not (math.isfinite(c) and c >= 0)
        for c in costs
    )
    if bad or not any(costs):
        raise ConfigError(field, list(costs), "per-stage finite numbers >= 0, not all 0")
    return tuple(float(c) for c in costs)


def _split_costs(
    t_bwd: tuple[float, ...], t_w: Costs | None, n_stages: int, chunks: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(B, W) cost per stage of a split backward: W = t_w's share (default half), B the rest."""
    if t_w is None:
        w = tuple(default_t_w(b) for b in t_bwd)
    else:
        w = _stage_costs("t_w", t_w, n_stages, chunks)
    for b, wc in zip(t_bwd, w, strict=True):
        if wc >= b and (wc > 0 or b > 0):  # a stage that costs nothing has no W either
            shown = t_w if isinstance(t_w, int | float) else list(t_w or ())
            raise ConfigError("t_w", shown, "less than t_bwd (W is part of the backward)")
    return tuple(b - wc for b, wc in zip(t_bwd, w, strict=True)), w


def _check_orders(orders: Sequence[Sequence[Op]]) -> tuple[int, int, int, bool, bool]:
    """Validate hand-made or built orders; return (pp, chunks, microbatches, v_shape, split)."""
    pp = len(orders)
    if pp == 0:
        raise ConfigError("orders", [], "one op list per pipeline rank")
    ops = [op for rank_ops in orders for op in rank_ops]
    if not ops:
        raise ConfigError("orders", "no ops", "at least one F and one B")
    n_stages = max(op.stage for op in ops) + 1
    microbatches = max(op.microbatch for op in ops) + 1
    if n_stages % pp != 0:
        raise ConfigError("orders", f"{n_stages} stages", f"a multiple of pp = {pp}")
    chunks = n_stages // pp

    def placed(v_shape: bool) -> bool:
        if v_shape and chunks != 2:
            return False
        held = [stage_ids(r, pp, chunks, v_shape) for r in range(pp)]
        return all(
            op.kind in ("F", "B", "W") and op.rank == r and held[r][op.chunk] == op.stage
            if 0 <= op.chunk < chunks
            else False
            for r, rank_ops in enumerate(orders)
            for op in rank_ops
        )

    v_shape = not placed(False)
    if v_shape and not placed(True):
        raise ConfigError(
            "orders",
            "stage placement",
            f"ops on rank r with stage = chunk * {pp} + r, or a V (r and {2 * pp - 1} - r)",
        )
    split = any(op.kind == "W" for op in ops)
    kinds = ("F", "B", "W") if split else ("F", "B")
    seen = {(op.kind, op.stage, op.microbatch) for op in ops}
    want = len(kinds) * n_stages * microbatches
    if len(seen) != len(ops) or len(seen) != want or min(op.microbatch for op in ops) < 0:
        each = "one F, one B and one W" if split else "one F and one B"
        raise ConfigError(
            "orders",
            f"{len(ops)} ops, {len(seen)} distinct",
            f"exactly {each} per (stage, microbatch): {want}",
        )
    return pp, chunks, microbatches, v_shape, split


def simulate_orders(
    orders: Sequence[Sequence[Op]],
    t_fwd: Costs = 1.0,
    t_bwd: Costs = 2.0,
    t_p2p: float = 0.0,
    schedule: str = "custom",
    op_costs: Mapping[tuple[str, int, int], float] | None = None,
    t_w: Costs | None = None,
) -> SimResult:
    """Replay given per-rank op orders; each rank runs its ops in order, one at a time.

    An op starts when its rank is free and its inputs are ready: F of stage s for microbatch i
    needs F of stage s-1 for i; B of stage s needs the own F and B of stage s+1 (the last
    stage's B needs only its F: the loss); W needs its own B. `t_p2p` is added when the producer
    is on another rank, and an op `joined` into a torch action sends its output to another
    rank only when the action's last op ends. With W ops in the orders the backward is split:
    B costs t_bwd - t_w and W t_w (default t_w: half of t_bwd). `op_costs` maps (kind, stage,
    microbatch) to one op's own cost, over the per-stage costs (e.g. every op's measured time,
    to replay a measured step). Raises DeadlockError when some rank waits on an op that can
    never run.
    """
    shape = _check_orders(orders)
    graph = _op_graph(_as_actions(orders), shape)
    return _replay(orders, shape, t_fwd, t_bwd, t_p2p, schedule, op_costs, t_w, True, graph)


_Key = tuple[str, int, int]  # (kind, stage, microbatch)
_KINDS: tuple[OpKind, ...] = ("F", "B", "W")


class _OpGraph(NamedTuple):
    """Orders as the replay reads them. Ops by number, (kind, stage, microbatch) -> (kind
    index x n_stages + stage) x microbatches + microbatch, so that each op's end is a list
    entry, not a dict of tuples. Per rank, per op: (number, kind index, stage, then up to two
    inputs as (number, from another rank), -1 for none, in `_deps`'s order); per rank, the
    index of the op that ends each op's torch action (itself unless joined ops follow it);
    whether any op is joined; per rank, `_peak_inflight` of its order."""

    rows: tuple[tuple[tuple[int, int, int, int, bool, int, bool], ...], ...]
    action_end: tuple[tuple[int, ...], ...]
    joins: bool
    peaks: tuple[int, ...]


def _op_graph(
    orders: Sequence[Sequence[_Action]], shape: tuple[int, int, int, bool, bool]
) -> _OpGraph:
    """The graph of per-rank orders given as actions (`_deps`'s inputs, by number: F of stage
    s > 0 waits for F of s - 1, B for its F and, below the last stage, B of s + 1, W for its
    B; tests/plan/test_schedule_speed.py checks it against `_deps`)."""
    pp, chunks, m, v_shape, _ = shape
    n_stages = pp * chunks
    rank_of = _stage_ranks(pp, chunks, v_shape)
    b0 = n_stages * m  # the first B's number; the first W's is 2 b0
    rows = []
    action_end = []
    peaks = []
    for actions in orders:
        row: list[tuple[int, int, int, int, bool, int, bool]] = []
        add = row.append
        for kind, s, _, i, _ in actions:
            here = rank_of[s]
            if kind == "F":
                n = s * m + i
                if s:
                    add((n, 0, s, n - m, rank_of[s - 1] != here, -1, False))
                else:
                    add((n, 0, s, -1, False, -1, False))
            elif kind == "B":
                n = b0 + s * m + i
                if s < n_stages - 1:
                    add((n, 1, s, n - b0, False, n + m, rank_of[s + 1] != here))
                else:
                    add((n, 1, s, n - b0, False, -1, False))
            else:
                n = 2 * b0 + s * m + i
                add((n, 2, s, n - b0, False, -1, False))
        rows.append(tuple(row))
        last = list(range(len(actions)))
        for k in range(len(actions) - 2, -1, -1):
            if actions[k + 1][4]:
                last[k] = last[k + 1]
        action_end.append(tuple(last))
        release = 2 if any(r[1] == 2 for r in row) else 1
        held = peak = 0
        for r in row:
            if r[1] == 0:
                held += 1
                peak = max(peak, held)
            elif r[1] == release:
                held -= 1
        peaks.append(peak)
    joins = any(i != last[i] for last in action_end for i in range(len(last)))
    return _OpGraph(tuple(rows), tuple(action_end), joins, tuple(peaks))


def _as_actions(orders: Sequence[Sequence[Op]]) -> list[list[_Action]]:
    return [[(op.kind, op.stage, op.chunk, op.microbatch, op.joined) for op in o] for o in orders]


def _replay(
    orders: Sequence[Sequence[Op]] | None,
    shape: tuple[int, int, int, bool, bool],
    t_fwd: Costs,
    t_bwd: Costs,
    t_p2p: float,
    schedule: str,
    op_costs: Mapping[tuple[str, int, int], float] | None,
    t_w: Costs | None,
    timeline: bool,
    graph: _OpGraph,
) -> SimResult:
    """`simulate_orders` on orders of `shape` (`_check_orders`'s answer) as `graph` (their
    `_op_graph`); `timeline` False leaves the result's timeline empty, and then `orders` may be
    None (`schedule`'s own, built again only to say where a deadlock is)."""
    pp, chunks, microbatches, v_shape, split = shape
    n_stages = pp * chunks
    full_b = _stage_costs("t_bwd", t_bwd, n_stages, chunks)
    cost = {"F": _stage_costs("t_fwd", t_fwd, n_stages, chunks), "B": full_b}
    if split:
        cost["B"], cost["W"] = _split_costs(full_b, t_w, n_stages, chunks)
    if isinstance(t_p2p, bool) or not (math.isfinite(t_p2p) and t_p2p >= 0):
        raise ConfigError("t_p2p", t_p2p, "a finite number >= 0")
    for key, c in (op_costs or {}).items():
        if isinstance(c, bool) or not (math.isfinite(c) and c >= 0):
            raise ConfigError("op_costs", f"{key}: {c}", "finite numbers >= 0")
    by_kind = tuple(cost.get(k, ()) for k in _KINDS)
    end: list[float | None] = [None] * (len(_KINDS) * n_stages * microbatches)
    # When each op's output leaves the rank (its action's end); without joined ops, its end.
    joins, action_end = graph.joins, graph.action_end
    sent: list[float | None] = [None] * len(end) if joins else end
    pending: dict[tuple[int, int], list[int]] = {}  # (rank, index of action end) -> numbers
    free_at = [0.0] * pp
    busy = [0.0] * pp
    nxt = [0] * pp
    placed: list[TimedOp] = []
    remaining = sum(len(rows) for rows in graph.rows)
    kept = orders if timeline else None  # the ops the timeline places
    # Start times are a longest path through a DAG (rank order + data edges), so visiting the
    # ranks round-robin gives the same times as a time-ordered event queue.
    while remaining:
        progressed = False
        for r in range(pp):
            rows, k, free, done = graph.rows[r], nxt[r], free_at[r], busy[r]
            while k < len(rows):
                n, kind, stage, d1, x1, d2, x2 = rows[k]
                c = by_kind[kind][stage]
                if op_costs is not None:
                    c = op_costs.get((_KINDS[kind], stage, n % microbatches), c)
                ready = 0.0
                if d1 >= 0:
                    at = sent[d1] if x1 else end[d1]
                    if at is None:
                        break
                    if x1:
                        at += t_p2p
                    if at > ready:
                        ready = at
                if d2 >= 0:
                    at = sent[d2] if x2 else end[d2]
                    if at is None:
                        break
                    if x2:
                        at += t_p2p
                    if at > ready:
                        ready = at
                start = free if free > ready else ready
                finish = start + c
                end[n] = finish
                if joins:
                    pending.setdefault((r, action_end[r][k]), []).append(n)
                    if action_end[r][k] == k:
                        for gone in pending.pop((r, k)):
                            sent[gone] = finish
                free = finish
                done += finish - start
                if kept is not None:
                    placed.append(TimedOp(r, kept[r][k], start, finish))
                k += 1
                remaining -= 1
                progressed = True
            nxt[r], free_at[r], busy[r] = k, free, done
        if not progressed:
            if orders is None:
                orders = schedule_ops(schedule, pp, microbatches, chunks)
            ends = _by_key(end, n_stages, microbatches)
            raise DeadlockError(
                _deadlock_message(orders, nxt, ends, _by_key(sent, n_stages, microbatches))
            )

    makespan = max(free_at)
    return SimResult(
        schedule=schedule,
        pp=pp,
        microbatches=microbatches,
        chunks=chunks,
        makespan=makespan,
        bubble_fraction=1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0,
        busy=tuple(busy),
        idle=tuple(makespan - b for b in busy),
        peak_inflight=graph.peaks,
        timeline=tuple(sorted(placed, key=lambda t: (t.start, t.rank))),
        split_backward=split,
    )


def _by_key(times: list[float | None], n_stages: int, microbatches: int) -> dict[_Key, float]:
    """`_replay`'s times by op number as (kind, stage, microbatch) -> time, for those run."""
    return {
        (_KINDS[n // (n_stages * microbatches)], n // microbatches % n_stages, n % microbatches): t
        for n, t in enumerate(times)
        if t is not None
    }


def _stage_ranks(pp: int, chunks: int, v_shape: bool) -> tuple[int, ...]:
    """The pipeline rank of each global stage."""
    out = [0] * (pp * chunks)
    for r in range(pp):
        for s in stage_ids(r, pp, chunks, v_shape):
            out[s] = r
    return tuple(out)


def _deps(op: Op, n_stages: int, rank_of: Sequence[int]) -> list[tuple[_Key, bool]]:
    """The ops `op` waits for, each with whether it comes from another rank."""
    s, i = op.stage, op.microbatch
    here = rank_of[s]
    if op.kind == "F":
        return [] if s == 0 else [(("F", s - 1, i), rank_of[s - 1] != here)]
    if op.kind == "W":
        return [(("B", s, i), False)]
    out: list[tuple[_Key, bool]] = [(("F", s, i), False)]
    if s < n_stages - 1:
        out.append((("B", s + 1, i), rank_of[s + 1] != here))
    return out


def _deadlock_message(
    orders: Sequence[Sequence[Op]],
    nxt: list[int],
    end: dict[_Key, float],
    sent: dict[_Key, float],
) -> str:
    pp = len(orders)
    ops = [op for rank_ops in orders for op in rank_ops]
    n_stages = max(op.stage for op in ops) + 1
    v_shape = any(op.stage != op.chunk * pp + op.rank for op in ops)
    rank_of = _stage_ranks(pp, n_stages // pp, v_shape)
    stuck = []
    for r, rank_ops in enumerate(orders):
        if nxt[r] < len(rank_ops):
            op = rank_ops[nxt[r]]
            waits = [
                f"{k[1]}{k[0]}{k[2]}"
                for k, cross in _deps(op, n_stages, rank_of)
                if k not in (sent if cross else end)
            ]
            stuck.append(f"rank {r} at op #{nxt[r]} ({op}) waits for {', '.join(waits)}")
    return "pipeline order deadlocks: " + "; ".join(stuck)


def _peak_inflight(rank_ops: Sequence[Op]) -> int:
    """Most microbatch-chunks held: from F until W when the order has Ws, else until B."""
    release = "W" if any(op.kind == "W" for op in rank_ops) else "B"
    held = peak = 0
    for op in rank_ops:
        if op.kind == "F":
            held += 1
        elif op.kind == release:
            held -= 1
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
    t_w: Costs | None = None,
    timeline: bool = True,
) -> SimResult:
    """Simulate one step of `schedule`; scalar costs are per whole rank slice (chunk op = t/v).
    `t_w` (the weight-gradient part of `t_bwd`, default half) matters only for the schedules
    that split the backward. `timeline` False leaves the result's timeline empty (the
    planner reads the makespan and the bubble)."""
    _validate(schedule, pp, microbatches, chunks)
    key = (schedule, pp, microbatches, chunks)
    shape = built_shape(*key)

    def build() -> _OpGraph:
        return _op_graph([_actions(*key, r) for r in range(pp)], shape)

    graph = _BUILT.get(key, build)
    orders = None
    if timeline:
        orders = _BUILT_ORDERS.get(key, lambda: tuple(map(tuple, schedule_ops(*key))))
    return _replay(orders, shape, t_fwd, t_bwd, t_p2p, schedule, None, t_w, timeline, graph)


# The graphs `simulate` replays, kept for the next plan of the same schedule and counts (a
# search re-times its best plans, often several of one pipeline shape), built from the orders'
# actions (no `Op`s); the orders themselves only for a timeline. A few only: one order of a
# large pipeline holds tens of thousands of ops.
_BUILT: Memo[_OpGraph] = Memo("schedule.built_graphs", maxsize=16)
_BUILT_ORDERS: Memo[tuple[tuple[Op, ...], ...]] = Memo("schedule.built_orders", maxsize=16)


def built_shape(
    schedule: str, pp: int, microbatches: int, chunks: int = 1
) -> tuple[int, int, int, bool, bool]:
    """What `_check_orders` answers for `schedule_ops(schedule, pp, microbatches, chunks)`:
    (pp, chunks, microbatches, v_shape, split), without walking the orders (the built orders
    place every op as it requires: tests/plan/test_schedule_speed.py)."""
    v_shape = schedule in V_SCHEDULES
    return pp, chunks, microbatches, v_shape, schedule in SPLIT_BACKWARD_SCHEDULES
