"""What autograd saves for backward, tensor by tensor, per transformer block and micro-batch.

Starting point: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 1: a GPT block in fp16 with dropout and a materialised s x s softmax saves
sbh(34 + 5as/h) bytes (s tokens, b sequences, h hidden, a heads). `korthikanti_bytes` is that
formula with its tensor-parallel and sequence-parallel divisors; `block_tensors` with
`MEGATRON_2021` lists the same tensors and adds up to it exactly.

For the llmscale runtime (`model/transformer.py`, `RUNTIME`) the list is derived again, from
what each op's backward keeps (checked against `saved_tensors_hooks` in tests/plan):

- RMSNorm: its input (the fp32 residual stream) and 1/rms per token (fused CUDA kernel); the
  composite CPU path also keeps the normalised x. LayerNorm keeps input, mean and 1/std.
- Each nn.Linear keeps its input. Under autocast every linear casts its input itself, so wq, wk
  and wv keep three bf16 copies of the normed x (w1 and w3 two); in fp32 they share one.
- RoPE multiplies by cos/sin buffers: only the buffers are kept, nothing new.
- SDPA (flash/cuDNN/CPU-flash kernels) keeps q, k, v (GQA: k and v at n_kv_heads width), its
  output and the fp32 log-sum-exp per head and token; no s x s matrix. wo's input is a view of
  that output (same storage). fp32 on CUDA with n_kv_heads < n_heads falls back to the math
  kernel, which keeps the scaled q, repeated k and v, and one s x s matrix (the softmax's
  output).
- SwiGLU keeps w1's output (silu input), silu's output, w3's output and their product (w2's
  input); GELU keeps its input and its output; squared ReLU its relu's output (which the
  square reads) and its output.
- No dropout, so no masks.
- Recompute modes (`BLOCK_MODES`): selective keeps the checkpointed attention core's inputs
  instead of what it saves; full keeps the block input; selective_op (torchtitan's op-level
  policy, `_op_sac_terms`) keeps the block input, every other matmul's output and the fused
  attention kernel's output and log-sum-exp (docs/memory-model.md, "Recompute modes").

Regions set the divisors (from the runtime's TP plan, `model.config.TP_STYLES` and `SP_*`):
"norm" tensors (residual stream, norms, dropout masks: `SP_SHARDED_MODULES`) are split by
tp only under sequence parallelism; "linear_in" tensors (inputs of wq/wk/wv, w1/w3) are
replicated across tp, and under sequence parallelism are split only when the runtime re-gathers
them in backward (Megatron) rather than saving the all-gathered copy (DTensor/torchtitan
`PrepareModuleInput`); "tp" tensors (heads, FFN columns) are split by tp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec

from llmscale.config import (
    DTYPE_BYTES,
    FP8_MATMUL_BYTES,
    NVFP4_MATMUL_BYTES,
    PRECISIONS,
    Precision,
)
from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig, op_sac_saves_matmul
from llmscale.plan.cache import memoize
from llmscale.stack.kernels import ATTENTION_KERNELS as ATTENTION_KERNELS
from llmscale.stack.kernels import MEGATRON_2021 as MEGATRON_2021
from llmscale.stack.kernels import RUNTIME as RUNTIME
from llmscale.stack.kernels import RUNTIME_CPU as RUNTIME_CPU
from llmscale.stack.kernels import Kernels as Kernels

BLOCK_MODES = ("none", "selective", "selective_op", "full")
FUSED_ATTENTION = ("flash", "efficient")  # kernels that keep out + log-sum-exp, no s x s
# Row-parallel matmuls: under tp their local output is a partial sum of the full width.
ROW_PARALLEL = ("wo", "w2")
_P = ParamSpec("_P")


# What one micro-batch on one tensor-parallel rank is, as `block_tensors` and `head_tensors`
# take it: model, micro_batch_size, seq_len, precision, tp, sequence_parallel, kernels.
# Bytes per element of the cast a TransformerEngine linear saves for its backward
# (`Kernels.fp8_saves_casts`), by precision.
SAVED_CAST_BYTES: dict[str, float] = {"fp8": FP8_MATMUL_BYTES, "nvfp4": NVFP4_MATMUL_BYTES}
SliceArgs = tuple[ModelConfig, int, int, Precision, int, bool, Kernels]


@dataclass(frozen=True)
class Saved:
    """One tensor kept for backward: bytes on one tensor-parallel rank for one micro-batch."""

    name: str
    nbytes: float
    region: str  # norm | linear_in | tp | seq


def _divisor(region: str, tp: int, sp: bool, kernels: Kernels) -> int:
    if region == "partial":
        return 1
    if region == "tp":
        return tp
    if region == "norm":
        return tp if sp else 1
    if region == "linear_in":
        return tp if sp and not kernels.sp_saves_gathered_input else 1
    return 1


def residual_bytes(a: int, kernels: Kernels) -> int:
    """Bytes per element of the residual stream: fp32 when autocast runs over fp32 weights."""
    if kernels.lowp_weights or not kernels.residual_fp32:
        return a
    return 4


def norm_output_fp32(model: ModelConfig, a: int, kernels: Kernels) -> bool:
    """Is a norm's output fp32 (so that each following linear casts it again)?"""
    if a == 4:
        return True
    return residual_bytes(a, kernels) == 4


def norm_terms(
    model: ModelConfig, tag: str, a: int, kernels: Kernels
) -> list[tuple[str, float, str]]:
    """What one RMSNorm / LayerNorm keeps, per token: its input and statistics.

    RMSNorm on CPU is the composite kernel: it saves its input upcast to fp32, the fp32 rstd and
    the fp32 normalised x; the fused CUDA kernel saves the input (residual dtype) and rstd.
    LayerNorm saves its input and mean/rstd in the residual's dtype (measured on CPU; on CUDA
    the statistics of a bf16 LayerNorm are fp32, 4 bytes a token more: left out).
    """
    d, r = model.dim, residual_bytes(a, kernels)
    if model.norm == "layernorm":
        x, stat = (4, 4) if r == 4 else (a, a)
        return [
            (f"{tag} input", x * d, "norm"),
            (f"{tag} mean", stat, "norm"),
            (f"{tag} rstd", stat, "norm"),
        ]
    if kernels.device == "cpu":
        return [
            (f"{tag} input (fp32)", 4 * d, "norm"),
            (f"{tag} rstd", 4, "norm"),
            (f"{tag} normed x (composite kernel)", 4 * d, "norm"),
        ]
    return [(f"{tag} input", r * d, "norm"), (f"{tag} rstd", 4, "norm")]


def block_tensors(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
    mode: str = "none",
) -> list[Saved]:
    """The tensors one block keeps for backward under `mode` (`BLOCK_MODES`)."""
    if precision not in DTYPE_BYTES:
        raise ConfigError("precision.mode", precision, " | ".join(PRECISIONS))
    if mode not in BLOCK_MODES:
        raise ConfigError("train.recompute", mode, " | ".join(BLOCK_MODES))
    tokens = micro_batch_size * seq_len
    a = DTYPE_BYTES[precision]  # activation dtype under autocast (or fp32)
    r = residual_bytes(a, kernels)
    d, kv, f, heads = model.dim, model.kv_dim, model.ffn_dim, model.n_heads
    per_token: list[tuple[str, float, str]] = []  # (name, bytes per token, region)
    if mode == "full":
        per_token.append(("block input", r * d, "norm"))
        return _scale(per_token, tokens, tp, sequence_parallel, kernels)
    if mode == "selective_op":
        per_token = _op_sac_terms(model, a, r, kernels.attention_kernel(model, precision))
        if sequence_parallel and tp > 1:  # the reduce-scattered outputs of wo and w2
            per_token += [(f"{n} output (reduce-scattered)", a * d, "norm") for n in ROW_PARALLEL]
        return _scale(per_token, tokens, tp, sequence_parallel, kernels)

    def norm(tag: str) -> None:
        per_token.extend(norm_terms(model, tag, a, kernels))

    # TransformerEngine's linears save the cast they multiplied: float8, or under nvfp4 the
    # column-wise NVFP4 copy the weight gradient takes (4-bit values and a scale per 16).
    cast_bytes = SAVED_CAST_BYTES.get(precision) if kernels.fp8_saves_casts else None
    fp8_casts = cast_bytes is not None
    cb = cast_bytes or 0.0
    cast_name = "NVFP4" if precision == "nvfp4" else "float8"

    def linear_inputs(tag: str, names: tuple[str, ...]) -> None:
        if fp8_casts:  # one cast of the shared input (TransformerEngine)
            per_token.append((f"{tag} input ({cast_name} cast)", cb * d, "linear_in"))
        elif a == 4:
            per_token.append((f"{tag} input ({', '.join(names)} share it)", 4 * d, "linear_in"))
        elif norm_output_fp32(model, a, kernels):
            for n in names:  # autocast casts each linear's input on its own
                per_token.append((f"{n} input ({precision} cast)", a * d, "linear_in"))
        else:
            per_token.append((f"{tag} input", a * d, "linear_in"))

    norm("attention_norm")
    linear_inputs("wq/wk/wv", ("wq", "wk", "wv") if model.n_kv_heads else ("wqkv",))
    kernel = kernels.attention_kernel(model, precision)
    seq_terms: list[tuple[str, float]] = []  # bytes per token per key position (s x s)
    if kernel == "materialized":
        per_token += [("q", a * d, "tp"), ("k", a * kv, "tp"), ("v", a * kv, "tp")]
        if mode == "none":
            seq_terms.append(("softmax output", a * heads))
            if kernels.dropout:
                seq_terms += [("softmax dropout mask", 1 * heads), ("dropout output", a * heads)]
        per_token.append(("wo input (attention output)", a * d, "tp"))
    elif kernel == "math":
        if mode == "none":
            per_token += [
                ("q scaled", 4 * d, "tp"),
                ("k repeated to n_heads", 4 * d, "tp"),
                ("v repeated to n_heads", 4 * d, "tp"),
            ]
            # the softmax keeps its output for backward (and the matmul with v reads that
            # same tensor); the scores before it are not kept (measured: bench/selective.py)
            seq_terms.append(("softmax output", 4 * heads))
        else:  # the checkpointed core keeps its inputs only
            per_token += [("q", a * d, "tp"), ("k", a * kv, "tp"), ("v", a * kv, "tp")]
        per_token.append(("wo input (attention output, copied)", a * d, "tp"))
    else:  # flash / efficient / cuDNN: q, k, v, out and log-sum-exp
        kv_in = kernels.attention_kv_dim(model)  # K and V as the kernel received them
        per_token += [("q", a * d, "tp"), ("k", a * kv_in, "tp"), ("v", a * kv_in, "tp")]
        if mode == "none" or not fp8_casts:  # else the kernel's output is recomputed, and wo
            per_token.append(("attention output (= wo input)", a * d, "tp"))  # saves its cast
        if mode == "none":
            per_token.append(("log-sum-exp (fp32)", 4 * heads, "tp"))
        if fp8_casts:
            per_token.append((f"wo input ({cast_name} cast)", cb * d, "tp"))
    if kernels.dropout:
        per_token.append(("attention residual dropout mask", 1 * d, "norm"))
    norm("ffn_norm")
    if model.gated:
        linear_inputs("w1/w3", ("w1", "w3"))
        per_token += [("w1 output (silu input)", a * f, "tp"), ("w3 output", a * f, "tp")]
        if not kernels.fused_swiglu:
            per_token.append(("silu output", a * f, "tp"))
        w2_in = cb if fp8_casts else a
        per_token.append(
            ("w2 input (silu x w3)" + (f", {cast_name}" if fp8_casts else ""), w2_in * f, "tp")
        )
    else:
        linear_inputs("w1", ("w1",))
        w2_in = cb if fp8_casts else a
        act_in, act_out = (
            ("relu output (square input)", "squared relu output")
            if model.mlp == "relu2"
            else ("w1 output (gelu input)", "gelu output")
        )
        per_token += [
            (act_in, a * f, "tp"),
            (f"w2 input ({act_out})" + (f", {cast_name}" if fp8_casts else ""), w2_in * f, "tp"),
        ]
    if kernels.dropout:
        per_token.append(("mlp residual dropout mask", 1 * d, "norm"))
    out = _scale(per_token, tokens, tp, sequence_parallel, kernels)
    out += [Saved(n, per * tokens * seq_len / tp, "seq") for n, per in seq_terms]
    return out


def _op_sac_terms(model: ModelConfig, a: int, r: int, kernel: str) -> list[tuple[str, float, str]]:
    """selective_op's per-token list: the checkpointed block's input, the outputs of the
    matmuls `op_sac_saves_matmul` keeps, and a fused attention kernel's output and log-sum-exp
    (the math / materialised paths are composite: nothing of theirs is kept)."""
    out: list[tuple[str, float, str]] = [("block input", r * model.dim, "norm")]
    for i, (name, _, n_out) in enumerate(model.block_matmuls()):
        if op_sac_saves_matmul(i):
            region = "partial" if name in ROW_PARALLEL else "tp"
            out.append((f"{name} output", a * n_out, region))
    if kernel in FUSED_ATTENTION:
        out += [
            ("attention output", a * model.dim, "tp"),
            ("log-sum-exp (fp32)", 4 * model.n_heads, "tp"),
        ]
    return out


def _scale(
    per_token: list[tuple[str, float, str]], tokens: int, tp: int, sp: bool, kernels: Kernels
) -> list[Saved]:
    return [
        Saved(name, per * tokens / _divisor(region, tp, sp, kernels), region)
        for name, per, region in per_token
    ]


def checkpoint_inputs(saved: list[Saved], mode: str) -> list[Saved]:
    """Of a block's `saved` tensors under `mode`, the inputs its checkpointed region keeps for
    its recomputation: the block input (full, selective_op: the op outputs it stores are freed
    by the block's backward) or the attention core's q, k and v (selective); none keeps nothing
    extra."""
    if mode == "full":
        return saved
    if mode == "selective_op":
        return [t for t in saved if t.name == "block input"]
    if mode == "selective":
        return [t for t in saved if t.name in ("q", "k", "v")]
    return []


def embedding_tensors(micro_batch_size: int, seq_len: int) -> list[Saved]:
    """First stage: the embedding keeps the token ids (the micro-batch's seq_len + 1 columns)."""
    return [Saved("token ids (int64)", 8 * micro_batch_size * (seq_len + 1), "seq")]


def head_tensors(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> list[Saved]:
    """Last stage: final norm, the output projection's input and what the loss keeps."""
    tokens = micro_batch_size * seq_len
    a = DTYPE_BYTES[precision]
    d = model.dim
    per_token = norm_terms(model, "final norm", a, kernels)
    per_token.append(("output projection input", a * d, "linear_in"))
    out = _scale(per_token, tokens, tp, sequence_parallel, kernels)
    out += loss_tensors(model, micro_batch_size, seq_len, precision, tp, sequence_parallel, kernels)
    out += [
        Saved("targets (int64)", 8 * tokens, "seq"),
        Saved("loss total weight", 4, "seq"),
    ]
    return out


@dataclass(frozen=True)
class LossFacts:
    """One cross-entropy kernel (`Kernels.loss_kernel`) per logit of a micro-batch, read from
    its code: what it keeps for its backward (`keeps`: label, bytes per logit, bytes per
    token), what it holds beside that at its peak (`held`, bytes per logit), and the HBM bytes
    its kernels move (`moved`: forward, backward per logit; None where the time model prices
    passes over what it keeps, as for every other fused kernel)."""

    keeps: tuple[tuple[str, float, float], ...]
    held: float
    moved: tuple[float, float] | None


def loss_facts(
    model: ModelConfig, tp: int, precision: Precision, kernels: Kernels = RUNTIME
) -> LossFacts:
    """The facts of `kernels`' cross-entropy kernel, the one place that branches on it. With
    a = the logits' dtype in bytes, the fp32 copy every kernel but TransformerEngine's makes
    costs a + 4 (read, write) and its gradient's cast back 4 + a (neither for fp32 logits).

    torch's F.cross_entropy on the fp32 logits (the runtime's `lm_loss`, torchtitan's loss)
    keeps the fp32 log-softmax output. log_softmax reads a row three times (max, sum of exp,
    output) and writes it, 16 B; backward, nll_loss's zeros (4) and log_softmax's backward
    (the row's gradient sum, then the gradient from it and exp of the output: 16). In that
    backward the gradients of the output and of the input are both fp32 while the saved
    output lives: 8 B held (the forward peak, the logits and their fp32 copy, is 6 or 4). On
    vocabulary shards (torch's `loss_parallel`, `torch/distributed/tensor/parallel/loss.py`
    `_log_softmax`, `_nll_loss_and_log_softmax_backward`) each step is its own kernel: amax
    (4), the shift (8), exp (8), sum (4), the result (8), 32 B; backward zeros (4), exp of the
    output (8), their sum (12), the product with the output gradient (8), 32; the composite
    backward holds 12 B (the zeros the targets scatter into, exp of the output, their sum;
    torch's MemTracker over the two: tests/plan/test_loss_memory.py). Compiled
    (`Kernels.compiled_loss`): it keeps its input and a log-sum-exp and a max per token, and
    computes the logits' gradient in one fused kernel (none held).

    Megatron's vocab_parallel_cross_entropy (megatron/core/tensor_parallel/cross_entropy.py)
    keeps the fp32 softmax, made in place on its fp32 copy by one kernel per step: the row max
    (4), the max subtracted in place (8), exp in place (8), the row sum (4), the division in
    place (8): 32 B; backward, the gradient scaled in place (8). It holds a B: in forward the
    logits beside the copy, in backward the gradient cast to their dtype beside it. Fused
    (megatron/core/fusions/fused_cross_entropy.py, its steps each one torch.compile'd
    function): the copy with its max, the subtraction, exp and sum (8), the division (8);
    backward the scaling, written back to the saved softmax, and its cast to bf16
    (hard-coded) in one pass, 10. TransformerEngine's
    (transformer_engine/pytorch/triton/cross_entropy.py) writes the gradient over the logits
    in forward and keeps that (a B, none held): the online softmax reads the logits (a), then
    the gradient is written over them (read a, write a): 3a; backward its scaling by the
    output gradient (read a, write a): 2a."""
    a = float(DTYPE_BYTES[precision])
    up, down = (a + 4.0, 4.0 + a) if a < 4 else (0.0, 0.0)
    kernel = kernels.loss()
    softmax = (("softmax (fp32 logits)", 4.0, 0.0),)
    if kernel == "megatron":
        return LossFacts(softmax, a, (up + 32, 8 + down))
    if kernel == "megatron_fused":
        return LossFacts(softmax, a, ((up or 4.0) + 16, 8.0 + 2.0))
    if kernel == "te":
        return LossFacts((("the logits' gradient, over the logits", a, 0.0),), 0.0, (3 * a, 2 * a))
    if kernels.compiled_loss:
        keeps = (
            ("logits (the compiled loss's input)", a, 0.0),
            ("row max and log-sum-exp (fp32)", 0.0, 8.0),
        )
        return LossFacts(keeps, 0.0, None)
    log_softmax = (("log-softmax output (fp32 logits)", 4.0, 0.0),)
    if kernels.splits_logits(model, tp):
        return LossFacts(log_softmax, 12.0, (up + 32, 32 + down))
    return LossFacts(log_softmax, 8.0, (up + 16, 20 + down))


def loss_tensors(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> list[Saved]:
    """What the cross-entropy kernel keeps over the logits for its backward (`loss_facts`)."""
    logits = logit_count(model, micro_batch_size, seq_len, tp, kernels)
    tokens = micro_batch_size * seq_len
    facts = loss_facts(model, tp, precision, kernels)
    return [Saved(label, per_logit * logits + per_token * tokens, "seq")
            for label, per_logit, per_token in facts.keeps]  # fmt: skip


def loss_traffic(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> tuple[float, float] | None:
    """HBM bytes the cross-entropy kernel moves over one micro-batch's logits (forward,
    backward; `loss_facts`); None for a compiled loss, priced as passes over what it keeps."""
    moved = loss_facts(model, tp, precision, kernels).moved
    if moved is None:
        return None
    logits = logit_count(model, micro_batch_size, seq_len, tp, kernels)
    return moved[0] * logits, moved[1] * logits


@memoize
def head_traffic(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int,
    sequence_parallel: bool,
    kernels: Kernels,
    fwd_passes: float,
    bwd_passes: float,
) -> tuple[float, float]:
    """HBM bytes the head's element-wise kernels move for one micro-batch (forward, backward):
    `fwd_passes` and `bwd_passes` over what the head keeps (`head_tensors`), the loss's share
    as its kernel moves it (`loss_traffic`; a compiled loss by the passes too)."""
    args = (model, micro_batch_size, seq_len, precision, tp, sequence_parallel, kernels)
    kept = head_bytes(*args)
    moved = loss_traffic(*args)
    if moved is None:
        return fwd_passes * kept, bwd_passes * kept
    rest = kept - sum(t.nbytes for t in loss_tensors(*args))  # the norm, the input, targets
    return fwd_passes * rest + moved[0], bwd_passes * rest + moved[1]


def block_output_grads(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> list[Saved]:
    """What a split backward's B keeps of one block for its W (torch 2.13's
    `stage_backward_input`): the gradient at every op W starts from, i.e. each linear's output
    gradient (in the activation dtype; column-parallel ones split over tp, row-parallel ones
    partial sums at full width) and each norm weight's (the norm output's dtype): per token
    5h + 2h_kv + 2f values for SwiGLU, measured (`parallel.pipeline.pending_weight_grad_bytes`).
    """
    tokens = micro_batch_size * seq_len
    a = DTYPE_BYTES[precision]
    n = 4 if norm_output_fp32(model, a, kernels) else a
    per_token: list[tuple[str, float, str]] = [
        (f"{name} output gradient", a * n_out, "partial" if name in ROW_PARALLEL else "tp")
        for name, _, n_out in model.block_matmuls()
    ]
    per_token += [(f"{tag} weight's output gradient", n * model.dim, "norm")
                  for tag in ("attention_norm", "ffn_norm")]  # fmt: skip
    return _scale(per_token, tokens, tp, sequence_parallel, kernels)


def head_output_grads(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> list[Saved]:
    """`block_output_grads` of the head's stage beyond its blocks: the final norm weight's
    output gradient, the logits' gradient (the output projection's) and the 0-d loss the stage
    keeps as its output."""
    tokens = micro_batch_size * seq_len
    a = DTYPE_BYTES[precision]
    n = 4 if norm_output_fp32(model, a, kernels) else a
    vocab_div = tp if kernels.splits_vocab(model, tp) else 1
    out = _scale([("final norm weight's output gradient", n * model.dim, "norm")], tokens, tp,
                 sequence_parallel, kernels)  # fmt: skip
    out += [
        Saved("logits gradient", a * tokens * model.vocab_size / vocab_div, "seq"),
        Saved("loss (the stage's output)", 4, "seq"),
    ]
    return out


def boundary_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> float:
    """One micro-batch of the residual stream between two pipeline stages: what a stage sends
    (its output), receives (an activation, an output gradient) and returns (an input gradient)."""
    a = DTYPE_BYTES[precision]
    per = residual_bytes(a, kernels) * model.dim * micro_batch_size * seq_len
    return per / _divisor("norm", tp, sequence_parallel, kernels)


def logit_count(
    model: ModelConfig, micro_batch_size: int, seq_len: int, tp: int, kernels: Kernels
) -> float:
    """Logits of one micro-batch on one tensor-parallel rank: its vocabulary shard where the
    loss runs on shards (`Kernels.splits_logits`), else the whole vocabulary."""
    vocab_div = tp if kernels.splits_logits(model, tp) else 1
    return micro_batch_size * seq_len * model.vocab_size / vocab_div


def logits_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> float:
    """One micro-batch's logits as the output projection makes them, in the activation dtype
    (`logit_count` of them)."""
    return DTYPE_BYTES[precision] * logit_count(model, micro_batch_size, seq_len, tp, kernels)


@memoize
def with_weights(kernels: Kernels, lowp_weights: bool) -> Kernels:
    """`kernels` for a plan whose forward weights are (or are not) already low precision."""
    if kernels.lowp_weights == lowp_weights:
        return kernels
    return dataclasses.replace(kernels, lowp_weights=lowp_weights)


def _summed(tensors: Callable[_P, list[Saved]], name: str) -> Callable[_P, float]:
    """`tensors` summed to bytes, memoized: `name` = sum of `tensors`."""

    def total(*args: _P.args, **kwargs: _P.kwargs) -> float:
        return sum(t.nbytes for t in tensors(*args, **kwargs))

    total.__name__ = total.__qualname__ = name
    total.__doc__ = f"Sum of `{tensors.__name__}`."
    return memoize(total)


block_bytes = _summed(block_tensors, "block_bytes")
head_bytes = _summed(head_tensors, "head_bytes")


def mlp_backward_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> float:
    """Gradients a block's backward holds beside its saved tensors at its peak, in the
    feed-forward network, one micro-batch on one tensor-parallel rank: a gated activation's
    backward writes the gradients of its two inputs while that of its output is alive, each
    b x s x ffn/tp in the activation dtype, where the product it read was freed by the down
    projection's backward: two such tensors beyond what the block saved; a GeLU's, its input's
    gradient beside its output's: one. (Measured on the runtime's block under fp32 and bf16,
    with and without recompute: tests/plan/test_backward_memory.py; the rest of the backward's
    rise, one or two residual-stream tensors and a weight's gradient, is not counted.) The
    intermediate is never sequence-split, so sequence parallelism does not divide it."""
    del sequence_parallel, kernels  # (the SliceArgs signature; neither changes it)
    tensors = 2 if model.gated else 1
    return tensors * micro_batch_size * seq_len * model.ffn_dim / tp * DTYPE_BYTES[precision]


@memoize
def attention_live_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> float:
    """Bytes of a block's saved tensors (`block_tensors` with nothing recomputed) still held
    when its attention's backward runs: those of the attention half (its norm, the q/k/v
    projections' input, the attention's inputs and output); the MLP's were consumed by its
    backward."""
    total = 0.0
    args = (model, micro_batch_size, seq_len, precision, tp, sequence_parallel, kernels)
    for t in block_tensors(*args):
        if t.name.startswith("ffn_norm"):
            break
        total += t.nbytes
    return total


def torch_ring_backward_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int,
    cp: int,
    kernels: Kernels,
) -> float:
    """Bytes the backward of torch's `context_parallel` ring attention holds on one cp rank at
    its peak, beyond the attention's saved tensors (torch.distributed.tensor.experimental,
    `_templated_ring_attention_backward` with the default `allgather` rotation and
    `convert_to_f32`), for one micro-batch of t = b x s / cp tokens: every rank's K and V
    all-gathered in the activation dtype (cp x t x 2 x the K/V width, kept for the whole call),
    the fp32 accumulators of dQ and of dK/dV, the fp32 dK/dV it sends on to the next rank (a
    concatenated copy) and the one it receives from the previous (a new buffer), and the
    incoming output gradient. K and V are as the kernel receives them: repeated to the query
    heads under `Kernels.repeat_kv`. The forward's own (the gathered K and V, the fp32 output
    being merged) is smaller and is not counted."""
    a = DTYPE_BYTES[precision]  # (fp8: the attention runs in bf16)
    t = micro_batch_size * seq_len / cp
    q_width = model.dim / tp
    kv_width = kernels.attention_kv_dim(model) / tp
    gathered = cp * t * 2 * kv_width * a
    accumulators = 4 * t * q_width + 4 * t * 2 * kv_width
    in_flight = 2 * 4 * t * 2 * kv_width  # sent (concatenated) and received
    grad_out = a * t * q_width
    return gathered + accumulators + in_flight + grad_out


def loss_transient_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: Precision,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: Kernels = RUNTIME,
) -> float:
    """Short-lived logits memory beyond what the loss keeps (`loss_tensors`), at its peak
    (`loss_facts`)."""
    held = loss_facts(model, tp, precision, kernels).held
    return held * logit_count(model, micro_batch_size, seq_len, tp, kernels)


def korthikanti_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Korthikanti et al. 2022 per-layer activation bytes, eqs. 1-4 (fp16, dropout, s x s).

    none: sbh(10 + 24/t + 5as/(ht)); with sequence parallelism sbh(34/t + 5as/(ht));
    selective drops the 5as/h term; full keeps the block input, 2sbh (/t with SP).
    """
    s, b, h, a = seq_len, micro_batch_size, model.dim, model.n_heads
    t = tp
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    core = 34 / t if sequence_parallel else 10 + 24 / t
    attn = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    return s * b * h * (core + attn)
