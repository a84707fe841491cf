"""The pipeline timeline with split backwards (F, B, W ops), on synthetic stages and records."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmscale.instrument.pipeline import PipelineRecorder, write_timeline
from llmscale.parallel.timeline import (
    OpRecord,
    OrderedOp,
    PipelineTimeline,
    as_sim_result,
    op_waits,
    rank_op_orders,
    stage_kind_times,
    stage_op_times,
    step_stats,
)


def _stage(index: int, is_last: bool, calls: list) -> SimpleNamespace:
    def fwd(mb, *args, **kwargs):
        calls.append(("F", index, mb))

    def bwd(mb, loss=None, full_backward=True, last_backward=False):
        calls.append(("B", index, mb))

    def bwd_w(mb, last_backward=False):
        calls.append(("W", index, mb))

    return SimpleNamespace(stage_index=index, is_last=is_last, forward_one_chunk=fwd,
                           backward_one_chunk=bwd, backward_weight_one_chunk=bwd_w)  # fmt: skip


def test_recorder_times_f_b_and_w_with_their_chunk(tmp_path) -> None:
    """Rank 0 of a V over pp=2 holds stages 0 and 3 (chunks 0 and 1): each op is recorded with
    its kind, stage, chunk and microbatch, and the file keeps the chunk."""
    calls: list = []
    first, last = _stage(0, False, calls), _stage(3, True, calls)
    tl = PipelineRecorder(pp_rank=0)
    tl.watch([first, last])
    loss = tl.timed_loss(lambda out, target: 0.0)
    with tl.step(2):
        first.forward_one_chunk(0)
        last.forward_one_chunk(0)
        loss(None, None)
        last.backward_one_chunk(0, loss=0.0, full_backward=False)
        last.backward_weight_one_chunk(0, last_backward=True)
        first.backward_one_chunk(0, full_backward=True)
    assert calls == [("F", 0, 0), ("F", 3, 0), ("B", 3, 0), ("W", 3, 0), ("B", 0, 0)]
    ((step, ops),) = tl.steps
    assert [op[:4] for op in ops] == [
        ("F", 0, 0, 0), ("F", 3, 1, 0), ("B", 3, 1, 0), ("W", 3, 1, 0), ("B", 0, 0, 0),
    ]  # fmt: skip
    starts = [op[4] for op in ops]
    assert starts == sorted(starts) and all(op[4] <= op[5] for op in ops)

    meta = {"schedule": "zbv", "pp": 2, "chunks": 2, "microbatches": 1}
    path = write_timeline(tmp_path / "t.json", [{"pp_rank": 0, "steps": list(tl.steps)}], meta)
    back = PipelineTimeline.load(path).steps[2]
    assert [(o.kind, o.stage, o.chunk) for o in back] == [
        ("F", 0, 0), ("F", 3, 1), ("B", 3, 1), ("W", 3, 1), ("B", 0, 0),
    ]  # fmt: skip
    assert rank_op_orders(back, 2) == [
        [OrderedOp("F", 0, 0), OrderedOp("F", 3, 0), OrderedOp("B", 3, 0), OrderedOp("W", 3, 0),
         OrderedOp("B", 0, 0)],
        [],
    ]  # fmt: skip


def _zbv_step() -> list[OpRecord]:
    """A hand-made zbv-like step, pp=2, one microbatch: stages 0, 3 on rank 0; 1, 2 on rank 1.
    Unit times: F 1, B 1, W 1, p2p free."""
    r = [
        (0, "F", 0, 0, 1), (1, "F", 1, 1, 2), (1, "F", 2, 2, 3), (0, "F", 3, 3, 4),
        (0, "B", 3, 4, 5), (1, "B", 2, 5, 6), (0, "W", 3, 5, 6), (1, "B", 1, 6, 7),
        (1, "W", 2, 7, 8), (0, "B", 0, 7, 8), (1, "W", 1, 8, 9), (0, "W", 0, 8, 9),
    ]  # fmt: skip
    chunk = {0: 0, 3: 1, 1: 0, 2: 1}
    return [OpRecord(rk, k, s, 0, float(a), float(b), chunk[s]) for rk, k, s, a, b in r]


def test_w_ops_in_the_analysis() -> None:
    ops = _zbv_step()
    st = step_stats(ops, 2)
    assert st.makespan == 9.0 and st.busy == (6.0, 6.0)
    assert st.orders[0] == ("0F0", "3F0", "3B0", "3W0", "0B0", "0W0")
    # F and B means leave the W ops out; W has its own.
    f, b = stage_op_times([ops], 4)
    assert f == [1.0] * 4 and b == [1.0] * 4
    assert stage_kind_times([ops], 4, "W") == [1.0] * 4
    waits = {(w.op.kind, w.op.stage): w for w in op_waits(ops, 2)}
    # W waits on its own B, on its own rank.
    assert waits[("W", 2)].ready == 6.0 and not waits[("W", 2)].cross_rank
    # The V: stage 2 follows stage 1 on the same rank, stage 3 follows stage 2 across ranks.
    assert not waits[("F", 2)].cross_rank and waits[("F", 3)].cross_rank
    assert waits[("B", 1)].ready == 6.0 and not waits[("B", 1)].cross_rank
    # Activations are held from F to W: rank 0 holds both chunks' at once.
    sim = as_sim_result(ops, "zbv", 2, 1, 2)
    assert sim.peak_inflight == (2, 2)
    assert {t.op.chunk for t in sim.timeline if t.op.stage == 3} == {1}


def test_files_without_chunks_read_loop_style() -> None:
    o = OpRecord(1, "F", 3, 0, 0.0, 1.0)
    assert o.chunk is None and o.chunk_of(2) == 1


@pytest.mark.parametrize("full", [True, False])
def test_a_full_backward_holds_until_its_b(full) -> None:
    """Without a W the B frees the activations (a full backward, as dualpipev runs some)."""
    ops = [OpRecord(0, "F", 0, 0, 0.0, 1.0, 0), OpRecord(0, "F", 0, 1, 1.0, 2.0, 0),
           OpRecord(0, "B", 0, 0, 2.0, 3.0, 0), OpRecord(0, "F", 0, 2, 3.0, 4.0, 0)]  # fmt: skip
    if not full:
        ops.append(OpRecord(0, "W", 0, 0, 4.0, 5.0, 0))
    assert as_sim_result(ops, "x", 1, 3, 1).peak_inflight == ((2,) if full else (3,))
