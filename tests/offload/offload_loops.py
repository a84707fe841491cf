"""The tiny model, batches and training loops the offload tests share.

`train_reference` is the trainer's on-device path (torch AdamW after the trainer's global-norm
clip); `train_offloaded` the trainer's offload protocol (`unscale_and_clip`, then `step` unless
the loss scaler found an overflow).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmscale.config import OptimizerSection, PrecisionSection
from llmscale.model.config import get_preset
from llmscale.offload import unscale_and_clip
from llmscale.parallel.dims import ParallelDims
from llmscale.parallel.grads import clip_grad_norm_
from llmscale.train.optim import build_optimizer as torch_adamw
from llmscale.train.precision import DynamicLossScaler, autocast

CFG = get_preset("tiny").with_overrides(n_layers=3, max_seq_len=32)
HP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def batches(n: int, micro: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, CFG.vocab_size, (2, 17), generator=g) for _ in range(micro)]
        for _ in range(n)
    ]


def loss(model: torch.nn.Module, mb: torch.Tensor, mode: str = "fp32") -> torch.Tensor:
    with autocast(mode, "cpu"):
        logits = model(mb[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def train_reference(
    model: torch.nn.Module, batches: list[list[torch.Tensor]], max_norm: float
) -> list[float]:
    opt = torch_adamw(model, OptimizerSection(lr=HP["lr"], beta1=0.9, beta2=0.95))
    losses: list[float] = []
    for micro in batches:
        total = 0.0
        for mb in micro:
            value = loss(model, mb)
            (value / len(micro)).backward()
            total += value.item()
        clip_grad_norm_(list(model.parameters()), max_norm, ParallelDims())  # the trainer's
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / len(micro))
    return losses


def train_offloaded(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[list[torch.Tensor]],
    max_norm: float,
    scaler: DynamicLossScaler | None = None,
) -> tuple[list[float], list[float]]:
    scaler = scaler or DynamicLossScaler(PrecisionSection(), enabled=False)
    losses: list[float] = []
    norms: list[float] = []
    for micro in batches:
        total = 0.0
        for mb in micro:
            value = loss(model, mb)
            scaler.scale_loss(value / len(micro)).backward()
            total += value.item()
        found, norm = unscale_and_clip([opt], scaler, max_norm)
        norms.append(float(norm))
        if not found:
            opt.step()
        scaler.update(found)
        opt.zero_grad()
        losses.append(total / len(micro))
    opt.synchronize()  # type: ignore[attr-defined]
    return losses, norms
