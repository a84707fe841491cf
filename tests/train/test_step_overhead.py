"""The ranks' per-step overhead (train/shared_cores.py) is the median of one-token steps spanning
`STEP_SPAN_S`: a burst of other processes' work shorter than half of it cannot move it. The
steps' times are injected (the slowest rank's time, `_agree`): a test cannot rely on the
machine's real load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from llmscale.bench.jobs import short_job
from llmscale.config import load_config
from llmscale.parallel.dims import ParallelDims
from llmscale.train import shared_cores

CPU = torch.device("cpu")
CFG = load_config(None, short_job())
QUIET, BURST = 0.256, 0.529  # a demo run's one-token step, and what a burst made of it


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield ParallelDims()
    finally:
        dist.destroy_process_group()


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
    # 4 s spanned after 12 steps (2.372 s in the first five, then 7 quiet ones)
    assert len(used) == 12 and sum(used) >= shared_cores.STEP_SPAN_S > sum(used[:-1])
    assert overhead == QUIET


@pytest.mark.parametrize(
    ("step_s", "steps"),
    [
        (2.0, 9),  # a slow step: at least STEP_MIN_REPEATS of them
        (0.3, 14),  # the demo's: 4 s
        (0.01, 40),  # a fast one: at most STEP_MAX_REPEATS
    ],
)
def test_the_steps_span_four_seconds_within_nine_to_forty_steps(step_s: float, steps: int) -> None:
    times: list[float] = []
    while not shared_cores.enough_steps(times):
        times.append(step_s)
    assert len(times) == steps


def test_the_overhead_is_the_median_of_a_demo_runs_steps() -> None:
    # a demo run's 24 one-token steps (ms): a burst (987, 437), later a slower stretch
    ms = [296, 281, 301, 281, 338, 327, 987, 437, 286, 294, 313, 262,
          321, 247, 267, 289, 338, 311, 381, 365, 397, 366, 369, 357]  # fmt: skip
    assert shared_cores.overhead_estimate([t / 1e3 for t in ms]) == pytest.approx(0.321)
    # however long the burst's steps took
    worse = [t * (10 if t > 400 else 1) / 1e3 for t in ms]
    assert shared_cores.overhead_estimate(worse) == pytest.approx(0.321)
