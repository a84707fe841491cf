"""short_job: the one spelling of "a short job" for benchmarks and tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmscale.bench.jobs import short_job
from llmscale.config import load_config


def test_defaults_and_overrides() -> None:
    assert short_job() == [
        "--data.max_files", "40",
        "--data.seq_len", "32",
        "--train.steps", "3",
        "--metrics.progress", "false",
        "--checkpoint.enabled", "false",
    ]  # fmt: skip
    got = short_job(train__steps=5, metrics__activation_memory=False, job__run_dir=Path("/x"))
    # A default keeps its place when replaced; new keys follow in the order given.
    assert got[4:6] == ["--train.steps", "5"]
    assert got[10:] == ["--metrics.activation_memory", "false", "--job.run_dir", "/x"]


def test_loads_as_the_short_job() -> None:
    cfg = load_config(None, short_job(model__name="tiny", optimizer__offload_overlap=False))
    assert (cfg.data.max_files, cfg.data.seq_len, cfg.train.steps) == (40, 32, 3)
    assert not cfg.metrics.progress and not cfg.checkpoint.enabled
    assert cfg.optimizer.offload_overlap is False and cfg.model.name == "tiny"


@pytest.mark.parametrize("key", ["steps", "train_steps", "__steps", "train__"])
def test_a_key_without_its_section_is_refused(key: str) -> None:
    with pytest.raises(TypeError, match="section__key"):
        short_job(**{key: 1})
