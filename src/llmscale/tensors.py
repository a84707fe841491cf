"""Tensor helpers every runtime layer shares: dtype names, DTensor shards, storage bytes.

The lowest runtime module: it imports torch and nothing else from llmscale. `parallel/`,
`offload/` and `train/` all read tensors through it, so none of them reaches into another for a
helper (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Precision names as the config spells them (`precision.mode`), to the dtype of their tensors
# (fp8 training keeps bf16 tensors and casts to float8 only inside the linears' matmuls).
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
    "nvfp4": torch.bfloat16,  # planned only: the runtime refuses it (check_runtime_support)
}


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a DTensor (a tensor with a device mesh and a local shard)."""
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds, for a DTensor; the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's part of each tensor, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        t = local_tensor(t)
        key = t.untyped_storage().data_ptr()
        if key in seen or t.device.type == "meta":
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total
