"""The optimizer a job asks for: torch's AdamW on the device, or AdamW offloaded to the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmscale.config import JobConfig
from llmscale.offload.adamw import OffloadedAdamW, _is_fsdp_module
from llmscale.tensors import DTYPES
from llmscale.train import optim
from llmscale.train.metrics import optimizer_state_bytes


def update_in_backward(cfg: JobConfig) -> bool:
    """Whether a unit may be updated during backward: nothing global (clip, overflow) to wait for."""
    return (
        cfg.optimizer.offload_overlap
        and cfg.train.max_grad_norm == 0
        and cfg.precision.mode != "fp16"
    )


def build_optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """`[optimizer] offload = "none"`: torch AdamW; otherwise `OffloadedAdamW`, attached.

    With offload the model's parameters become the working copy: cast to the precision mode's
    dtype (bf16/fp16 weights on the device, fp32 master on the host). `"optimizer+params"` also
    keeps them on the host between uses (offload/params.py); under data parallelism that is
    FSDP2's CPUOffloadPolicy, whose host shards torch's AdamW updates where they are.
    """
    o = cfg.optimizer
    if o.offload == "none" or cfg.fsdp_cpu_offload:
        return optim.build_optimizer(model, o)
    # FSDP2 and replicate reduce gradients on the last micro-step only (the trainer turns the
    # sync off before), and only then run the parameters' gradient hooks: once per step.
    reduced_once = any(_is_fsdp_module(m) for m in model.modules())
    params = o.offload == "optimizer+params"
    # A tied embedding is read by the head too (the model's forward reads the weight directly).
    tied = params and cfg.model.tie_embeddings
    opt = OffloadedAdamW(
        model.named_parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        working_dtype=DTYPES[cfg.precision.mode],
        overlap=o.offload_overlap,
        update_in_backward=update_in_backward(cfg),
        accum_steps=1 if reduced_once else cfg.accum_steps,
        kernel=o.offload_kernel,
        offload_params=params,
        keep_resident=("tok_embeddings.weight",) if tied else (),
    )
    return opt.attach(model)


def optimizer_memory(
    optimizers: Sequence[torch.optim.Optimizer], on_host: bool = False
) -> dict[str, Any]:
    """The metrics row's optimizer ledger over this rank's optimizers (one per model part).

    `optimizer_bytes` is the Adam moments and step counters wherever they live (as before,
    and as the planner predicts it); the `device_*`/`host_*` keys say where. `on_host`: torch
    optimizers whose parameters FSDP2 keeps on the host (`JobConfig.fsdp_cpu_offload`).
    """
    keys = ("device_optimizer_bytes", "device_master_bytes", "host_optimizer_bytes")
    row: dict[str, Any] = dict.fromkeys((*keys, "host_master_bytes"), 0)
    for opt in optimizers:
        if isinstance(opt, OffloadedAdamW):
            for k, v in opt.memory_report().items():
                # Model chunks run one at a time: a peak is the largest chunk's, not a sum.
                row[k] = max(row.get(k, 0), v) if k.endswith("_peak_bytes") else row.get(k, 0) + v
        else:
            where = "host_optimizer_bytes" if on_host else "device_optimizer_bytes"
            row[where] += optimizer_state_bytes(opt)
    row["optimizer_bytes"] = row["device_optimizer_bytes"] + row["host_optimizer_bytes"]
    return row
