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

Both optimizer paths use the one reduction here, `global_norm_and_overflow`: the on-device one
from the norms of the gradients it unscaled in place (`grad_norm_and_overflow_`), the host
offload one (`offload.adamw.unscale_and_clip`) from the norms its host worker took as the
gradients arrived. A step overflowed when some rank has a non-finite per-tensor norm (a norm is
finite exactly when every element is, short of its sum of squares passing fp32's range).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

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
        if p.grad is not None:
            p.grad = grad_like_param(p, p.grad)


def grad_like_param(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`g` in its parameter `p`'s placements (redistributed if they differ); else `g` itself."""
    if not hasattr(g, "placements") or not hasattr(p, "placements"):
        return g
    if tuple(g.placements) == tuple(p.placements):
        return g
    # (both are DTensors here: the hasattr checks above; Tensor's stubs lack these attributes)
    out: torch.Tensor = g.redistribute(device_mesh=p.device_mesh, placements=p.placements)  # type: ignore[attr-defined]
    return out


def shard_count(g: torch.Tensor) -> int:
    """Into how many pieces `g` (a gradient or its parameter) is split over the mesh; 1 if plain."""
    placements = getattr(g, "placements", None)
    if placements is None:
        return 1
    mesh = g.device_mesh  # type: ignore[attr-defined]
    # Not `is_shard()`: FSDP's _StridedShard (FSDP over TP shards) is a shard but says False.
    # Partial cannot remain after match_grad_placements_ (no parameter is Partial).
    return math.prod(mesh.size(i) for i, pl in enumerate(placements) if not pl.is_replicate())


class GradNorm(NamedTuple):
    """The job-wide gradient norm (identical on every rank) and whether any rank overflowed."""

    norm: torch.Tensor
    found_inf: bool


def _all_reduce(t: torch.Tensor, op: Any) -> torch.Tensor:
    """Over the whole job when a process group is up (on the backend's device); else `t`."""
    if not (dist.is_available() and dist.is_initialized()):
        return t
    backend = dist.get_backend()
    on = t
    if backend == "nccl" and torch.cuda.is_available():
        on = t.to(torch.device("cuda", torch.cuda.current_device()))
    elif backend == "gloo" and t.device.type != "cpu":
        on = t.cpu()
    dist.all_reduce(on, op=op)
    return on.to(t.device)


@torch.no_grad()
def global_norm_and_overflow(
    norms: Sequence[torch.Tensor],
    shards: Sequence[int],
    stage_size: int,
    check_overflow: bool = False,
    device: torch.device | str | None = None,
) -> GradNorm:
    """The global L2 norm from this rank's per-tensor local norms, and the overflow flag.

    `shards[i]` is the shard count of tensor i (`shard_count`), `stage_size` the ranks that hold
    a stage's parameters (dp x tp): each local norm's square is weighted by shards / stage_size
    and one all-reduce adds them over the job. With `check_overflow` (loss scaling) a second
    all-reduce (MAX) tells every rank whether any norm was inf/nan. `device`: where the sums live
    when this rank has no gradient (default: the norms' device, else the CPU).
    """
    if norms:
        dev = norms[0].device
        weights = torch.tensor([s / stage_size for s in shards], device=dev)
        sq = (torch.stack(list(norms)).float() ** 2 * weights).sum()
    else:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        sq = torch.zeros((), device=dev)
    found = False
    if check_overflow:
        flag = (
            torch.logical_not(torch.isfinite(torch.stack(list(norms)))).any().float()
            if norms
            else torch.zeros((), device=dev)
        )
        found = bool(_all_reduce(flag, dist.ReduceOp.MAX).item())
    return GradNorm(_all_reduce(sq, dist.ReduceOp.SUM).sqrt(), found)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """What clipping multiplies the gradients by (at most 1); None when nothing is clipped."""
    if not math.isfinite(max_norm):
        return None
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def grad_norm_and_overflow_(
    grads: list[torch.Tensor],
    dims: ParallelDims,
    scale: float | None = None,
) -> GradNorm:
    """On-device path: divide `grads` by the loss `scale` in place (None: no loss scaling), then
    their global norm and, with a scale, the job-wide overflow flag."""
    locals_ = [local_tensor(g) for g in grads]
    if scale is not None and locals_:
        torch._foreach_mul_(locals_, 1.0 / scale)
    norms = list(torch._foreach_norm(locals_)) if locals_ else []
    # On the mesh's device when this rank has no gradient: NCCL ranks must all reduce a CUDA tensor
    device = dims.mesh.device_type if dims.mesh is not None else "cpu"
    return global_norm_and_overflow(
        norms, [shard_count(g) for g in grads], dims.stage_size, scale is not None, device
    )


@torch.no_grad()
def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor | None) -> None:
    """Multiply `grads` (their local shards) by `coef` in place; nothing for None."""
    if grads and coef is not None:
        torch._foreach_mul_(
            [local_tensor(g) for g in grads], coef.to(local_tensor(grads[0]).device)
        )


@torch.no_grad()
def total_grad_norm(grads: list[torch.Tensor], dims: ParallelDims) -> torch.Tensor:
    """The L2 norm of all gradients of the model, identical on every rank."""
    return grad_norm_and_overflow_(grads, dims).norm


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter], max_norm: float, dims: ParallelDims
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most max_norm; returns the norm."""
    params = list(params)
    match_grad_placements_(params)
    grads = [p.grad for p in params if p.grad is not None]
    total = total_grad_norm(grads, dims)
    scale_grads_(grads, clip_coefficient(total, max_norm))
    return total
