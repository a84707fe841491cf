"""This machine as the planner's hardware: GEMM FLOP/s and memory bandwidth, measured.

The planner's time model needs a device: dense matmul peak per dtype and memory bandwidth. For a
CPU (or a GPU missing from the catalog) both are measured here by micro-benchmarks that are *not*
the training step:

- the model's own GEMM shapes run alone (forward and the two backward products of each linear);
- element-wise bandwidth as eager PyTorch gets it: an out-of-place product into a new tensor the
  size of one micro-batch's FFN activations (allocation included, past the caches);
- causal SDPA forward and backward in the run's dtype (its achieved share of that dtype's GEMM
  rate is the device's attention efficiency: a CPU's bf16 flash kernel is far slower than its
  bf16 GEMMs);
- the model's forward and backward on one token: the fixed cost of a micro-batch (per-op
  dispatch, autograd bookkeeping), `microbatch_overhead_ms`;
- the runtime's optimizer (foreach AdamW and the gradient-norm clip) over the model's
  parameters: its achieved share of the measured bandwidth, `optimizer_efficiency`.

The timing and the measured device come from instrument/calibrate.py, which `llmscale train`
uses for its per-machine calibration. The step time the planner then predicts from them is
compared with the trainer's measured one.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from llmscale.config import OptimizerSection
from llmscale.hardware.spec import Sourced
from llmscale.instrument import calibrate
from llmscale.model.config import ModelConfig
from llmscale.model.transformer import apply_rope, build_model, build_norm, rope_tables
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.time import DEFAULT_TIME, runtime_eager_block_parts
from llmscale.tensors import DTYPES
from llmscale.train.optim import build_optimizer

TRIALS, MIN_SECONDS = 7, 0.03  # per timing: the fastest of 7 runs of at least 30 ms
SOURCE = "measured by llmscale bench micro-benchmarks on this machine"


def bandwidth_bytes_per_s(numel: int, device: torch.device) -> float:
    """Bytes/s of out = a + b over fp32 tensors of `numel` elements (2 reads and a write)."""
    return calibrate.bandwidth_bytes_per_s(numel, device, TRIALS, MIN_SECONDS)


def eager_bandwidth_bytes_per_s(numel: int, device: torch.device) -> float:
    """Bytes/s of `a * b` into a new fp32 tensor of `numel` elements, as an eager op in the
    training step runs: its output freshly allocated, its operands not in cache."""
    a = torch.randn(numel, device=device)
    b = torch.randn(numel, device=device)
    seconds = calibrate.time_call(lambda: a * b, device, TRIALS, MIN_SECONDS)
    return 3 * 4 * numel / seconds


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


def elementwise_bandwidth_bytes_per_s(
    model: ModelConfig, micro_batch: int, seq_len: int, precision: str, device: torch.device
) -> float:
    """Bytes/s this runtime's element-wise ops of one block achieve, forward and backward, at
    one micro-batch's size: the model's own norm, RoPE (`apply_rope`), attention-output copy,
    SwiGLU/GELU, residual adds and autocast casts, without the matmuls (fed random tensors of
    the matmuls' output shapes). The bytes are the planner's count for the same ops
    (`runtime_eager_block_parts`: forward, backward twice that)."""
    dt = DTYPES[precision]
    lowp = dt != torch.float32
    b, s, d, f, hd = micro_batch, seq_len, model.dim, model.ffn_dim, model.head_dim
    rope = rope_tables(hd, s, model.rope_theta, device) if model.pos_emb == "rope" else None
    norms = [build_norm(model).to(device) for _ in range(2)]
    x = torch.randn(b, s, d, device=device, requires_grad=True)  # the fp32 residual stream

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dt, requires_grad=True)

    q, k = leaf(b, s, model.n_heads, hd), leaf(b, s, model.n_kv_heads, hd)
    attn_out, branch2 = leaf(b, model.n_heads, s, hd), leaf(b, s, d)
    up = [leaf(b, s, f) for _ in range(2 if model.gated else 1)]
    n_casts = 3 + len(up)

    def run() -> None:
        outs = []
        h = norms[0](x)
        outs += [h.to(dt) for _ in range(n_casts if lowp else 0)]
        if rope is not None:
            outs += [apply_rope(q, rope), apply_rope(k, rope)]
        h1 = x + attn_out.transpose(1, 2).reshape(b, s, -1)
        h2 = norms[1](h1)
        outs += [h2.to(dt) for _ in range(0)]  # counted with the first norm's casts
        ff = F.silu(up[0]) * up[1] if model.gated else F.gelu(up[0], approximate="tanh")
        outs += [ff, h1 + branch2]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    seconds = calibrate.time_call(run, device, 3, MIN_SECONDS)
    plan = Plan(model=model, seq_len=s, micro_batch_size=b, global_batch_size=b,
                precision=precision)  # fmt: skip
    activations, _ = runtime_eager_block_parts(plan, act.Kernels.for_runtime(model, 1, device.type))
    return 3 * activations / seconds


def optimizer_seconds(model: ModelConfig, device: torch.device) -> float:
    """Seconds of one optimizer step as the runtime takes it (train/optim.py's foreach AdamW,
    after the foreach gradient-norm clip) over the model's parameters, gradients in place."""
    net = build_model(model, device)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    opt = build_optimizer(net, OptimizerSection())
    params = list(net.parameters())

    def run() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return calibrate.time_call(run, device, 3, MIN_SECONDS)


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
    precision: str = "fp32",
) -> tuple[Cluster, dict[str, float]]:
    """A one-device Cluster whose GPU numbers were measured here; also the raw figures.

    The attention efficiency is `precision`'s (its SDPA rate over its GEMM rate)."""
    if precision not in dtypes:
        dtypes = (*dtypes, precision)
    figures = {
        f"gemm_{dt}_flops": gemm_flops_per_s(model, tokens, DTYPES[dt], device) for dt in dtypes
    }
    seq = min(model.max_seq_len, max(1, tokens))
    micro = max(1, tokens // seq)
    figures["bandwidth_bytes"] = elementwise_bandwidth_bytes_per_s(
        model, micro, seq, precision, device
    )
    figures[f"attention_{precision}_flops"] = attention_flops_per_s(
        model, micro, seq, DTYPES[precision], device
    )
    figures["fixed_s"] = fixed_seconds(model, device)
    figures["optimizer_s"] = optimizer_seconds(model, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rates = {dt: figures[f"gemm_{dt}_flops"] for dt in dtypes}
    cluster = calibrate.measured_cluster(f"{name} (measured)", rates, figures["bandwidth_bytes"])
    gpu = cluster.gpu
    streamed = DEFAULT_TIME.optimizer_bytes_per_param * model.num_params()
    optimizer_share = streamed / figures["bandwidth_bytes"] / figures["optimizer_s"]
    achieved = dataclasses.replace(
        gpu.calibration,
        attention_efficiency=Sourced(
            figures[f"attention_{precision}_flops"] / figures[f"gemm_{precision}_flops"], SOURCE
        ),
        microbatch_overhead_ms=Sourced(1000 * figures["fixed_s"], SOURCE),
        optimizer_efficiency=Sourced(min(1.0, optimizer_share), SOURCE),
    )
    return dataclasses.replace(cluster, gpu=dataclasses.replace(gpu, calibration=achieved)), figures
