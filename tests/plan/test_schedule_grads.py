"""When FSDP2's unsharded gradients wait under torch's pipeline schedules
(`schedule.held_grad_points`): the walk of a rank's op order by hand, and its shortcuts (closed
forms without split backwards, the first steady count with them) against the whole walk."""

from __future__ import annotations

import pytest

from llmscale.plan import schedule as S


def test_zbv_two_microbatches_by_hand() -> None:
    """pp 2, 2 micro-batches. Rank 0 runs F0.0 F0.1 F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 B0.0 W0.0
    B0.1 W0.1 (chunk 0 = stage 0, chunk 1 = stage 3): B3.1's post-backward turns W3.0's bf16
    gradients into the accumulator, W3.1 leaves new ones waiting, and stage 3 is reduced before
    stage 0's first backward: (accumulated, waiting) = ((0, 1), (0, 1)), then stage 0 alone
    ((1, 0), (0, 0)). Tied, stage 3 waits for stage 0's reduction, whose accumulator then exists
    beside it: ((1, 1), (0, 1)). Rank 1 (chunk 0 = stage 1, chunk 1 = stage 2) reduces stage 2
    while stage 1's W1.0 gradients wait, then stage 1 with its W1.1's."""
    ops = " ".join(f"{o.kind}{o.stage}.{o.microbatch}" for o in S.rank_ops("zbv", 2, 2, 2, 0))
    assert ops == "F0.0 F0.1 F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 B0.0 W0.0 B0.1 W0.1"
    assert set(S.held_grad_points("zbv", 2, 2, 2, 0, False)) == {(0, 1, 0, 1, 0), (1, 0, 0, 0, 0)}
    assert S.held_grad_points("zbv", 2, 2, 2, 0, True) == ((1, 1, 0, 1, 0),)
    assert set(S.held_grad_points("zbv", 2, 2, 2, 1, False)) == {(0, 1, 1, 1, 0), (1, 0, 1, 0, 0)}


def test_without_split_backwards_nothing_waits() -> None:
    assert S.held_grad_points("1f1b", 4, 8, 1, 2, False) == ((1, 0, 0),)
    # interleaved, one round of pp micro-batches: each chunk's backwards run together
    assert set(S.held_grad_points("interleaved_1f1b", 4, 4, 2, 0, False)) == {
        (1, 0, 0, 0, 0),
        (0, 1, 0, 0, 0),
    }
    assert S.held_grad_points("interleaved_1f1b", 4, 8, 2, 0, False) == ((1, 1, 0, 0, 0),)


def _walked(
    schedule: str, pp: int, m: int, chunks: int, rank: int, tied: bool
) -> set[tuple[int, ...]]:
    """The whole order walked, whatever the count (and the interleaved closed form bypassed)."""
    return set(S._held_grad_points(schedule, pp, m, chunks, rank, tied))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_interleaved_closed_form_is_the_walk(pp: int) -> None:
    for chunks in (2, 3):
        for m in range(pp, 5 * pp + 1, pp):
            for r in range(pp):
                got = set(S.held_grad_points("interleaved_1f1b", pp, m, chunks, r, False))
                assert got == _walked("interleaved_1f1b", pp, m, chunks, r, False), (pp, m, r)


@pytest.mark.parametrize(
    ("schedule", "chunks"), [("zbv", 2), ("dualpipev", 2), ("zero_bubble", 2), ("zero_bubble", 3)]
)
def test_past_the_first_steady_count_the_flags_stay(schedule: str, chunks: int) -> None:
    for pp in (2, 4, 8):
        counts = [*range(2 * pp, 3 * pp + 6), 4 * pp, 6 * pp, 11 * pp]
        for m in counts:
            try:
                S._validate(schedule, pp, m, chunks)
            except Exception:  # noqa: BLE001 - a count the schedule does not run
                continue
            for r in range(pp):
                for tied in (False, True):
                    want = _walked(schedule, pp, m, chunks, r, tied)
                    assert set(S.held_grad_points(schedule, pp, m, chunks, r, tied)) == want
