"""The planner predicts the trainer's own memory metrics exactly (one CPU step).

`Trainer.train_step` reports param_bytes, grad_bytes, optimizer_bytes and activation_bytes
(train/metrics.py, instrument/activations.py); `expected_runtime_metrics` must give the same numbers,
and with offload the per-stage host bytes must be the offloaded optimizer's.
One micro-batch per step, so that the saved token ids are that micro-batch's own storage.
"""

from __future__ import annotations

import pytest

from llmscale.plan import activations as act
from llmscale.plan.memory import MemoryOptions
from llmscale.plan.predict import expected_runtime_metrics, predict_memory
from llmscale.train.trainer import Trainer

CPU = MemoryOptions(kernels=act.RUNTIME_CPU)
# The GPT variant on the tiny shape: LayerNorm, GELU, learned positions, biases, tied embeddings.
GPT = [
    "--model.norm", "layernorm", "--model.mlp", "gelu", "--model.pos_emb", "learned",
    "--model.bias", "true", "--model.tie_embeddings", "true", "--model.n_kv_heads", "4",
]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        ["--precision.mode", "fp32"],
        ["--precision.mode", "bf16"],
        ["--precision.mode", "bf16", "--train.recompute", "full"],
        ["--precision.mode", "fp16", "--train.recompute", "selective"],
        [
            "--precision.mode",
            "bf16",
            "--train.recompute",
            "every_k",
            "--model.tie_embeddings",
            "true",
        ],
        [*GPT, "--precision.mode", "bf16"],
        ["--optimizer.offload", "optimizer", "--precision.mode", "fp32"],
        ["--optimizer.offload", "optimizer", "--precision.mode", "bf16"],
        [
            "--optimizer.offload",
            "optimizer",
            "--precision.mode",
            "bf16",
            "--train.recompute",
            "full",
        ],
        [*GPT, "--optimizer.offload", "optimizer", "--precision.mode", "bf16"],  # LayerNorm in bf16
        ["--optimizer.offload", "optimizer+params", "--precision.mode", "fp32"],
        [
            "--optimizer.offload",
            "optimizer+params",
            "--precision.mode",
            "bf16",
            "--train.recompute",
            "full",
        ],
        [  # tied: the embedding stays on the device from its forward to its gradient
            "--optimizer.offload",
            "optimizer+params",
            "--precision.mode",
            "fp16",
            "--train.recompute",
            "selective",
            "--model.pos_emb",
            "learned",
            "--model.tie_embeddings",
            "true",
        ],  # fmt: skip
    ],
    ids=[
        "fp32",
        "bf16",
        "bf16-full",
        "fp16-selective",
        "bf16-every_k-tied",
        "gpt-bf16",
        "offload-fp32",
        "offload-bf16",
        "offload-bf16-full",
        "offload-gpt-bf16",
        "params-fp32",
        "params-bf16-full",
        "params-fp16-selective-tied",
    ],  # fmt: skip
)
def test_states_and_saved_activations_match_the_trainer(cfg_factory, extra: list[str]) -> None:
    cfg = cfg_factory(*extra, "--data.max_files", "8")
    row = Trainer(cfg).train_step()
    want = expected_runtime_metrics(cfg, options=CPU)
    keys = ["param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"]
    if "device_param_peak_bytes" in want:  # optimizer+params: the most held at once
        keys.append("device_param_peak_bytes")
    got = {k: row[k] for k in keys}
    assert got == {k: want[k] for k in got}
    if cfg.optimizer.offload != "none":
        # The host: master and moments (+ step counters), and the working copies to upload.
        host = (
            row["host_optimizer_bytes"] + row["host_master_bytes"] + row.get("host_param_bytes", 0)
        )
        assert host == predict_memory(cfg, CPU).per_rank[0].host
