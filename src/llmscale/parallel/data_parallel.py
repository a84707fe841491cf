"""Data parallelism with FSDP2: ZeRO-3/ZeRO-2 over dp_shard, HSDP, plain DP as replicate.

Every transformer block is its own FSDP unit (one all-gather and one reduce-scatter per block),
then the model (or pipeline stage) root takes the rest: embeddings, final norm, output.

- dp_shard > 1: `fully_shard` over the dp_shard mesh; with dp_replicate > 1 as well, over the
  2-D (dp_replicate, dp_shard) mesh, i.e. HSDP: sharded within a group, all-reduced across groups.
  The ZeRO stages follow `llmscale.stack.residency` (its table): zero 3 reshards parameters after
  forward (all-gathered again for backward) and reduce-scatters after every micro-batch; zero 2
  keeps them gathered across the step's micro-batches and reduce-scatters after each into the
  sharded gradients; zero 1 keeps them gathered and accumulates unsharded gradients, reduced
  once on the last micro-batch (`apply_micro_batch_controls`, called by the trainer before each
  micro-batch). The forward policy holds for every unit, the root included (FSDP2's own default
  would keep the root unsharded), so memory is what the planner counts. Every unit's
  all-gathers and reduce-scatters go through counting comms (`CollectiveCounter`).
- dp_shard = 1, dp_replicate > 1: torch's FSDP2-based `replicate` (parameters as replicated
  DTensors, gradients all-reduced) - the same hooks and `set_requires_gradient_sync` as FSDP, and
  what torch.distributed.pipelining knows how to drive; works on gloo and NCCL.

Mixed precision is FSDP2's: parameters are kept (and the optimizer steps) in fp32, shards
all-gathered in `param_dtype` (bf16 for bf16, fp16 for fp16, else fp32) and gradients reduced in
fp32. Without data parallelism the trainer's autocast does this job instead.

`cpu_offload` (`optimizer.offload = "optimizer+params"` with dp > 1) hands every unit FSDP2's
`CPUOffloadPolicy`: the fp32 shards (the master weights) and their gradients live in host memory,
each all-gather copies its shards up and each reduce-scatter its gradients down, and the optimizer
steps on the host. The device holds only the unsharded parameters of the units in use.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from llmscale.stack.residency import Collectives, micro_batch_controls, reshard_after_forward
from llmscale.tensors import DTYPES
from llmscale.torch_internals import fsdp_default_comms

_DefaultAllGather, _DefaultReduceScatter = fsdp_default_comms()


class CollectiveCounter:
    """Counts the data-parallel collectives this rank issues, and their bytes.

    Installed as every FSDP unit's all-gather and reduce-scatter comm (FSDP2's
    `set_custom_all_gather` / `set_custom_reduce_scatter`, which still issue torch's default
    collectives) and, where gradients are all-reduced across replicas (HSDP, `replicate`), as
    every unit's all-reduce hook (`set_all_reduce_hook`: FSDP2 calls it after each all-reduce,
    with its output); a tied pipeline's embedding all-reduce counts itself
    (`tied_embeddings.TiedEmbeddings`, `all_reduced`). The trainer reads and clears it once per
    optimizer step. Bytes: an all-gather's output (the unit's padded flat buffer, compute
    dtype), a reduce-scatter's input (its padded unsharded gradients, reduce dtype) and an
    all-reduce's tensor: see `Collectives`.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.allgathers = self.reduces = self.allgather_bytes = self.reduce_bytes = 0
        self.allreduces = self.allreduce_bytes = 0

    def counts(self) -> Collectives:
        return Collectives(
            self.allgathers, self.reduces, self.allgather_bytes, self.reduce_bytes,
            self.allreduces, self.allreduce_bytes,
        )  # fmt: skip

    def install(self, module: FSDPModule) -> None:
        module.set_custom_all_gather(_CountingAllGather(self))
        module.set_custom_reduce_scatter(_CountingReduceScatter(self))

    def install_all_reduce(self, module: FSDPModule) -> None:
        """Count `module`'s all-reduces across replicas (HSDP or `replicate` units only: under
        plain FSDP2 the hook runs after the reduce-scatter, with no all-reduce)."""
        module.set_all_reduce_hook(self.all_reduced)

    def all_reduced(self, t: Any) -> None:
        """One gradient all-reduce of `t` (its bytes: the tensor's)."""
        self.allreduces += 1
        self.allreduce_bytes += t.numel() * t.element_size()


class _CountingAllGather(_DefaultAllGather):  # type: ignore[misc, valid-type]
    def __init__(self, counter: CollectiveCounter) -> None:
        super().__init__()
        self.counter = counter

    # torch's parameter names: FSDP2 passes them as keywords
    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
    ) -> Any:
        self.counter.allgathers += 1
        self.counter.allgather_bytes += output_tensor.numel() * output_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountingReduceScatter(_DefaultReduceScatter):  # type: ignore[misc, valid-type]
    def __init__(self, counter: CollectiveCounter) -> None:
        super().__init__()
        self.counter = counter

    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.counter.reduces += 1
        self.counter.reduce_bytes += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def mixed_precision_policy(mode: str) -> MixedPrecisionPolicy:
    """fp32 master weights; compute in the mode's dtype; gradients reduced in fp32.

    Forward inputs are not cast: the hidden states are already in the compute dtype (the
    embedding's weight is), and casting would round the fp32 RoPE table every block receives to
    bf16 (a copy per block, and angles that lose precision at long positions).
    """
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[mode], reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def apply_fsdp(
    model: nn.Module,
    dp_mesh: Any,
    *,
    shard: bool,
    zero_stage: int,
    precision: str,
    cpu_offload: bool = False,
    counter: CollectiveCounter | None = None,
) -> None:
    """Wrap each block, then the root, with fully_shard (shard=True) or replicate; `counter`
    counts every unit's collectives."""
    # The root returns the logits, under TP a view of the all-gathered output; FSDP2 warns that
    # an in-place op on it would skip its backward hook. The trainer only reads them.
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDPTransformer\) returned a view tensor"
    )
    mp = mixed_precision_policy(precision)
    # Pinned host memory makes the copies asynchronous on a CUDA host; a CPU mesh has none.
    pin = dp_mesh.device_type == "cuda"
    off: OffloadPolicy = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else OffloadPolicy()
    if shard:
        reshard = reshard_after_forward(zero_stage)
        hsdp = dp_mesh.ndim == 2  # (dp_replicate, dp_shard): all-reduced across replicas too

        def wrap(m: nn.Module) -> None:
            unit = fully_shard(
                m, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=off
            )
            if counter is not None:
                counter.install(unit)
                if hsdp:
                    counter.install_all_reduce(unit)
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        def wrap(m: nn.Module) -> None:
            unit = replicate(m, mesh=dp_mesh, mp_policy=mp, offload_policy=off)
            if counter is not None:
                counter.install_all_reduce(unit)

    for block in cast(nn.ModuleDict, model.layers).values():
        wrap(block)
    wrap(model)


def set_gradient_sync(parts: list[nn.Module], sync: bool) -> None:
    """Turn gradient reduction on (last micro-step) or off (earlier ones) for FSDP/replicate."""
    for part in parts:
        if isinstance(part, FSDPModule):
            part.set_requires_gradient_sync(sync)


def apply_micro_batch_controls(
    parts: list[nn.Module], zero_stage: int, shard: bool, last: bool, grads_once: bool = False
) -> bool:
    """Set FSDP2's gradient sync and reshard-after-backward for the next micro-batch (no
    pipeline) as the zero stage says (`stack.residency.micro_batch_controls`); returns the sync
    flag. Without sharding (`replicate`) zero 1's rule: one all-reduce per step. `grads_once`
    (optimizer offload: the host optimizer takes each gradient once per step) reduces on the
    last micro-batch only, whatever the stage."""
    c = micro_batch_controls(zero_stage if shard else 1, last)
    sync = c.requires_gradient_sync and (last or not grads_once)
    set_gradient_sync(parts, sync)
    for part in parts:
        if isinstance(part, FSDPModule):
            part.set_reshard_after_backward(c.reshard_after_backward)
    return sync


def reshard_all(parts: list[nn.Module]) -> None:
    """Free every unit's unsharded parameters (after an evaluation, whose forwards leave zero
    1 and 2 units gathered), so the next step gathers as `stack.residency` counts."""
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
