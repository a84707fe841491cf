"""Mixed precision: autocast over fp32 master weights, dynamic loss scaling, underflow report.

Why a scaler of our own rather than `torch.amp.GradScaler`: GradScaler's growth/backoff rule is
what we want (and `DynamicLossScaler` reproduces its scale trajectory exactly; see the tests),
but it has no bounds (we keep the scale in [min_scale, max_scale], 2^3..2^15 by default, as
DeepSpeed and Megatron do), it does not report a skipped step through a public API, and its
inf/nan check covers only the local gradients: under pipeline or tensor parallelism every rank
must agree to skip, so the overflow flag is all-reduced over the whole job here.

The scaler is only the state machine (scale, growth, backoff, state dict). Unscaling, the
overflow check and the gradient norm are one reduction shared by the on-device and the offload
path (`parallel.grads.global_norm_and_overflow`): they get the scale (`loss_scale`) and give
back the overflow flag, which `update` takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmscale.config import PrecisionSection
from llmscale.parallel.dims import ParallelDims
from llmscale.parallel.grads import grad_norm_and_overflow_
from llmscale.tensors import DTYPES, local_tensor

FP16_MIN_SUBNORMAL = 2.0**-24


def autocast(mode: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast to bf16/fp16 for `mode`; a no-op context for fp32."""
    if mode == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[mode])


class DynamicLossScaler:
    """Loss scale that grows after `growth_interval` clean steps and backs off on inf/nan.

    With enabled=False (fp32, bf16) it is the identity and never skips.
    """

    def __init__(self, cfg: PrecisionSection, enabled: bool) -> None:
        self.enabled = enabled
        self.initial_scale = float(cfg.initial_scale)
        self.scale = self.initial_scale if enabled else 1.0
        self.growth_factor = cfg.growth_factor
        self.backoff_factor = cfg.backoff_factor
        self.growth_interval = cfg.growth_interval
        self.min_scale = cfg.min_scale
        self.max_scale = cfg.max_scale
        self.growth_tracker = 0  # clean steps since the last change
        self.skipped_steps = 0

    @property
    def loss_scale(self) -> float | None:
        """What the loss was multiplied by; None when loss scaling is off."""
        return self.scale if self.enabled else None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(
        self, grads: Iterable[torch.Tensor], dims: ParallelDims | None = None
    ) -> bool:
        """Divide grads by the scale in place; True when any rank saw inf/nan (skip the step).

        The shared reduction (`parallel.grads.grad_norm_and_overflow_`) without using its norm.
        """
        if not self.enabled:
            return False
        return grad_norm_and_overflow_(list(grads), dims or ParallelDims(), self.scale).found_inf

    def update(self, found_inf: bool) -> None:
        """GradScaler's rule, then clamped to [min_scale, max_scale]."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
        self.scale = min(max(self.scale, self.min_scale), self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state["skipped_steps"])

    def restart(self) -> None:
        """Back to `initial_scale`, as at a run's start (a resume from a run without scaling)."""
        self.scale = self.initial_scale if self.enabled else 1.0
        self.growth_tracker = 0


# ---- underflow report ---------------------------------------------------------------------

DEFAULT_SCALES: tuple[float, ...] = tuple(2.0**k for k in range(0, 16))


@dataclass
class UnderflowRow:
    scale: float
    nonzero: int  # gradient elements that are non-zero in fp32
    underflow: int  # ... of those, how many become zero when (g * scale) is cast to fp16
    overflow: int  # ... and how many become inf

    @property
    def underflow_fraction(self) -> float:
        return self.underflow / self.nonzero if self.nonzero else 0.0

    @property
    def overflow_fraction(self) -> float:
        return self.overflow / self.nonzero if self.nonzero else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "nonzero": self.nonzero,
            "underflow": self.underflow,
            "overflow": self.overflow,
            "underflow_fraction": self.underflow_fraction,
            "overflow_fraction": self.overflow_fraction,
        }


@torch.no_grad()
def underflow_report(
    grads: Iterable[torch.Tensor], scales: Iterable[float] = DEFAULT_SCALES
) -> list[UnderflowRow]:
    """For each loss scale: how many fp32 gradient values vanish (or overflow) in fp16.

    `grads` are true (unscaled) fp32 gradients. A value g survives as fp16 when |g * scale| is
    at least half the smallest fp16 subnormal, 2^-25 (round to nearest), so a larger scale
    rescues small values until the large ones overflow past 65504. Counts are summed over all
    ranks when a process group is up, over each rank's own shard.
    """
    flat = [local_tensor(g).detach().float().reshape(-1) for g in grads]
    scales = list(scales)
    counts = torch.zeros(len(scales), 3, dtype=torch.float64)
    for g in flat:
        nz = g != 0
        gz = g[nz]
        for i, s in enumerate(scales):
            h = (gz * s).to(torch.float16)
            counts[i, 0] += gz.numel()
            counts[i, 1] += (h == 0).sum().item()
            counts[i, 2] += torch.isinf(h).sum().item()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    return [
        UnderflowRow(s, int(counts[i, 0]), int(counts[i, 1]), int(counts[i, 2]))
        for i, s in enumerate(scales)
    ]


def gradients(params: Iterable[torch.nn.Parameter]) -> Iterator[torch.Tensor]:
    for p in params:
        if p.grad is not None:
            yield p.grad


def fp16_backward_underflow(
    loss_fn: Callable[[], torch.Tensor],
    params: list[torch.nn.Parameter],
    scales: Iterable[float] = DEFAULT_SCALES,
    device_type: str = "cpu",
) -> list[UnderflowRow]:
    """Underflow measured end to end: backward under fp16 autocast with each loss scale.

    `underflow_report` casts finished fp32 gradients; here the whole backward runs in fp16, so
    activation gradients can vanish inside it too. A parameter-gradient element counts as
    underflowed when it is non-zero in the fp32 reference backward but exactly zero after the
    fp16 backward (divided by the scale); as overflowed when it is not finite. `loss_fn` runs
    the forward and returns the loss; it is called under fp16 autocast for the measured passes.
    """
    for p in params:
        p.grad = None
    loss_fn().backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward unannotated
    reference = [p.grad.detach().clone() if p.grad is not None else None for p in params]
    rows = []
    for s in scales:
        for p in params:
            p.grad = None
        with autocast("fp16", device_type):
            loss = loss_fn()
        (loss.float() * s).backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward unannotated
        nonzero = underflow = overflow = 0
        for p, ref in zip(params, reference, strict=True):
            if ref is None:
                continue
            nz = ref != 0
            g = p.grad / s if p.grad is not None else torch.zeros_like(ref)
            nonzero += int(nz.sum())
            underflow += int((nz & (g == 0)).sum())
            overflow += int((nz & ~torch.isfinite(g)).sum())
        rows.append(UnderflowRow(s, nonzero, underflow, overflow))
    for p in params:
        p.grad = None
    return rows
