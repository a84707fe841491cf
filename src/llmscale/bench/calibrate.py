"""This machine as the planner's hardware: GEMM FLOP/s and memory bandwidth, measured.

The planner's time model needs a device: dense matmul peak per dtype and memory bandwidth. For a
CPU (or a GPU missing from the catalog) both are measured here by micro-benchmarks that are *not*
the training step: the model's own GEMM shapes run alone (forward and the two backward products
of each linear), and element-wise adds over tensors the size of one micro-batch's activations
(the timing and the measured device: instrument/calibrate.py, which `llmscale train` uses
for its per-machine calibration).
The step time the planner then predicts from them is compared with the trainer's measured one.
"""

from __future__ import annotations

import torch

from llmscale.instrument import calibrate
from llmscale.model.config import ModelConfig
from llmscale.plan.cluster import Cluster
from llmscale.tensors import DTYPES

TRIALS, MIN_SECONDS = 7, 0.03  # per timing: the fastest of 7 runs of at least 30 ms


def bandwidth_bytes_per_s(numel: int, device: torch.device) -> float:
    """Bytes/s of out = a + b over fp32 tensors of `numel` elements (2 reads and a write)."""
    return calibrate.bandwidth_bytes_per_s(numel, device, TRIALS, MIN_SECONDS)


def linear_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of one block, plus the output projection."""
    d, kv, f = model.dim, model.kv_dim, model.ffn_dim
    block = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (f, d)] + ([(d, f)] if model.gated else [])
    return block * model.n_layers + [(d, model.vocab_size)]


def gemm_flops_per_s(
    model: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device
) -> float:
    """FLOP/s of the model's linears for `tokens` rows: x @ W, and both backward products."""
    mats = []
    for fan_in, fan_out in set(linear_shapes(model)):
        x = torch.randn(tokens, fan_in, dtype=dtype, device=device)
        w = torch.randn(fan_in, fan_out, dtype=dtype, device=device)
        g = torch.randn(tokens, fan_out, dtype=dtype, device=device)
        mats.append((x, w, g, linear_shapes(model).count((fan_in, fan_out))))

    def run() -> None:
        for x, w, g, _ in mats:
            x @ w  # forward
            g @ w.T  # input gradient
            x.T @ g  # weight gradient

    seconds = calibrate.time_call(run, device, TRIALS, MIN_SECONDS)
    flops_once = sum(3 * 2 * x.shape[0] * x.shape[1] * w.shape[1] for x, w, _, _ in mats)
    return flops_once / seconds


def measured_cluster(
    model: ModelConfig,
    tokens: int,
    device: torch.device,
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
) -> tuple[Cluster, dict[str, float]]:
    """A one-device Cluster whose GPU numbers were measured here; also the raw figures."""
    figures = {
        f"gemm_{dt}_flops": gemm_flops_per_s(model, tokens, DTYPES[dt], device) for dt in dtypes
    }
    figures["bandwidth_bytes"] = bandwidth_bytes_per_s(tokens * model.dim, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rates = {dt: figures[f"gemm_{dt}_flops"] for dt in dtypes}
    return calibrate.measured_cluster(
        f"{name} (measured)", rates, figures["bandwidth_bytes"]
    ), figures
