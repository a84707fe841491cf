"""The planner's count of what pipeline stages hold besides saved activations: the receive
buffers and what a split backward's B keeps for its W (plan/memory.py `pipeline_held`, counted
on the op order by plan/schedule.py `held_after_b_peak`); measured equal, to the byte, at pp 2
m 4 and pp 4 m 8 (docs/schedule.md, "Memory of the split schedules")."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from llmscale.model.config import get_preset
from llmscale.plan import activations as act
from llmscale.plan.memory import DEFAULT_OPTIONS, estimate_memory, pipeline_held, slice_args
from llmscale.plan.plan import Plan
from llmscale.plan.predict import expected_runtime_metrics
from llmscale.plan.schedule import (
    held_after_b_peak,
    held_frontier_exact,
    held_frontier_extended,
    schedule_ops,
    split_b_count,
    split_backward_events,
)

SPLIT = ("zero_bubble", "zbv", "dualpipev")
UNSPLIT = ("gpipe", "1f1b", "interleaved_1f1b")
BASE = Plan(
    model=replace(get_preset("tiny"), n_layers=8), seq_len=32, micro_batch_size=1,
    global_batch_size=8, precision="fp32", pp=4,
)  # fmt: skip


def _plan(schedule: str) -> Plan:
    return replace(BASE, pp_schedule=schedule, pp_chunks=2 if schedule != "1f1b" else 1)


def _brute(schedule: str, pp: int, m: int, v: int, rank: int, w: list[float], e: list[float]):
    """Walk the op order: a B not followed by its joined W holds w until its W, e for good."""
    ops = schedule_ops(schedule, pp, m, v)[rank]
    pend, done, peak = [0] * v, [0] * v, 0.0
    for k, op in enumerate(ops):
        nxt = ops[k + 1] if k + 1 < len(ops) else None
        if op.kind == "B" and not (nxt is not None and nxt.kind == "W" and nxt.joined):
            pend[op.chunk] += 1
            done[op.chunk] += 1
        elif op.kind == "W" and not op.joined:
            pend[op.chunk] -= 1
        peak = max(peak, sum(p * a + d * b for p, a, d, b in zip(pend, w, done, e, strict=True)))
    return peak


@pytest.mark.parametrize("schedule", SPLIT)
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (3, 12)])
def test_the_peak_is_the_op_orders(schedule: str, pp: int, m: int) -> None:
    for rank in range(pp):
        w, e = [3.0, 5.0], [1.0, 0.5]
        got = held_after_b_peak(schedule, pp, m, 2, rank, w, e)
        assert got == _brute(schedule, pp, m, 2, rank, w, e) > 0
        # Every split B's input gradient stays to the end: the peak is at least all of them.
        n_split = held_after_b_peak(schedule, pp, m, 2, rank, [0.0, 0.0], [1.0, 1.0])
        assert 0 < n_split <= 2 * m
        if schedule != "dualpipev":  # it runs some backwards whole
            assert n_split == 2 * m


@pytest.mark.parametrize("schedule", SPLIT)
@pytest.mark.parametrize(("pp", "m", "chunks"), [(2, 6, 1), (4, 8, 2), (3, 18, 4), (4, 32, 2)])
def test_split_events_are_the_op_orders(schedule: str, pp: int, m: int, chunks: int) -> None:
    """The events the held frontier counts (zero_bubble's read without building its ops) are
    the op order's: +1 at a B whose W runs apart, -1 at that W."""
    v = 2 if schedule != "zero_bubble" else chunks
    for rank, ops in enumerate(schedule_ops(schedule, pp, m, v)):
        want = []
        for k, op in enumerate(ops):
            nxt = ops[k + 1] if k + 1 < len(ops) else None
            if op.kind == "B" and not (nxt is not None and nxt.kind == "W" and nxt.joined):
                want.append((op.chunk, 1))
            elif op.kind == "W" and not op.joined:
                want.append((op.chunk, -1))
        assert split_backward_events(schedule, pp, m, v, rank) == tuple(want)
        assert want.count((0, 1)) > 0
        n = split_b_count(schedule, m)  # where it is stated, the count of split Bs per chunk
        if schedule == "dualpipev":
            assert n is None and want.count((0, 1)) < m
        else:
            assert [want.count((c, 1)) for c in range(v)] == [n] * v


@pytest.mark.parametrize("schedule", UNSPLIT)
def test_unsplit_schedules_keep_nothing_from_b(schedule: str) -> None:
    chunks = 1 if schedule != "interleaved_1f1b" else 2
    assert held_after_b_peak(schedule, 4, 8, chunks, 0, [1.0] * chunks) == 0
    plan = _plan(schedule)
    for rank in range(plan.pp):
        assert pipeline_held(plan, rank).pending_weight_grads == 0


@pytest.mark.parametrize("schedule", [*SPLIT, *UNSPLIT])
def test_receive_buffers_one_per_micro_batch_and_direction(schedule: str) -> None:
    plan = _plan(schedule)
    boundary = act.boundary_bytes(*slice_args(plan, DEFAULT_OPTIONS.kernels))
    assert boundary == 4 * 32 * 64  # fp32 residual stream, one sequence of 32 tokens
    n_stages = plan.pp * plan.chunks
    total = sum(pipeline_held(plan, r).pipeline_buffers for r in range(plan.pp))
    # Every stage but the first receives activations, every stage but the last gradients.
    assert total == plan.n_microbatches * boundary * 2 * (n_stages - 1)


@pytest.mark.parametrize("schedule", SPLIT)
def test_the_memory_total_and_the_metrics_include_them(schedule: str) -> None:
    plan = _plan(schedule)
    est = estimate_memory(plan)
    for rank, s in enumerate(est.per_rank):
        held = pipeline_held(plan, rank)
        assert s.pending_weight_grads == held.pending_weight_grads > 0
        assert s.pipeline_buffers == held.pipeline_buffers > 0
        parts = s.states + s.working_params + s.activations + s.transient
        assert s.allocated == pytest.approx(
            parts + held.pending_weight_grads + held.pipeline_buffers
        )
        assert s.breakdown()["pending_weight_grads"] == held.pending_weight_grads
        want = expected_runtime_metrics(plan, rank)
        assert want["pending_weight_grad_bytes"] == held.pending_weight_grads
        assert want["pipeline_buffer_bytes"] == held.pipeline_buffers
    # zbv at pp 4, m 8, rank 3 (stages 3 and 4, the V's bottom): measured 720,896 bytes.
    if schedule == "zbv":
        cpu = replace(DEFAULT_OPTIONS, kernels=act.RUNTIME_CPU)
        assert pipeline_held(plan, 3, cpu) == (720_896, 262_144)


@pytest.mark.parametrize(
    ("schedule", "chunks"), [("zero_bubble", 1), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]
)
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_large_counts_extend_the_steady_state_exactly(schedule: str, chunks: int, pp: int) -> None:
    """Past EXACT_HELD_MICROBATCHES the frontier comes from three small orders; at every count
    where both exist it equals the whole order's (and 10^6 micro-batches answer at once)."""
    checked = 0
    for m in range(2 * pp, 72):
        if schedule == "zero_bubble" and m % max(1, m // pp):
            continue
        for rank in range(pp):
            ext = held_frontier_extended(schedule, pp, m, chunks, rank)
            if ext is None:
                continue
            checked += 1
            assert set(ext) == set(held_frontier_exact(schedule, pp, m, chunks, rank))
    assert checked >= 10 * pp
    m = 1_000_000 - 1_000_000 % pp
    t0 = time.perf_counter()
    n_split = held_after_b_peak(schedule, pp, m, chunks, 0, [0.0] * chunks, [1.0] * chunks)
    assert time.perf_counter() - t0 < 1.0
    if schedule != "dualpipev":
        assert n_split == chunks * m  # every B split, every input gradient kept to the end
