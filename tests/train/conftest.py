"""Fixtures shared by tests/train."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from llmscale.parallel.dims import ParallelDims


@pytest.fixture
def one_rank(tmp_path: Path):
    """A one-rank gloo process group for the test, and its ParallelDims."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield ParallelDims()
    finally:
        dist.destroy_process_group()
