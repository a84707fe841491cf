"""A block's backward holds its MLP's gradients beside what it saved
(`plan.activations.mlp_backward_bytes`), measured on the runtime's own block.

Every storage an op creates is counted until it is freed (a dispatch mode over the block's
forward and backward); the rise of the live bytes during backward above what forward left (or,
recomputed, above the block's saved tensors as the planner counts them) is at least the
planner's MLP gradients, and beyond them at most three residual-stream tensors and the block's
weight gradients, which the planner does not count. (Without the MLP's gradients, SwiGLU's two
b x s x ffn tensors, the fp32 rise would exceed that bound.)"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from llmscale.model.config import ModelConfig, get_preset
from llmscale.model.transformer import TransformerBlock, rope_tables
from llmscale.plan import activations as act

B, S = 4, 512


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops it sees create, while they live, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)


def _gelu(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, mlp="gelu", bias=True, norm="layernorm", pos_emb="learned")


def _backward_rise(cfg: ModelConfig, precision: str, recompute: bool) -> tuple[int, int]:
    """(live bytes after forward, peak of live bytes during backward) of one block."""
    torch.manual_seed(0)
    block = TransformerBlock(cfg, 0)
    rope = rope_tables(cfg.head_dim, S, cfg.rope_theta) if cfg.pos_emb == "rope" else None
    x = torch.randn(B, S, cfg.dim, requires_grad=True)
    grad = torch.randn(B, S, cfg.dim)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    meter = _LiveBytes()
    with meter:
        with autocast:
            y = checkpoint(block, x, rope, use_reentrant=False) if recompute else block(x, rope)
        after_forward = meter.live
        meter.peak = meter.live
        y.backward(grad)
    return after_forward, meter.peak


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "gelu"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_a_blocks_backward_holds_its_mlp_gradients(
    gated: bool, precision: str, recompute: bool
) -> None:
    cfg = get_preset("small") if gated else _gelu(get_preset("small"))
    after_forward, peak = _backward_rise(cfg, precision, recompute)
    kern = act.RUNTIME_CPU
    mlp = act.mlp_backward_bytes(cfg, B, S, precision, 1, False, kern)  # type: ignore[arg-type]
    assert mlp == (2 if gated else 1) * B * S * cfg.ffn_dim * (4 if precision == "fp32" else 2)
    # Recomputed, the block's whole forward is alive again: the planner's `none` set.
    base = (
        act.block_bytes(cfg, B, S, precision, 1, False, kern, "none")  # type: ignore[arg-type]
        if recompute
        else after_forward
    )
    rise = peak - base
    residual = B * S * cfg.dim * 4  # fp32, the runtime's residual stream
    weight_grads = sum(4 * p.numel() for p in TransformerBlock(cfg, 0).parameters())
    assert mlp <= rise <= mlp + 3 * residual + weight_grads, (rise, mlp, residual)
