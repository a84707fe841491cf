"""The ranks' per-step overhead (train/shared_cores.py) is the median of one-token steps spanning
`STEP_SPAN_S`, timed on while a burst of other processes' work fills most of either half. The
steps' times are injected (the slowest rank's time, `_agree`): a test cannot rely on the
machine's real load."""

from __future__ import annotations

import pytest
import torch

from llmscale.bench.jobs import short_job
from llmscale.config import load_config
from llmscale.parallel.dims import ParallelDims
from llmscale.train import shared_cores

CPU = torch.device("cpu")
CFG = load_config(None, short_job())
QUIET, BURST = 0.256, 0.529  # a demo run's one-token step, and what a burst made of it


def _timed(monkeypatch: pytest.MonkeyPatch, times: list[float]) -> list[float]:
    """Each timed step takes the next of `times` (the slowest rank's); returns those used."""
    it, used = iter(times), []

    def agree(dims: object, value: float, op: object = None) -> float:
        used.append(next(it))
        return used[-1]

    monkeypatch.setattr(shared_cores, "_agree", agree)
    return used


def test_a_burst_over_most_of_six_steps_does_not_move_the_overhead(
    one_rank: ParallelDims, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the burst of the --record run that read 529 ms: four of the first six steps
    times = [QUIET, BURST, BURST, BURST, BURST] + [QUIET] * 40
    used = _timed(monkeypatch, times)
    overhead = shared_cores.step_overhead_seconds(CFG, one_rank, CPU)
    assert sorted(times[:6])[3] == BURST  # six steps' median: the burst's
    # 4 s spanned after 12 steps, but the burst is most of the first half (4 of 6): timed on
    # until it is under half of it (4 of 9), 18 steps, 5.7 s
    assert len(used) == 18 and sum(used) == pytest.approx(5.7)
    assert overhead == QUIET


def test_a_burst_over_most_of_the_first_half_is_timed_until_a_minority(
    one_rank: ParallelDims, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a demo run's second measurement (ms): 4.2 s in nine steps, five of them a burst; then
    # quiet steps of 300 ms
    burst = [305, 323, 232, 769, 670, 526, 554, 456, 328]
    assert shared_cores.overhead_estimate([t / 1e3 for t in burst]) == 0.456  # nine: burst's
    used = _timed(monkeypatch, [t / 1e3 for t in burst] + [0.300] * 40)
    overhead = shared_cores.step_overhead_seconds(CFG, one_rank, CPU)
    # halves agree (within 1.25x) once the burst's steps are under half of the first half's
    assert len(used) == 22 and sum(used) == pytest.approx(8.063)
    assert overhead == pytest.approx(0.300)


def _timed_steps(times: list[float]) -> list[float]:
    """The first of `times` that `enough_steps` asks for."""
    used: list[float] = []
    for t in times:
        if shared_cores.enough_steps(used):
            break
        used.append(t)
    return used


def test_a_load_that_doubles_for_good_gives_the_new_overhead() -> None:
    used = _timed_steps([0.25] * 5 + [0.5] * 40)
    assert len(used) == 20 and shared_cores.overhead_estimate(used) == 0.5


def test_a_load_that_keeps_rising_is_timed_for_at_most_twelve_seconds() -> None:
    used = _timed_steps([0.2 * 1.06**i for i in range(60)])  # the halves never agree
    assert sum(used[:-1]) < shared_cores.STEP_MAX_SPAN_S <= sum(used) and len(used) == 27


@pytest.mark.parametrize(
    ("step_s", "steps"),
    [
        (2.0, 9),  # a slow step: at least STEP_MIN_REPEATS of them
        (0.3, 14),  # the demo's: 4 s
        (0.01, 40),  # a fast one: at most STEP_MAX_REPEATS
    ],
)
def test_the_steps_span_four_seconds_within_nine_to_forty_steps(step_s: float, steps: int) -> None:
    assert len(_timed_steps([step_s] * 60)) == steps


def test_the_overhead_is_the_median_of_a_demo_runs_steps() -> None:
    # a demo run's 24 one-token steps (ms): a burst (987, 437), later a slower stretch
    ms = [296, 281, 301, 281, 338, 327, 987, 437, 286, 294, 313, 262,
          321, 247, 267, 289, 338, 311, 381, 365, 397, 366, 369, 357]  # fmt: skip
    assert shared_cores.overhead_estimate([t / 1e3 for t in ms]) == pytest.approx(0.321)
    # however long the burst's steps took
    worse = [t * (10 if t > 400 else 1) / 1e3 for t in ms]
    assert shared_cores.overhead_estimate(worse) == pytest.approx(0.321)
