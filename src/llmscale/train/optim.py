"""AdamW with decoupled weight decay on matrices only, and a warm-up + decay schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from llmscale.config import LRSchedulerSection, OptimizerSection


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Decay 2-D weights (matrices, embeddings); leave norms and biases undecayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups: list[dict[str, object]] = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: nn.Module | Iterable[nn.Module], cfg: OptimizerSection
) -> torch.optim.AdamW:
    """torch's AdamW over one or more modules (pipeline stages hold several)."""
    modules = [model] if isinstance(model, nn.Module) else list(model)
    groups: list[dict[str, object]] = []
    for m in modules:
        for g in param_groups(m, cfg.weight_decay):
            if g["params"]:
                groups.append(g)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=True,
    )


def lr_multiplier(step: int, total_steps: int, cfg: LRSchedulerSection) -> float:
    """Factor on the base lr for optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, cfg: LRSchedulerSection
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, cfg)
    )
