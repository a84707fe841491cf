"""The planner's prediction equals what the runtime measures, for the exact job (issue 11).

Two gloo ranks train the `small` preset for one step in each layout below, in one torchrun
launch (tests/parallel/layout_worker.py); each rank that writes results (dp rank 0, tp rank 0:
one per pipeline stage) reports its metrics row of that step. The planner, given the same job
config and the runtime's kernel facts on the CPU (`Kernels.for_runtime`), must predict:

- `param_bytes`: the rank's parameters (TP shards: the runtime's TP plan and its vocabulary
  split of the embedding and head, read from `model.config`);
- `activation_bytes`: what autograd saved for the first micro-batch (tensor parallelism);
- `activation_peak_bytes`: the most saved bytes held at once under the 1F1B schedule with 4
  micro-batches in flight (pipeline parallelism, each stage of the runtime's layer split).

Issue 12 adds: tp=2 with a 4096-token vocabulary (the loss on vocabulary shards, torch's
`loss_parallel`: a third of the saved bytes are logits), sequence parallelism with learned
positions and with tied embeddings (GPT style), and an uneven pipeline split (`pp_layers`).

Parameters exactly; activations within 3% (the tolerance issue 11 sets; they agree exactly but
for the first stage's token ids, 2 KB, 0.01-0.3%).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))

from parallel_harness import BASE, run_layouts  # noqa: E402

from llmscale.config import load_config  # noqa: E402
from llmscale.plan.activations import Kernels  # noqa: E402
from llmscale.plan.memory import MemoryOptions  # noqa: E402
from llmscale.plan.predict import as_plan, expected_runtime_metrics  # noqa: E402

pytestmark = pytest.mark.slow

TOLERANCE = 0.03
# The `small` preset (dim 256, 6 layers, 8 heads, 4 KV heads, FFN 768, untied 264-token
# vocabulary), sequences of 64 tokens in micro-batches of 2, one step: memory is measured on it.
SMALL = [
    "--model.name", "small",
    "--data.seq_len", "64",
    "--train.steps", "1",
    "--train.micro_batch_size", "2",
    "--train.eval_sequences", "2",
]  # fmt: skip


def _layouts() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for precision in ("fp32", "bf16"):
        for recompute in ("none", "full"):
            job = ["--precision.mode", precision, "--train.recompute", recompute]
            tag = f"{precision}_{recompute}"
            out[f"tp2_{tag}"] = [*job, "--parallel.tp", "2", "--train.global_batch_size", "2"]
            out[f"tp2_sp_{tag}"] = [
                *job, "--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                "--train.global_batch_size", "2",
            ]  # fmt: skip
            out[f"pp2_1f1b_{tag}"] = [
                *job, "--parallel.pp", "2", "--parallel.pp_schedule", "1f1b",
                "--train.global_batch_size", "8",  # 4 micro-batches of 2
                # The peak is read from the second step: torch's pipeline stages infer shapes
                # on the first, holding more than a training step does.
                "--train.steps", "2",
            ]  # fmt: skip
    # Issue 12. The loss on vocabulary shards (torch's loss_parallel): with a 4096-token
    # vocabulary the logits are a third of what a tp rank saves, so a planner that counted them
    # whole (gathered) would be off by far more than the tolerance.
    tp2 = ["--parallel.tp", "2", "--train.global_batch_size", "2"]
    out["tp2_vocab4096_fp32_none"] = [*tp2, "--model.vocab_size", "4096"]
    # Sequence parallelism with learned positions, and with tied embeddings (GPT style).
    learned = ["--model.pos_emb", "learned", "--model.bias", "true"]
    gpt = [*learned, "--model.norm", "layernorm", "--model.mlp", "gelu"]
    gpt += ["--model.tie_embeddings", "true"]
    for tag, model in (("learned", learned), ("gpt", gpt)):
        for precision in ("fp32", "bf16"):
            out[f"tp2_sp_{tag}_{precision}_none"] = [
                *tp2, *model, "--parallel.sequence_parallel", "true",
                "--precision.mode", precision,
            ]  # fmt: skip
    # An uneven pipeline split: 5 blocks on the first rank, 1 on the last; the embedding alone
    # on the first rank (every block and the head on the last), and the head alone on the last.
    for tag, split in (("5_1", "[5, 1]"), ("0_6", "[0, 6]"), ("6_0", "[6, 0]")):
        out[f"pp2_layers_{tag}_fp32_none"] = [
            "--parallel.pp", "2", "--parallel.pp_layers", split,
            "--train.global_batch_size", "8", "--train.steps", "2",
        ]  # fmt: skip
    # Gradients reduced without FSDP (replicate over dp_replicate, or over the cp ranks): the
    # runtime casts the weights once (replicate's param_dtype), autocast does not run.
    for tag, degree in (("dprep2", "--parallel.dp_replicate"), ("cp2", "--parallel.cp")):
        for precision in ("fp32", "bf16"):
            out[f"{tag}_{precision}_none"] = [
                degree, "2", "--train.global_batch_size", "2" if tag == "cp2" else "4",
                "--precision.mode", precision,
            ]  # fmt: skip
    # Activation offload: the first 2 of the 6 blocks keep what they save on the host
    # (torch's save_on_cpu); the device's saved activations are the other blocks', embedding
    # and head.
    for precision in ("fp32", "bf16"):
        out[f"dprep2_offload2_{precision}_none"] = [
            "--parallel.dp_replicate", "2", "--train.global_batch_size", "4",
            "--train.offload_activations", "2", "--precision.mode", precision,
        ]  # fmt: skip
    return out


LAYOUTS = _layouts()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    layouts = [{"name": n, "args": [*SMALL, *a]} for n, a in LAYOUTS.items()]
    return run_layouts(2, tmp_path_factory.mktemp("predicted"), layouts, timeout=600)


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= TOLERANCE * want, f"{what}: measured {got}, predicted {want}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_measured_memory_is_the_prediction(name, runs) -> None:
    cfg = load_config(None, [*BASE, *SMALL, *LAYOUTS[name]])
    options = MemoryOptions(kernels=Kernels.for_runtime(cfg.model, cfg.parallel.tp, "cpu"))
    plan = as_plan(cfg)
    rows = runs[name]["first_rows"]
    assert len(rows) == cfg.parallel.pp  # one writer per pipeline stage
    for rank, row in enumerate(rows):
        want = expected_runtime_metrics(cfg, rank=rank, options=options)
        # Exact: with the small vocabulary (264) the embedding and head are under 3% of the
        # parameters, so a planner that kept them whole on every tp rank would pass a 3% test.
        assert row["param_bytes"] == want["param_bytes"], (name, rank)
        if plan.pp > 1:
            got = runs[name]["activation_peaks"][rank]  # the last step's
            _close(got, want["activation_peak_bytes"], f"{name} rank {rank} activation_peak")
        else:
            _close(row["activation_bytes"], want["activation_bytes"], f"{name} activation_bytes")
