"""Fixtures of the Hugging Face tests (helpers in hf_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_harness import train_run


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (grouped-query attention: 4 heads, 2 KV heads), 3 steps, checkpointed."""
    return train_run(tmp_path_factory.mktemp("hf") / "tiny")
