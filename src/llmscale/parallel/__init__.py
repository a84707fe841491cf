"""Parallel runtime: data (FSDP2 / HSDP / replicate), tensor + sequence, and pipeline parallelism
composed on one named DeviceMesh. See docs/parallel.md."""

from __future__ import annotations

from llmscale.parallel.dims import ParallelDims, env_world_size, init_distributed
from llmscale.parallel.grads import clip_grad_norm_, total_grad_norm
from llmscale.parallel.parallelize import ParallelModel, parallelize
from llmscale.parallel.state import full_parameters

__all__ = [
    "ParallelDims",
    "ParallelModel",
    "clip_grad_norm_",
    "env_world_size",
    "full_parameters",
    "init_distributed",
    "parallelize",
    "total_grad_norm",
]
