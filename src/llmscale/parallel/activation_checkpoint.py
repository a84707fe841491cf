"""Activation checkpointing (recomputation): a transform `parallelize` applies to the model.

It lives in `parallel/` with tensor parallelism and FSDP because it is the same kind of thing:
a rewrite of the built model, applied in a fixed order (after TP, so the recomputed forward
includes TP's collectives; before FSDP, so FSDP's hooks wrap the checkpointed blocks), that the
model file knows nothing about; the trainer only names the mode. The measuring of what autograd
keeps is elsewhere (`instrument/activations.py`); this module only reports to it the inputs a
checkpointed region keeps, with `note_checkpoint_inputs`.

Modes (train.recompute):
- none: every block keeps what autograd saves;
- selective: only the attention core (SDPA) is recomputed: it keeps q, k, v instead of its
  output and log-sum-exp (Korthikanti et al. 2022 recompute the core for the s x s matrix; with
  SDPA that matrix is never stored, so the saving is smaller, but the mode is the same);
- every_k: every k-th block (layers k-1, 2k-1, ...) is recomputed whole;
- full: every block is recomputed; only its input is kept.

Checkpointing uses `torch.utils.checkpoint` in its non-reentrant form. A wrapped module's class
is swapped for a generated subclass whose `forward` runs the original one under `checkpoint`
(what `fully_shard` does), so parameter names do not change with the mode: llmscale keys
initial values, offload units, checkpoints and the planner's shapes by name, and
`checkpoint_wrapper` would insert a level. Nothing refers back to the module either, so a model
is freed as soon as it is dropped (a per-instance `forward` holding a bound method of its module
is a reference cycle, which waits for the garbage collector).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from llmscale.instrument.activations import note_checkpoint_inputs
from llmscale.model.config import block_recompute
from llmscale.model.transformer import AttentionCore, TransformerBlock


class Checkpointed(nn.Module):
    """Placed before a module's own class: its forward runs under activation checkpointing."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        note_checkpoint_inputs(args)  # the checkpoint keeps them for the recomputation
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


_SUBCLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def checkpoint_module(module: nn.Module) -> None:
    """Run `module`'s forward under checkpointing from now on (once; names are unchanged)."""
    if isinstance(module, Checkpointed):
        return
    if "forward" in vars(module):
        raise TypeError(f"{type(module).__name__} has a per-instance forward; cannot checkpoint")
    cls = type(module)
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Checkpointed{cls.__name__}", (Checkpointed, cls), {})
        _SUBCLASSES[cls] = sub
    module.__class__ = sub


def is_recomputed(module: nn.Module, mode: str, every_k: int = 2) -> bool:
    """Whether `mode` checkpoints `module` (the rule is `model.config.block_recompute`'s)."""
    if isinstance(module, AttentionCore):
        return block_recompute(mode, 0, every_k) == "selective"
    if isinstance(module, TransformerBlock):
        return block_recompute(mode, module.layer_id, every_k) == "full"
    return False


def apply_recompute(model: nn.Module, mode: str, every_k: int = 2) -> list[str]:
    """Checkpoint the parts that `mode` names; returns the names of the wrapped modules."""
    if mode == "none":
        return []
    wrapped = [name for name, m in model.named_modules() if is_recomputed(m, mode, every_k)]
    for name in wrapped:
        checkpoint_module(model.get_submodule(name))
    return wrapped
