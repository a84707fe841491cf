"""FSDP2 + PP: the runtime's `grad_bytes` metric is read after the step's one reduce-scatter, so
it is the fp32 shards, while the planner's memory peak holds the unsharded gradients until then
(tests/parallel/test_fsdp_pipeline_memory.py measures that peak). `expected_runtime_metrics`
must say what the metrics row says: four gloo ranks, pp 2 x dp_shard 2, the `small` preset."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))

from parallel_harness import BASE, run_layouts  # noqa: E402

from llmscale.config import load_config  # noqa: E402
from llmscale.plan.activations import Kernels  # noqa: E402
from llmscale.plan.memory import MemoryOptions  # noqa: E402
from llmscale.plan.predict import expected_runtime_metrics, predict_memory  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = [
    "--model.name", "small", "--data.seq_len", "64", "--train.steps", "1",
    "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
    "--train.eval_sequences", "4", "--parallel.pp", "2", "--parallel.dp_shard", "2",
    "--precision.mode", "fp32",
]  # fmt: skip


def test_grad_bytes_under_fsdp_and_pp_are_the_shards(tmp_path: Path) -> None:
    runs = run_layouts(4, tmp_path, [{"name": "pp2_fsdp2", "args": ARGS}], timeout=300)
    cfg = load_config(None, [*BASE, *ARGS])
    options = MemoryOptions(kernels=Kernels.for_runtime(cfg.model, cfg.parallel.tp, "cpu"))
    rows = runs["pp2_fsdp2"]["first_rows"]
    assert len(rows) == 2
    for rank, row in enumerate(rows):
        want = expected_runtime_metrics(cfg, rank=rank, options=options)["grad_bytes"]
        held = predict_memory(cfg, options).per_rank[rank].grads
        assert row["grad_bytes"] == want, (rank, row["grad_bytes"], want)
        assert 0 < want < held  # the shards, not the unsharded gradients of the peak
