"""Whole tensors out of sharded ones, for tests, exports and comparisons across layouts."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def full_parameters(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's model parts as a full CPU tensor, by name.

    DTensors (FSDP shards, TP shards) are all-gathered, so every rank of a pipeline stage must
    call this together; pipeline stages return disjoint names (merge them for the whole model).
    Values come from the state dict, which under `offload = "optimizer+params"` holds the host
    copies (the device parameters have no storage between uses).
    """
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        sd = part.state_dict()
        for name, p in part.named_parameters():
            t = sd.get(name, p)
            full = _gathered(t) if hasattr(t, "full_tensor") else t.detach()
            out[name] = full.detach().to("cpu", copy=True)
    return out


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor; a host shard of a device mesh goes to the mesh's device first."""
    from torch.distributed.tensor import DTensor

    assert isinstance(t, DTensor)
    local = t.to_local()
    mesh = t.device_mesh
    if local.device.type != mesh.device_type:
        local = local.to(mesh.device_type)
        t = DTensor.from_local(local, mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()
