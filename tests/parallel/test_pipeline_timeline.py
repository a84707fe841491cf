"""The pipeline timeline instrument and its analysis, on synthetic records (no processes)."""

from __future__ import annotations

import gc
import json
import weakref
from types import SimpleNamespace

import pytest

from llmscale.instrument.pipeline import PipelineRecorder, write_timeline
from llmscale.parallel.timeline import (
    OpRecord,
    PipelineTimeline,
    op_waits,
    p2p_gaps,
    replay,
    slack_fraction,
    stage_op_times,
    step_stats,
)
from llmscale.plan.schedule import schedule_ops, simulate


def _records(sim, t0: float = 1000.0) -> list[OpRecord]:
    return [
        OpRecord(t.rank, t.op.kind, t.op.stage, t.op.microbatch, t0 + t.start, t0 + t.end)
        for t in sim.timeline
    ]


def test_bubble_of_a_hand_made_step() -> None:
    """pp=2, m=1: F0 on rank 0 (0-1), F0 on rank 1 (1.5-2.5), B0 on rank 1 (2.5-4.5),
    B0 on rank 0 (5-7). Busy 3 + 3 of 2 x 7: bubble 1 - 6/14."""
    ops = [
        OpRecord(0, "F", 0, 0, 10.0, 11.0),
        OpRecord(1, "F", 1, 0, 11.5, 12.5),
        OpRecord(1, "B", 1, 0, 12.5, 14.5),
        OpRecord(0, "B", 0, 0, 15.0, 17.0),
    ]
    st = step_stats(list(reversed(ops)), pp=2)
    assert st.makespan == pytest.approx(7.0)
    assert st.busy == pytest.approx((3.0, 3.0))
    assert st.bubble_fraction == pytest.approx(1 - 6 / 14)
    assert st.orders == (("0F0", "0B0"), ("1F0", "1B0"))
    # Both cross-rank hand-offs waited 0.5; nothing else idled with its inputs there.
    assert sorted(p2p_gaps(ops, 2)) == pytest.approx([0.5, 0.5])
    assert slack_fraction(ops, 2) == pytest.approx(1.0 / 14)
    waits = {(w.op.kind, w.op.stage): w for w in op_waits(ops, 2)}
    assert waits[("B", 1)].ready == 12.5 and not waits[("B", 1)].cross_rank
    # The replay with the measured latency puts every op where it ran.
    r = replay(ops, 2, t_p2p=0.5)
    assert r.makespan == pytest.approx(7.0)
    assert r.bubble_fraction == pytest.approx(st.bubble_fraction)


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v"),
    [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2), ("1f1b", 2, 3, 1)],
)
def test_a_simulated_step_read_as_records_gives_the_simulators_numbers(schedule, pp, m, v):
    sim = simulate(schedule, pp, m, v, t_fwd=[1.0 + 0.1 * s for s in range(pp * v)],
                   t_bwd=2.0 * v, t_p2p=0.25)  # fmt: skip
    ops = _records(sim)
    st = step_stats(ops, pp)
    assert st.makespan == pytest.approx(sim.makespan)
    assert st.bubble_fraction == pytest.approx(sim.bubble_fraction)
    want = [tuple(str(op) for op in rank) for rank in schedule_ops(schedule, pp, m, v)]
    assert list(st.orders) == want
    assert all(g == pytest.approx(0.25) for g in p2p_gaps(ops, pp))
    # Slack counts p2p latency (the simulator's t_p2p is idle with the producer done) ...
    assert slack_fraction(ops, pp) > 0
    # ... and nothing else: with free p2p a simulated step has none.
    free = _records(simulate(schedule, pp, m, v, t_fwd=1.0, t_bwd=2.0))
    assert slack_fraction(free, pp) == pytest.approx(0.0, abs=1e-12)
    assert replay(ops, pp, 0.25).bubble_fraction == pytest.approx(sim.bubble_fraction)
    f, b = stage_op_times([ops], pp * v)
    assert f == pytest.approx([1.0 + 0.1 * s for s in range(pp * v)])
    assert b == pytest.approx([2.0] * (pp * v))


def test_recorder_times_only_inside_a_step_and_extends_the_last_forward_by_the_loss(tmp_path):
    calls = []

    def fwd(mb, *args, **kwargs):
        calls.append(("F", mb))
        return mb

    def bwd(mb, loss=None, **kwargs):
        calls.append(("B", mb))

    stage = SimpleNamespace(is_last=True, stage_index=1, forward_one_chunk=fwd,
                            backward_one_chunk=bwd)  # fmt: skip
    tl = PipelineRecorder(pp_rank=1)
    tl.watch([stage])
    loss_fn = tl.timed_loss(lambda out, target: out + target)
    assert stage.forward_one_chunk(0, ()) == 0  # outside a step: runs, records nothing
    assert loss_fn(1, 2) == 3
    with tl.step(7):
        stage.forward_one_chunk(0, ())
        f_end_before_loss = tl._ops[-1][5]
        assert loss_fn(1, 2) == 3
        stage.backward_one_chunk(0, loss=3)
    assert calls == [("F", 0), ("F", 0), ("B", 0)]
    ((step, ops),) = tl.steps
    assert step == 7 and [(k, s, m) for k, s, _, m, *_ in ops] == [("F", 1, 0), ("B", 1, 0)]
    assert ops[0][5] >= f_end_before_loss and ops[0][4] <= ops[0][5] <= ops[1][4]

    path = write_timeline(tmp_path / "t.json", [{"pp_rank": 1, "steps": list(tl.steps)}],
                          {"schedule": "1f1b", "pp": 2, "chunks": 1, "microbatches": 1})  # fmt: skip
    back = PipelineTimeline.load(path)
    assert [(o.kind, o.rank) for o in back.steps[7]] == [("F", 1), ("B", 1)]
    assert "time.time()" in json.loads(path.read_text())["clock"]


class _RankTimes:
    """The two methods of a torch PipelineStage that the recorder wraps."""

    is_last, stage_index = False, 0

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> tuple[_RankTimes, int]:
        return self, mb

    def backward_one_chunk(self, mb: int, **kwargs) -> None:
        pass


def test_watching_a_stage_makes_no_reference_cycle() -> None:
    """The wrappers do not hold their stage: it is freed (with the process group a real one
    holds) as soon as it is dropped, not by the garbage collector after destroy_process_group."""
    gc.disable()
    try:
        stage = _RankTimes()
        tl = PipelineRecorder(pp_rank=0)
        tl.watch([stage])
        with tl.step(1):
            assert stage.forward_one_chunk(3) == (stage, 3)
        assert [op[:4] for _, ops in tl.steps for op in ops] == [("F", 0, 0, 3)]
        gone = weakref.ref(stage)
        del stage
        assert gone() is None
    finally:
        gc.enable()
