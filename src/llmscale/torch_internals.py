"""Every torch-private interface llmscale relies on, in one place (below every runtime layer).

Checked against torch 2.13.0. Each is a small function, so a torch upgrade that moves one
breaks here, with a name saying what it was for, not inside the pipeline's logic.

- `torch._C._current_graph_task_id()`: the id of the autograd graph task running on this
  thread, -1 outside backward. Tells a forward pre-hook that it runs inside backward (a
  recomputed, checkpointed forward), and tells `ParamOffload` which backward pass it is in.
- `torch.autograd.Variable._execution_engine.queue_callback(fn)`: run `fn` when the current
  backward pass ends (how `ParamOffload` releases what a pass left fetched). FSDP1 and FSDP2 use
  it the same way.
- FSDP2's `module._get_fsdp_state()._comm_ctx.all_gather_copy_in_stream / all_gather_stream`:
  the CUDA streams on which FSDP2 reads a module's shards for its all-gather (an upload must be
  waited for on them too).
- FSDP2's `_fsdp_collectives.DefaultAllGather` / `DefaultReduceScatter`: the comms every unit
  issues its all-gathers and reduce-scatters through, subclassed to count them (the hook that
  installs a subclass, `set_custom_all_gather` / `set_custom_reduce_scatter`, is public).
- `DTensor(local, DTensorSpec(...), requires_grad=False)` with `param._spec` and
  `torch.distributed.tensor._dtensor_spec`: wrap a host shard as a DTensor sharded like its
  parameter without moving it (`DTensor.from_local` would copy a CPU shard onto the mesh's device).
- `tensor._version`: the tensor's version counter, bumped by every in-place write (a checkpoint
  load's `copy_` included): tells a cache built from a tensor's values that they changed.
- `torch.utils._python_dispatch.is_traceable_wrapper_subclass(t)`: a tensor subclass that wraps
  inner tensors (DTensor, a functional wrapper), whose storage is its inner tensors' (the
  saved-activation meters count those).
- `create_selective_checkpoint_contexts(...)`'s caching context's `.storage` (op -> {call
  index: tree of `_VersionWrapper` with `.val`, or a recompute marker}): the outputs op-level
  selective checkpointing stored (what `selective_op` keeps, counted by the meters; autograd's
  saved-tensor hooks do not see them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def graph_task_id() -> int:
    """The running autograd graph task's id on this thread; -1 outside backward."""
    return int(torch._C._current_graph_task_id())


def in_backward() -> bool:
    """Whether this thread is inside a backward pass (e.g. a recomputed forward)."""
    return graph_task_id() != -1


def tensor_version(t: torch.Tensor) -> int:
    """`t`'s version counter: it changes whenever `t` (or a view of it) is written in place."""
    return int(t._version)


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the backward pass running now has finished."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def fsdp_gather_streams(module: torch.nn.Module) -> list[Any]:
    """The CUDA streams on which FSDP2 reads `module`'s shards for its all-gather.

    FSDP2 copies the shards in and all-gathers them on streams of its own, which wait for the
    compute stream once, in the root's pre-forward; a block's upload waited for on the compute
    stream alone would not order its all-gather after the upload. So those streams wait for the
    upload's event too. None off CUDA, or for a module that is not fully_shard-ed.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    ctx = getattr(get_state(), "_comm_ctx", None)
    streams = [getattr(ctx, a, None) for a in ("all_gather_copy_in_stream", "all_gather_stream")]
    return [st for st in streams if isinstance(st, torch.cuda.Stream)]


def fsdp_default_comms() -> tuple[type, type]:
    """FSDP2's default all-gather and reduce-scatter comm classes (constructed without
    arguments; called as `(output, input, group, async_op)` and `(output, input, group, op,
    async_op)`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    return DefaultAllGather, DefaultReduceScatter


def dtensor_like(param: Any, host: torch.Tensor) -> Any:
    """`host` (this rank's shard, in host memory) as a DTensor sharded like `param`.

    Built from the spec directly: `DTensor.from_local` would move a CPU shard onto the mesh's
    device.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = param._spec
    meta = TensorMeta(shape=param.shape, stride=param.stride(), dtype=host.dtype)
    new_spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return DTensor(host, new_spec, requires_grad=False)  # type: ignore[no-untyped-call]  # torch: DTensor.__new__ unannotated


def is_wrapper_subclass(t: torch.Tensor) -> bool:
    """Whether `t` is a traceable wrapper subclass (e.g. a DTensor) around inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return bool(is_traceable_wrapper_subclass(t))


def sac_stored_tensors(caching: Any) -> list[torch.Tensor]:
    """The tensors a selective-checkpoint caching context stored during its forward."""
    from torch.utils._pytree import tree_leaves

    stored = [
        getattr(leaf, "val", None)
        for calls in caching.storage.values()
        for entry in calls.values()
        for leaf in tree_leaves(entry)
    ]
    return [t for t in stored if isinstance(t, torch.Tensor)]
