"""The time model charges FSDP2's gathers under a pipeline as often as torch's schedule runs
them (`stack.residency.pipeline_gathers`): in closed form up to 3 chunks per rank, replayed
beyond, and extrapolated (affine in the micro-batches from 3 pp on) where a replay of hundreds
of micro-batches would slow the search. Each shortcut equals the replay here."""

from __future__ import annotations

import pytest

from llmscale.plan import time as tm
from llmscale.plan.schedule import schedule_ops
from llmscale.stack.residency import few_stage_gathers, pipeline_gathers


def _replay(schedule: str, pp: int, m: int, chunks: int, zero: int, rank: int) -> float:
    ops = schedule_ops(schedule, pp, m, chunks)[rank]
    counts = pipeline_gathers(zero, [(op.kind, op.stage) for op in ops])
    return sum(counts.values()) / len(counts)


@pytest.mark.parametrize(
    ("schedule", "chunks"),
    [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
     ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)],
)  # fmt: skip
def test_up_to_three_chunks_the_closed_form_is_the_replay(schedule, chunks) -> None:
    for pp in (2, 4):
        for m in (2 * pp, 3 * pp, 8 * pp):
            for zero in (1, 2, 3):
                want = m + 1 if zero == 3 else 1
                assert few_stage_gathers(zero, m, chunks) == want
                for rank in range(pp):
                    assert _replay(schedule, pp, m, chunks, zero, rank) == want


@pytest.mark.parametrize(
    ("schedule", "pp", "chunks"),
    [("interleaved_1f1b", 4, 4), ("interleaved_1f1b", 2, 8), ("zero_bubble", 4, 4)],
)
def test_beyond_three_chunks_the_extrapolation_is_the_replay(schedule, pp, chunks) -> None:
    for m in (5 * pp, 9 * pp, 16 * pp):
        for zero in (1, 3):
            for rank in (0, pp - 1):
                got = tm._pipeline_unit_gathers(schedule, pp, m, chunks, zero, rank)
                assert got == pytest.approx(_replay(schedule, pp, m, chunks, zero, rank))
    # zero 1 with 4 chunks per rank and 16 micro-batches: stages evicted and gathered again
    assert _replay("interleaved_1f1b", 4, 16, 4, 1, 0) == 15 / 4
