"""Whole tensors out of sharded ones, for tests, exports and comparisons across layouts."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def full_parameters(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's model parts as a full CPU tensor, by name.

    DTensors (FSDP shards, TP shards) are all-gathered, so every rank of a pipeline stage must
    call this together; pipeline stages return disjoint names (merge them for the whole model).
    """
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, p in part.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            out[name] = full.detach().to("cpu", copy=True)
    return out
