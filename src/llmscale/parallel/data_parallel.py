"""Data parallelism with FSDP2: ZeRO-3/ZeRO-2 over dp_shard, HSDP, plain DP as replicate.

Every transformer block is its own FSDP unit (one all-gather and one reduce-scatter per block),
then the model (or pipeline stage) root takes the rest: embeddings, final norm, output.

- dp_shard > 1: `fully_shard` over the dp_shard mesh; with dp_replicate > 1 as well, over the
  2-D (dp_replicate, dp_shard) mesh, i.e. HSDP: sharded within a group, all-reduced across groups.
  zero_stage 3 reshards parameters after forward (all-gathered again for backward); 1 and 2 keep
  them unsharded from forward to backward. The policy holds for every unit, the root included
  (FSDP2's own default would keep the root unsharded), so memory is what the planner counts. FSDP2 always reduce-scatters gradients and shards the
  optimizer state, so 1 and 2 are the same layout here (ZeRO-2).
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
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from llmscale.tensors import DTYPES


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
) -> None:
    """Wrap each block, then the root, with fully_shard (shard=True) or replicate."""
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
        reshard = zero_stage == 3

        def wrap(m: nn.Module) -> None:
            fully_shard(
                m, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=off
            )
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        def wrap(m: nn.Module) -> None:
            replicate(m, mesh=dp_mesh, mp_policy=mp, offload_policy=off)

    for block in model.layers.values():  # type: ignore[union-attr]
        wrap(block)
    wrap(model)


def set_gradient_sync(parts: list[nn.Module], sync: bool) -> None:
    """Turn gradient reduction on (last micro-step) or off (earlier ones) for FSDP/replicate."""
    for part in parts:
        if isinstance(part, FSDPModule):
            part.set_requires_gradient_sync(sync)
