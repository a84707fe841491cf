"""Activation offload: the first N transformer blocks keep their saved activations in host
memory between their forward and their backward (`train.offload_activations`; Megatron-Core's
--cpu-offloading-num-layers, which offloads the same blocks).

A transform `parallelize` applies to the built model, like activation checkpointing (and, as
Megatron-Core, never with it: `JobConfig.validate` refuses recompute with offload, and a
pipeline). Each offloaded block gets `Offloaded` before its own class
(`parallel.class_swap`), whose `forward` runs the original one under
`torch.autograd.graph.save_on_cpu`: every tensor autograd saves inside the block is copied to
host memory (pinned, on a GPU) as it is saved, and back to the device when its backward needs
it. The copies run on the compute stream, so the device waits
for them: the planner prices them whole (`Stack.activation_offload` "blocking"), where
TransformerEngine's offload under Megatron-Core runs them on a side stream ("async").

Saved-tensor hooks nest innermost-first, so `instrument.activations`' measurement, registered
around the whole step, does not see what an offloaded block saves: it measures the device's
activations, as the planner counts them (`plan.work.RankWork.host_saved` is the rest).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmscale.model.transformer import TransformerBlock
from llmscale.parallel.class_swap import prepend_class


class Offloaded(nn.Module):
    """Placed before a block's own class: what its forward saves for backward waits on the host."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        pin = any(p.is_cuda for p in self.parameters())  # pinned buffers for a GPU's copies
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return super().forward(*args, **kwargs)


def offload_module(module: nn.Module) -> None:
    """Run `module`'s forward with its saved tensors on the host from now on (once; parameter
    names are unchanged)."""
    if isinstance(module, Offloaded):
        return
    if "forward" in vars(module):
        raise TypeError(f"{type(module).__name__} has a per-instance forward; cannot offload")
    prepend_class(module, Offloaded)


def apply_activation_offload(model: nn.Module, n_blocks: int) -> list[str]:
    """Offload the saved activations of the model's blocks 0 .. n_blocks - 1 (those of them this
    part holds); returns the names of the wrapped blocks."""
    names = [
        name
        for name, m in model.named_modules()
        if isinstance(m, TransformerBlock) and m.layer_id < n_blocks
    ]
    for name in names:
        offload_module(model.get_submodule(name))
    return names
