"""The simulator's shortcuts for built orders (plan/schedule.py: `simulate` skips the order
check, keeps the orders and drops the timeline) answer what the checked path answers."""

from __future__ import annotations

import pytest

from llmscale.config import PP_SCHEDULES, microbatch_rule
from llmscale.plan import schedule as sc

SHAPES = [
    (s, pp, m, v)
    for s in PP_SCHEDULES
    for pp in (1, 2, 3, 4)
    for m in (1, 2, 4, 6, 8, 9)
    for v in (
        (1, 2, 3) if s in sc.LOOP_MULTI_CHUNK_SCHEDULES else (2,) if s in sc.V_SCHEDULES else (1,)
    )
    if microbatch_rule(s, pp, m) is None
    and not (s in sc.V_SCHEDULES and pp < 2)
    and not (s == "zero_bubble" and m % sc.zero_bubble_rounds(pp, m))
]


def test_shapes_cover_every_schedule() -> None:
    assert {s for s, *_ in SHAPES} == set(PP_SCHEDULES)
    assert len(SHAPES) > 60


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), SHAPES)
def test_built_shape_is_what_the_check_reads(schedule: str, pp: int, m: int, v: int) -> None:
    orders = sc.schedule_ops(schedule, pp, m, v)
    assert sc.built_shape(schedule, pp, m, v) == sc._check_orders(orders)


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), [x for x in SHAPES if x[1] > 1][::3])
def test_simulate_equals_replaying_the_orders(schedule: str, pp: int, m: int, v: int) -> None:
    # Unequal stages, a p2p cost and a W share: every float of the two paths must agree.
    n = pp * v
    fwd = [1.0 + 0.37 * g for g in range(n)]
    bwd = [2.1 + 0.53 * g for g in range(n)]
    w = [0.8 + 0.11 * g for g in range(n)]
    checked = sc.simulate_orders(
        sc.schedule_ops(schedule, pp, m, v), fwd, bwd, 0.29, schedule=schedule, t_w=w
    )
    sc._BUILT.clear()
    for _ in range(2):  # cold, then from the kept orders
        fast = sc.simulate(schedule, pp, m, v, fwd, bwd, 0.29, w)
        assert fast == checked
        lean = sc.simulate(schedule, pp, m, v, fwd, bwd, 0.29, w, timeline=False)
        assert lean.timeline == ()
        assert (lean.makespan, lean.bubble_fraction, lean.busy) == (
            checked.makespan, checked.bubble_fraction, checked.busy,
        )  # fmt: skip
        assert lean.peak_inflight == checked.peak_inflight


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), SHAPES)
def test_op_graph_numbers_the_inputs_deps_names(schedule: str, pp: int, m: int, v: int) -> None:
    # `_op_graph` numbers each op's inputs by arithmetic; `_deps` names them as (kind, stage,
    # microbatch) keys: the same inputs, in the same order, with the same rank crossings.
    orders = sc.schedule_ops(schedule, pp, m, v)
    shape = sc.built_shape(schedule, pp, m, v)
    n_stages = pp * v
    graph = sc._op_graph(sc._as_actions(orders), shape)
    rank_of = sc._stage_ranks(pp, v, shape[3])

    def number(kind: str, stage: int, mb: int) -> int:
        return ("FBW".index(kind) * n_stages + stage) * m + mb

    for rank_ops, rows, peak in zip(orders, graph.rows, graph.peaks, strict=True):
        assert len(rows) == len(rank_ops)
        for op, row in zip(rank_ops, rows, strict=True):
            deps = [(number(*key), cross) for key, cross in sc._deps(op, n_stages, rank_of)]
            deps += [(-1, False)] * (2 - len(deps))
            want = (number(op.kind, op.stage, op.microbatch), "FBW".index(op.kind), op.stage)
            assert row == (*want, *deps[0], *deps[1])
        assert peak == sc._peak_inflight(rank_ops)
    assert graph.joins == any(op.joined for o in orders for op in o)


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), [x for x in SHAPES if x[1] > 1])
def test_backward_walk_shortcuts(schedule: str, pp: int, m: int, v: int) -> None:
    # zero_bubble's order without its Fs is its order filtered; the held-memory walks'
    # B/W stream is the order's, and a stream with nothing joined splits every B.
    for rank in range(pp):
        ops = sc.rank_ops(schedule, pp, m, v, rank)
        stream = [(op.kind, op.chunk, op.joined) for op in ops if op.kind != "F"]
        assert sc._backward_actions(schedule, pp, m, v, rank) == stream
        if schedule == "zero_bubble":
            full = sc._zero_bubble_actions(pp, m, v, rank)
            assert sc._zero_bubble_actions(pp, m, v, rank, forwards=False) == [
                a for a in full if a[0] != "F"
            ]
        if schedule not in sc.SPLIT_BACKWARD_SCHEDULES:
            continue
        events = [
            (c, 1) if kind == "B" else (c, -1)
            for k, (kind, c, joined) in enumerate(stream)
            if (kind == "B" and not sc._whole_backward(stream, k)) or (kind == "W" and not joined)
        ]
        assert list(sc.split_backward_events(schedule, pp, m, v, rank)) == events
        assert any(j for *_, j in stream) == (schedule == "dualpipev")  # the only joins


@pytest.mark.parametrize(
    ("schedule", "chunks"), [("zero_bubble", 2), ("zero_bubble", 4), ("zbv", 2), ("dualpipev", 2)]
)
@pytest.mark.parametrize("pp", [5, 8])
def test_frontier_extends_from_small_counts_at_every_count(
    schedule: str, chunks: int, pp: int
) -> None:
    # `_held_frontier` extends every count with a steady period from three small orders (not
    # only past 256): the same points as walking the whole order, at every count up to 256.
    checked = 0
    for m in range(2 * pp, 257):
        if sc._steady_period(schedule, pp, m) is None:
            continue
        if schedule == "zero_bubble" and m % sc.zero_bubble_rounds(pp, m):
            continue
        for rank in range(pp):
            got = sc._held_frontier(schedule, pp, m, chunks, rank)
            assert set(got) == set(sc.held_frontier_exact(schedule, pp, m, chunks, rank))
            assert sc.held_frontier_extended(schedule, pp, m, chunks, rank) is not None
            checked += 1
    assert checked >= (6 if schedule == "zero_bubble" else 200) * pp


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), SHAPES[::2])
def test_schedule_actions_are_the_orders_kinds_and_stages(
    schedule: str, pp: int, m: int, v: int
) -> None:
    want = [[(op.kind, op.stage) for op in ops] for ops in sc.schedule_ops(schedule, pp, m, v)]
    assert sc.schedule_actions(schedule, pp, m, v) == want
