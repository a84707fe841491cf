"""Shared test helpers: a tiny, fast job config over a slice of the stdlib corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmscale.config import JobConfig, load_config


def make_config(run_dir: Path, *overrides: str) -> JobConfig:
    """The default job, shrunk for tests: 40 stdlib files, no progress bar, no checkpoints."""
    base = [
        "--job.run_dir", str(run_dir),
        "--data.max_files", "40",
        "--data.seq_len", "32",
        "--train.steps", "3",
        "--train.micro_batch_size", "4",
        "--train.global_batch_size", "4",
        "--metrics.progress", "false",
        "--checkpoint.enabled", "false",
    ]  # fmt: skip
    return load_config(None, [*base, *overrides])


@pytest.fixture
def cfg_factory(tmp_path: Path):
    def factory(*overrides: str, run: str = "run") -> JobConfig:
        return make_config(tmp_path / run, *overrides)

    return factory
