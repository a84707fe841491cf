"""The optimizer a job asks for: torch's AdamW on the device, or AdamW offloaded to the host."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmscale.config import JobConfig
from llmscale.offload.adamw import OffloadedAdamW
from llmscale.train import optim
from llmscale.train.metrics import optimizer_state_bytes
from llmscale.train.precision import DTYPES


def update_in_backward(cfg: JobConfig) -> bool:
    """Whether a unit may be updated during backward: nothing global (clip, overflow) to wait for."""
    return (
        cfg.optimizer.offload_overlap
        and cfg.train.max_grad_norm == 0
        and cfg.precision.mode != "fp16"
    )


def build_optimizer(
    model: nn.Module, cfg: JobConfig, link_bytes_per_s: float | None = None
) -> torch.optim.Optimizer:
    """`[optimizer] offload = "none"`: torch AdamW; `"optimizer"`: `OffloadedAdamW` attached.

    With offload the model's parameters become the working copy: cast to the precision mode's
    dtype (bf16/fp16 weights on the device, fp32 master on the host). `link_bytes_per_s` slows
    CPU-host copies to a link's bandwidth (benchmarks only).
    """
    o = cfg.optimizer
    if o.offload == "none":
        return optim.build_optimizer(model, o)
    opt = OffloadedAdamW(
        model.named_parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        working_dtype=DTYPES[cfg.precision.mode],
        overlap=o.offload_overlap,
        update_in_backward=update_in_backward(cfg),
        accum_steps=cfg.accum_steps,
        kernel=o.offload_kernel,
        link_bytes_per_s=link_bytes_per_s,
    )
    return opt.attach(model)


def optimizer_memory(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The metrics row's optimizer ledger: device- and host-resident bytes by role."""
    if isinstance(optimizer, OffloadedAdamW):
        return dict(optimizer.memory_report())
    b = optimizer_state_bytes(optimizer)
    return {
        "optimizer_bytes": b,
        "device_optimizer_bytes": b,
        "device_master_bytes": 0,  # the fp32 parameters are the master weights
        "host_optimizer_bytes": 0,
        "host_master_bytes": 0,
    }
