"""Give a model built on the meta device its memory and its initial values, after parallelize.

The trainer builds the model on `meta` (no memory), splits, shards and wraps it there, and only
then allocates each rank's own pieces (`to_empty`) and fills them: a rank never holds more than
its pipeline stage's shard plus one full parameter at a time, so a model that fits only when
sharded can be built at all (torchtitan's meta-device init, in the same order).

Values are layout-independent: every parameter's full initial value comes from its own generator,
seeded by (seed, name) (`Transformer.initial_value`), and the rank keeps its slice of it
(`distribute_tensor(..., src_data_rank=None)`: each rank slices its own copy, no communication).
So a run under any layout starts from exactly the single-process weights, which the layout
tests check. The cost is that each rank draws the full values of its stage's parameters on the
host (about 0.2 G values/s per core with torch's CPU generator).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def materialize(
    parts: Sequence[nn.Module],
    device: torch.device,
    seed: int,
    param_device: torch.device | None = None,
) -> None:
    """Allocate `parts` (built on meta) on `param_device` (default `device`) and initialise them.

    Buffers (the RoPE table) go to `device`; `param_device` differs under FSDP2's CPU offload,
    whose sharded parameters live in host memory.
    """
    where = param_device or device
    for part in parts:
        part.to_empty(device=where)
        for name, p in part.named_parameters():
            full = part.initial_value(name, tuple(p.shape), seed)  # type: ignore[operator]
            copy_full_into(p, full)
        part.init_buffers(device)  # type: ignore[operator]


@torch.no_grad()
def copy_full_into(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into parameter `p`: its own shard when `p` is a DTensor
    (every rank holds `full` and keeps its piece; nothing is sent)."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        mine = distribute_tensor(full.to(mesh.device_type), mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(mine.to_local())
    else:
        p.copy_(full)
