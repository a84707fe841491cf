"""This machine as the planner's hardware: GEMM FLOP/s and memory bandwidth, measured.

The planner's time model needs a device: dense matmul peak per dtype and memory bandwidth. For a
CPU (or a GPU missing from the catalog) both are measured here by micro-benchmarks that are *not*
the training step: the model's own GEMM shapes run alone (forward and the two backward products
of each linear), element-wise adds over tensors the size of one micro-batch's activations,
causal SDPA forward and backward (its achieved share of the GEMM rate is the device's attention
efficiency), and the model's forward and backward on one token (the fixed cost per step:
dispatch, autograd). The timing and the measured device come from instrument/calibrate.py, which
`llmscale train` uses for its per-machine calibration.
The step time the planner then predicts from them is compared with the trainer's measured one.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from llmscale.hardware.spec import Sourced
from llmscale.instrument import calibrate
from llmscale.model.config import ModelConfig
from llmscale.model.transformer import build_model
from llmscale.plan.cluster import Cluster
from llmscale.tensors import DTYPES

TRIALS, MIN_SECONDS = 7, 0.03  # per timing: the fastest of 7 runs of at least 30 ms
SOURCE = "measured by llmscale bench micro-benchmarks on this machine"


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


def attention_flops_per_s(
    model: ModelConfig, micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device
) -> float:
    """FLOP/s SDPA executes, causal, forward + backward: half of the s x s products of QK^T and
    AV, the backward 2.5x the forward (as plan/time.py counts them)."""
    shape = (micro_batch, model.n_heads, seq_len, model.head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in "qkv")
    g = torch.randn(shape, dtype=dtype, device=device)

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(g)

    seconds = calibrate.time_call(run, device, 3, MIN_SECONDS)
    fwd = 0.5 * 4 * micro_batch * seq_len * seq_len * model.dim
    return 3.5 * fwd / seconds


def fixed_seconds(model: ModelConfig, device: torch.device) -> float:
    """Seconds of a forward and backward of the whole model on one token: what a step costs
    beyond its FLOPs and bytes (op dispatch, autograd bookkeeping, allocator), per micro-batch."""
    net = build_model(model, device)
    tokens = torch.zeros((1, 1), dtype=torch.long, device=device)

    def run() -> None:
        net(tokens).float().sum().backward()

    return calibrate.time_call(run, device, 3, MIN_SECONDS)


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
    seq = min(model.max_seq_len, max(1, tokens))
    micro = max(1, tokens // seq)
    figures["attention_fp32_flops"] = attention_flops_per_s(
        model, micro, seq, torch.float32, device
    )
    figures["fixed_s"] = fixed_seconds(model, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rates = {dt: figures[f"gemm_{dt}_flops"] for dt in dtypes}
    cluster = calibrate.measured_cluster(f"{name} (measured)", rates, figures["bandwidth_bytes"])
    gpu = cluster.gpu
    achieved = dataclasses.replace(
        gpu.calibration,
        attention_efficiency=Sourced(
            figures["attention_fp32_flops"] / figures[f"gemm_{dtypes[0]}_flops"], SOURCE
        ),
        step_overhead_ms=Sourced(1000 * figures["fixed_s"], SOURCE),
    )
    return dataclasses.replace(cluster, gpu=dataclasses.replace(gpu, calibration=achieved)), figures
