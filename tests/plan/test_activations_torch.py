"""The planner's saved-tensor list equals what autograd keeps for the runtime model (CPU).

The runtime's own counter (`SavedActivations`, the `activation_bytes` metric) is the reference:
same storages, same exclusions (parameters and buffers). Under autocast it also counts the bf16
weight casts that linears keep, which the planner reports as working parameters; they are added
here. The CUDA differences (fused RMSNorm keeps no normalised copy) are the `device` switch of
`Kernels`; this machine checks the CPU side exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmscale.instrument.activations import SavedActivations, model_state_tensors
from llmscale.model.config import ModelConfig
from llmscale.model.transformer import build_model
from llmscale.parallel.activation_checkpoint import apply_recompute
from llmscale.plan import activations as act
from llmscale.plan.plan import Plan
from llmscale.train.precision import autocast
from llmscale.train.trainer import lm_loss

LLAMA = ModelConfig(
    dim=48, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=80, vocab_size=264, max_seq_len=16
)
GPT = ModelConfig(
    dim=48,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    ffn_dim=96,
    vocab_size=264,
    max_seq_len=16,
    norm="layernorm",
    mlp="gelu",
    pos_emb="learned",
    bias=True,
    tie_embeddings=True,
)
# Nemotron-4's kind: squared ReLU, layernorm, rotary positions, untied, no biases.
RELU2 = ModelConfig(
    dim=48, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=264, max_seq_len=16,
    norm="layernorm", mlp="relu2", bias=False,
)  # fmt: skip
B, S = 3, 10


def measured(
    model_cfg: ModelConfig, precision: str, recompute: str, k: int = 2, b: int = B, s: int = S
) -> int:
    torch.manual_seed(0)
    model = build_model(model_cfg)
    apply_recompute(model, recompute, k)
    tokens = torch.randint(0, 256, (b, s + 1), generator=torch.Generator().manual_seed(1))
    with SavedActivations(model_state_tensors(model)) as c, autocast(precision, "cpu"):
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    return c.bytes


def predicted(
    model_cfg: ModelConfig, precision: str, recompute: str, k: int = 2, b: int = B, s: int = S
) -> float:
    B, S = b, s  # noqa: N806
    plan = Plan(
        model=model_cfg,
        seq_len=S,
        micro_batch_size=B,
        global_batch_size=B,
        recompute=recompute,
        recompute_every_k=k,
        precision=precision,
    )
    kern = act.RUNTIME_CPU
    modes = plan.block_modes(list(range(model_cfg.n_layers)))
    total = sum(
        n * act.block_bytes(model_cfg, B, S, precision, 1, False, kern, m) for m, n in modes.items()
    )
    total += sum(t.nbytes for t in act.embedding_tensors(B, S))
    total += sum(t.nbytes for t in act.head_tensors(model_cfg, B, S, precision, 1, False, kern))
    if precision != "fp32":  # linears keep their bf16 weight casts (biases are not kept)
        shapes = model_cfg.parameter_shapes()
        block_w = sum(
            math.prod(s) for n, s in shapes["block"] if n.endswith(".weight") and len(s) == 2
        )
        head_w = model_cfg.vocab_size * model_cfg.dim  # output (or the tied embedding) cast
        total += 2 * (modes.get("none", 0) + modes.get("selective", 0)) * block_w + 2 * head_w
    return total


@pytest.mark.parametrize("cfg", [LLAMA, GPT, RELU2], ids=["llama", "gpt", "relu2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "selective_op", "every_k", "full"])
def test_saved_bytes_equal_autograd(cfg: ModelConfig, precision: str, recompute: str) -> None:
    assert predicted(cfg, precision, recompute) == measured(cfg, precision, recompute)


SHAPES = {
    "llama-b1-s16": (LLAMA, 1, 16),
    "llama-mha-b2-s7": (LLAMA.with_overrides(n_kv_heads=4), 2, 7),
    "llama-mqa-b4-s12": (
        ModelConfig(
            dim=64, n_layers=2, n_heads=8, n_kv_heads=1, ffn_dim=160, vocab_size=300,
            max_seq_len=32,
        ),
        4,
        12,
    ),
    "gpt-b2-s16": (GPT, 2, 16),
    "gpt-wide-b1-s32": (
        GPT.with_overrides(dim=96, n_heads=6, n_kv_heads=6, ffn_dim=384, max_seq_len=32), 1, 32
    ),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_selective_op_saved_bytes_within_3_percent(shape: str, precision: str) -> None:
    """selective_op (op-level SAC): what the planner lists (block input, every other matmul's
    output, the attention kernel's output and log-sum-exp) against autograd plus the tensors the
    checkpoint stores, over shapes (MHA, GQA, MQA; SwiGLU and GELU; several b x s)."""
    cfg, b, s = SHAPES[shape]
    got = measured(cfg, precision, "selective_op", b=b, s=s)
    want = predicted(cfg, precision, "selective_op", b=b, s=s)
    assert want == pytest.approx(got, rel=0.03)
    # and it lies between full and no recomputation
    assert (
        measured(cfg, precision, "full", b=b, s=s)
        < got
        < measured(cfg, precision, "none", b=b, s=s)
    )


def test_every_3_checkpoints_one_block_of_four() -> None:
    none, full = measured(LLAMA, "bf16", "none"), measured(LLAMA, "bf16", "every_k", 3)
    assert predicted(LLAMA, "bf16", "every_k", 3) == full
    assert full < none


def test_runtime_block_formula_by_hand() -> None:
    """One Llama block, bf16 autocast, CUDA kernels: the per-token sum written out."""
    d, kv, f, h = LLAMA.dim, LLAMA.kv_dim, LLAMA.ffn_dim, LLAMA.n_heads
    per_token = (
        (4 * d + 4)  # attention_norm: fp32 input + rstd
        + 3 * 2 * d  # wq, wk, wv each keep a bf16 cast of the normed x
        + 2 * d
        + 2 * kv
        + 2 * kv
        + 2 * d
        + 4 * h  # q, k, v, output (= wo input), lse
        + (4 * d + 4)  # ffn_norm
        + 2 * 2 * d  # w1, w3 input casts
        + 4 * 2 * f  # silu input, silu output, w3 output, product
    )
    assert act.block_bytes(LLAMA, B, S, "bf16") == per_token * B * S
