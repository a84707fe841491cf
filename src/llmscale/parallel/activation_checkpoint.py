"""Activation checkpointing (recomputation): a transform `parallelize` applies to the model.

It lives in `parallel/` with tensor parallelism and FSDP because it is the same kind of thing:
a rewrite of the built model, applied in a fixed order (after TP, so the recomputed forward
includes TP's collectives; before FSDP, so FSDP's hooks wrap the checkpointed blocks), that the
model file knows nothing about; the trainer only names the mode. The measuring of what autograd
keeps is elsewhere (`instrument/activations.py`); this module only reports to it what a
checkpointed region keeps outside autograd's hooks (its inputs, and the outputs an op-level
policy stores), with `note_checkpoint_kept`.

Modes (train.recompute):
- none: every block keeps what autograd saves;
- selective: only the attention core (SDPA) is recomputed: it keeps q, k, v instead of its
  output and log-sum-exp (Korthikanti et al. 2022 recompute the core for the s x s matrix; with
  SDPA that matrix is never stored, so the saving is smaller, but the mode is the same);
- selective_op: every block is checkpointed with an op-level policy (torchtitan's selective
  activation checkpointing): it keeps its input, the outputs of every other matmul
  (`model.config.op_sac_saves_matmul`: wq, wv, w1, w2), the attention kernel's outputs (output
  and log-sum-exp) and, under sequence parallelism, the reduce-scattered outputs; the rest
  (norms, wk, wo, w3, RoPE, activations) is recomputed in backward;
- every_k: every k-th block (layers k-1, 2k-1, ...) is recomputed whole;
- full: every block is recomputed; only its input is kept.

Checkpointing uses `torch.utils.checkpoint` in its non-reentrant form. A wrapped module's class
is swapped for a generated subclass whose `forward` runs the original one under `checkpoint`
(`parallel.class_swap`, as `fully_shard` does), so parameter names do not change with the mode: llmscale keys
initial values, offload units, checkpoints and the planner's shapes by name, and
`checkpoint_wrapper` would insert a level. Nothing refers back to the module either, so a model
is freed as soon as it is dropped (a per-instance `forward` holding a bound method of its module
is a reference cycle, which waits for the garbage collector).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from llmscale.instrument.activations import note_checkpoint_kept
from llmscale.model.config import OP_SAC_SAVED_COLLECTIVES, block_recompute, op_sac_saves_matmul
from llmscale.model.transformer import AttentionCore, TransformerBlock
from llmscale.parallel.class_swap import prepend_class
from llmscale.torch_internals import sac_stored_tensors

_aten = torch.ops.aten
# The matmuls the op-level policy counts (nn.Linear: mm without bias, addmm with one).
MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default})
# The functional collectives by the names model.config's facts use.
_COLLECTIVE_OPS = {
    "reduce_scatter": torch.ops._c10d_functional.reduce_scatter_tensor.default,
    "all_gather": torch.ops._c10d_functional.all_gather_into_tensor.default,
    "all_reduce": torch.ops._c10d_functional.all_reduce.default,
}
# Ops whose outputs selective_op always keeps: the fused attention kernels (torchtitan's list,
# with the CPU flash kernel and cuDNN's) and the collectives `OP_SAC_SAVED_COLLECTIVES` names
# (the sequence-parallel reduce-scatter); the planner counts the others as run again.
SAVED_OPS = frozenset(
    {
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
    | {_COLLECTIVE_OPS[name] for name in OP_SAC_SAVED_COLLECTIVES}
)


class _OpPolicy:
    """selective_op's policy for one block's forward: keep the attention kernel's outputs and
    every other matmul's (`op_sac_saves_matmul`), recompute everything else. The policy is
    consulted in the forward only; the recomputation replays its decisions."""

    def __init__(self) -> None:
        self.matmuls = 0

    def __call__(
        self, ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy:
        if func in MATMUL_OPS:
            self.matmuls += 1
            keep = op_sac_saves_matmul(self.matmuls - 1)
        else:
            keep = func in SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class _CountingForward:
    """SAC's forward context; on leaving it, reports the outputs it stored to the instruments."""

    def __init__(self, caching: Any) -> None:
        self.caching = caching

    def __enter__(self) -> _CountingForward:
        self.caching.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.caching.__exit__(*exc)
        note_checkpoint_kept(sac_stored_tensors(self.caching))


def op_sac_contexts() -> tuple[Any, Any]:
    """`context_fn` for `checkpoint`: a fresh selective_op policy per block forward."""
    caching, cached = create_selective_checkpoint_contexts(_OpPolicy())  # type: ignore[no-untyped-call]
    if torch.compiler.is_compiling():  # the compiled graph saves the kept outputs through hooks
        return caching, cached
    return _CountingForward(caching), cached


class Checkpointed(nn.Module):
    """Placed before a module's own class: its forward runs under activation checkpointing."""

    _context_fn: Any = staticmethod(noop_context_fn)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # a compiled block (parallel/compile.py)
            ctx = _traced_context(self)
            return checkpoint(super().forward, *args, use_reentrant=False, **ctx, **kwargs)
        note_checkpoint_kept(args)  # the checkpoint keeps them for the recomputation
        return checkpoint(
            super().forward, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs
        )


def _traced_context(module: Checkpointed) -> dict[str, Any]:
    """`checkpoint`'s context_fn as dynamo takes it: none for the plain checkpoint, else a
    `functools.partial` made in the traced code (torch 2.13's dynamo refuses a function read
    from an attribute). Compiled, the graph saves what the region keeps through autograd's
    saved-tensor hooks, so nothing is reported by hand."""
    if module._context_fn is noop_context_fn:
        return {}
    return {"context_fn": functools.partial(module._context_fn)}


class OpCheckpointed(Checkpointed):
    """Checkpointed with selective_op's op-level policy (some op outputs kept)."""

    _context_fn: Any = staticmethod(op_sac_contexts)


def checkpoint_module(module: nn.Module, policy: type[Checkpointed] = Checkpointed) -> None:
    """Run `module`'s forward under checkpointing from now on (once; names are unchanged).

    `policy`: `Checkpointed` (keep only the inputs) or `OpCheckpointed` (selective_op)."""
    if isinstance(module, Checkpointed):
        return
    if "forward" in vars(module):
        raise TypeError(f"{type(module).__name__} has a per-instance forward; cannot checkpoint")
    prepend_class(module, policy)


def is_recomputed(module: nn.Module, mode: str, every_k: int = 2) -> bool:
    """Whether `mode` checkpoints `module` (the rule is `model.config.block_recompute`'s)."""
    if isinstance(module, AttentionCore):
        return block_recompute(mode, 0, every_k) == "selective"
    if isinstance(module, TransformerBlock):
        return block_recompute(mode, module.layer_id, every_k) in ("full", "selective_op")
    return False


def apply_recompute(model: nn.Module, mode: str, every_k: int = 2) -> list[str]:
    """Checkpoint the parts that `mode` names; returns the names of the wrapped modules."""
    if mode == "none":
        return []
    policy = OpCheckpointed if mode == "selective_op" else Checkpointed
    wrapped = [name for name, m in model.named_modules() if is_recomputed(m, mode, every_k)]
    for name in wrapped:
        checkpoint_module(model.get_submodule(name), policy)
    return wrapped
