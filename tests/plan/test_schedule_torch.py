"""Our per-rank orders equal the orders torch.distributed.pipelining (2.13) executes.

No process group is needed: single-stage schedules (GPipe, 1F1B) are run with a stand-in stage
that records which microbatch it is asked to forward or backward, and p2p op lists left empty;
ScheduleInterleaved1F1B builds its whole per-rank program (with comms) in __init__, and we read
its compute actions. Both lean on torch internals, so a torch upgrade may need this file edited.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmscale.plan.schedule import schedule_ops

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


class _RecordingStage:
    """Just enough of a _PipelineStageBase for PipelineScheduleSingle._step_microbatches."""

    def __init__(self, pp: int, rank: int) -> None:
        self.num_stages = pp
        self.stage_index = rank
        self.is_last = rank == pp - 1
        self.log: list[str] = []

    def get_fwd_recv_ops(self, mb: int) -> list[object]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb: int, *args: object, **kwargs: object) -> None:
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb: int, **kwargs: object) -> None:
        self.log.append(f"{self.stage_index}B{mb}")

    def perform_reduce_grad(self, *args: object) -> None:
        pass


def _torch_single_stage_orders(cls: type, pp: int, m: int) -> list[list[str]]:
    out = []
    for rank in range(pp):
        stage = _RecordingStage(pp, rank)
        sched = cls(stage, m)
        sched._initialize_stage = lambda *a, **k: None  # shape inference needs real tensors
        sched._step_microbatches()
        out.append(stage.log)
    return out


def _ours(schedule: str, pp: int, m: int, v: int = 1) -> list[list[str]]:
    return [[str(op) for op in ops] for ops in schedule_ops(schedule, pp, m, v)]


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (2, 5), (3, 7), (4, 4), (4, 8), (5, 12)])
def test_1f1b_matches_torch_schedule_1f1b(pp, m):
    assert _ours("1f1b", pp, m) == _torch_single_stage_orders(schedules.Schedule1F1B, pp, m)


@pytest.mark.parametrize("pp,m", [(1, 2), (2, 1), (3, 7), (4, 8), (8, 3)])
def test_gpipe_matches_torch_schedule_gpipe(pp, m):
    assert _ours("gpipe", pp, m) == _torch_single_stage_orders(schedules.ScheduleGPipe, pp, m)


def _torch_interleaved_orders(pp: int, m: int, v: int) -> list[list[str]]:
    compute = {"F", "B"}
    out = []
    for rank in range(pp):
        stages = [
            SimpleNamespace(
                num_stages=pp * v,
                group_size=pp,
                group_rank=rank,
                stage_index=c * pp + rank,
                stage_index_to_group_rank=None,
            )
            for c in range(v)
        ]
        sched = schedules.ScheduleInterleaved1F1B(stages, m)
        program = sched.pipeline_order_with_comms[rank]  # what rank `rank` executes
        out.append([str(a) for a in program if a.computation_type.value in compute])
    return out


@pytest.mark.parametrize(
    "pp,m,v",
    [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 12, 3), (3, 9, 4), (4, 8, 1), (1, 3, 2)],
)
def test_interleaved_matches_torch_schedule_interleaved_1f1b(pp, m, v):
    assert _ours("interleaved_1f1b", pp, m, v) == _torch_interleaved_orders(pp, m, v)


# ---- zero-bubble schedules: torch's I is our B; a FULL_BACKWARD is B then W (joined); an
# OVERLAP_F_B action is its F, then its full backward's B and W (joined) ----------------------


def _torch_split_orders(cls: type, pp: int, m: int, v: int, v_shape: bool) -> list[list[str]]:
    out = []
    for rank in range(pp):
        ids = [rank, 2 * pp - 1 - rank] if v_shape else [c * pp + rank for c in range(v)]
        stages = [
            SimpleNamespace(
                num_stages=pp * v,
                group_size=pp,
                group_rank=rank,
                stage_index=s,
                stage_index_to_group_rank=None,
                submod=None,
            )
            for s in ids
        ]
        sched = cls(stages, m)
        program = sched.pipeline_order_with_comms[rank]  # what rank `rank` executes
        ops: list[str] = []
        for a in program:
            kind = a.computation_type.value
            if kind == "OVERLAP_F_B":
                f, b = a.sub_actions
                ops += [str(f), f"{b.stage_index}B{b.microbatch_index}+"]
                ops.append(f"{b.stage_index}W{b.microbatch_index}+")
            elif kind == "B":
                ops += [str(a), f"{a.stage_index}W{a.microbatch_index}+"]
            elif kind == "I":
                ops.append(f"{a.stage_index}B{a.microbatch_index}")
            elif kind in ("F", "W"):
                ops.append(str(a))
        out.append(ops)
    return out


def _ours_split(schedule: str, pp: int, m: int, v: int) -> list[list[str]]:
    return [
        [str(op) + ("+" if op.joined else "") for op in ops]
        for ops in schedule_ops(schedule, pp, m, v)
    ]


@pytest.mark.parametrize(
    "pp,m,v",
    [(2, 2, 2), (2, 4, 2), (2, 6, 3), (4, 4, 2), (4, 8, 2), (4, 12, 3), (3, 9, 2), (4, 10, 2),
     (4, 6, 2), (4, 2, 2), (8, 16, 2)],
)  # fmt: skip
def test_zero_bubble_matches_torch_schedule_interleaved_zero_bubble(pp, m, v):
    want = _torch_split_orders(schedules.ScheduleInterleavedZeroBubble, pp, m, v, False)
    assert _ours_split("zero_bubble", pp, m, v) == want


@pytest.mark.parametrize(
    "pp,m", [(2, 1), (2, 2), (2, 4), (2, 7), (3, 5), (4, 4), (4, 8), (4, 13), (8, 16)]
)
def test_zbv_matches_torch_schedule_zbv_zero_bubble(pp, m):
    want = _torch_split_orders(schedules.ScheduleZBVZeroBubble, pp, m, 2, True)
    assert _ours_split("zbv", pp, m, 2) == want


@pytest.mark.parametrize(
    "pp,m", [(2, 4), (2, 5), (3, 6), (3, 9), (4, 8), (4, 11), (5, 12), (8, 16)]
)
def test_dualpipev_matches_torch_schedule_dualpipev(pp, m):
    want = _torch_split_orders(schedules.ScheduleDualPipeV, pp, m, 2, True)
    assert _ours_split("dualpipev", pp, m, 2) == want
