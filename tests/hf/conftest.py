"""Fixtures of the Hugging Face tests (helpers in hf_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_harness import save_random_llama, train_run


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (grouped-query attention: 4 heads, 2 KV heads), 3 steps, checkpointed."""
    return train_run(tmp_path_factory.mktemp("hf") / "tiny")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random LlamaForCausalLM saved by transformers (weights wider than its init)."""
    return save_random_llama(tmp_path_factory.mktemp("llama") / "hf")


@pytest.fixture(scope="session")
def llama_run(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run started from `llama_dir`, one step: its greedy text is not one repeated byte."""
    run = tmp_path_factory.mktemp("hf") / "from-llama"
    return train_run(run, "--checkpoint.init_from", f"hf:{llama_dir}", "--train.steps", "1")
