"""Shared test helpers: a tiny, fast job config over a slice of the stdlib corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmscale.bench.jobs import short_job
from llmscale.config import JobConfig, load_config


def make_config(run_dir: Path, *overrides: str) -> JobConfig:
    """The default job, shrunk for tests: a short job of micro-batches of 4, one per step."""
    base = short_job(job__run_dir=run_dir, train__micro_batch_size=4, train__global_batch_size=4)
    return load_config(None, [*base, *overrides])


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory: pytest.TempPathFactory):
    """Runs measure this machine's calibration into a folder of the session, not the home one,
    once: the probe's re-check (another process's load changes the machine's speed) is off, so
    a run's stderr does not depend on the load (tests/train/test_calibration_probe.py turns it
    back on)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMSCALE_CACHE_DIR", str(tmp_path_factory.mktemp("llmscale-cache")))
    mp.setenv("LLMSCALE_PROBE_TOLERANCE", "inf")
    yield
    mp.undo()


@pytest.fixture
def cfg_factory(tmp_path: Path):
    def factory(*overrides: str, run: str = "run") -> JobConfig:
        return make_config(tmp_path / run, *overrides)

    return factory
