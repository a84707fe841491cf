"""Global gradient-norm clipping over DTensor shards, replicas and pipeline stages.

Gradients come as plain tensors (single process, pipeline-only, replicated norms under TP) or
DTensors on different meshes (FSDP shards on dp, TP shards on tp, both for FSDP + TP), so
`torch.nn.utils.clip_grad_norm_`, which stacks per-tensor norms, cannot take them all. Instead
each rank sums the squares of its local pieces, weighted so that every element of every
parameter counts once over the whole job, and one all-reduce over the world adds them up:

    weight = (shards of this tensor) / (ranks holding the stage's parameters = dp x tp)

(a replicated copy on k of those ranks is counted k times, hence 1/k; a tensor split into n
shards over them has each shard on dp x tp / n ranks). Summing over the world also sums over
pipeline stages, which hold disjoint parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from llmscale.parallel.dims import ParallelDims
from llmscale.tensors import local_tensor


@torch.no_grad()
def match_grad_placements_(params: Iterable[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements, in place.

    Under TP without FSDP, autograd leaves some gradients in another layout than their
    parameter: sequence-parallel norm weights get Partial sums (each rank saw part of the
    sequence; the all-reduce is still owed), the vocabulary-parallel embedding a Replicate
    gradient of a Shard(0) weight. The optimizer, the clipping and the loss scaler expect the
    parameter's layout, so it is restored here (FSDP2 does the same for the gradients it reduces).
    """
    for p in params:
        g = p.grad
        if g is None or not hasattr(g, "placements") or not hasattr(p, "placements"):
            continue
        if tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(device_mesh=p.device_mesh, placements=p.placements)


def _shards(g: torch.Tensor) -> int:
    placements = getattr(g, "placements", None)
    if placements is None:
        return 1
    mesh = g.device_mesh  # type: ignore[attr-defined]
    # Not `is_shard()`: FSDP's _StridedShard (FSDP over TP shards) is a shard but says False.
    # Partial cannot remain after match_grad_placements_ (no parameter is Partial).
    return math.prod(mesh.size(i) for i, pl in enumerate(placements) if not pl.is_replicate())


@torch.no_grad()
def total_grad_norm(grads: list[torch.Tensor], dims: ParallelDims) -> torch.Tensor:
    """The L2 norm of all gradients of the model, identical on every rank."""
    if not grads:  # on the mesh's device: NCCL ranks must all reduce a CUDA tensor
        sq = torch.zeros((), device=dims.mesh.device_type if dims.mesh is not None else "cpu")
    else:
        locals_ = [local_tensor(g) for g in grads]
        norms = torch._foreach_norm(locals_)
        weights = torch.tensor(
            [_shards(g) / dims.stage_size for g in grads], device=locals_[0].device
        )
        sq = (torch.stack(norms).float() ** 2 * weights).sum()
    return dims.all_reduce_sum(sq).sqrt()


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter], max_norm: float, dims: ParallelDims
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most max_norm; returns the norm."""
    params = list(params)
    match_grad_placements_(params)
    grads = [p.grad for p in params if p.grad is not None]
    total = total_grad_norm(grads, dims)
    if grads and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([local_tensor(g) for g in grads], coef.to(grads[0].device))
    return total
