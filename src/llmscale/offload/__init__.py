"""CPU offload: AdamW with fp32 master weights and moments in host memory, layer-wise overlapped.

See docs/offload.md. The trainer builds it through `train.optim.build_optimizers`.

- `adamw`: `OffloadedAdamW`, the coordinator of the pipeline, and the step protocol's
  reductions (`grad_norm`, `set_clip`, `unscale_and_clip`);
- `host_adam`: the host buffers and AdamW arithmetic on them;
- `hooks`: units, wait points and the hooks on the model;
- `params`: the parameters' own offload (`"optimizer+params"`);
- `engine`: copiers and the host worker; `timeline`: what ran when;
- every torch-private call the above need is in `llmscale.torch_internals`.
"""

from llmscale.offload.adamw import (
    LossScale,
    OffloadedAdamW,
    grad_norm,
    set_clip,
    unscale_and_clip,
)
from llmscale.offload.hooks import is_fsdp_module, layer_units
from llmscale.offload.host_adam import fused_cpu_adamw_available
from llmscale.offload.timeline import Interval, TransferTimeline, overlap_stats, read_timeline

__all__ = [
    "Interval",
    "LossScale",
    "OffloadedAdamW",
    "TransferTimeline",
    "fused_cpu_adamw_available",
    "grad_norm",
    "is_fsdp_module",
    "layer_units",
    "overlap_stats",
    "read_timeline",
    "set_clip",
    "unscale_and_clip",
]
