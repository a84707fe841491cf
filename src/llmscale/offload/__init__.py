"""CPU offload: AdamW with fp32 master weights and moments in host memory, layer-wise overlapped.

See docs/offload.md. `build_optimizer(model, cfg)` is what the trainer calls.
"""

from llmscale.offload.adamw import (
    OffloadedAdamW,
    fused_cpu_adamw_available,
    layer_units,
    unscale_and_clip,
)
from llmscale.offload.build import build_optimizer, optimizer_memory, update_in_backward
from llmscale.offload.timeline import Interval, Timeline, overlap_stats, read_timeline

__all__ = [
    "Interval",
    "OffloadedAdamW",
    "Timeline",
    "build_optimizer",
    "fused_cpu_adamw_available",
    "layer_units",
    "optimizer_memory",
    "overlap_stats",
    "read_timeline",
    "unscale_and_clip",
    "update_in_backward",
]
