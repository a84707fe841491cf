"""The optimizers a job runs: AdamW on the device or offloaded to the host, behind one container.

`param_groups` is the one weight-decay rule (matrices and embeddings decay; norms and biases do
not), for torch's AdamW and for `offload.OffloadedAdamW` alike. `build_optimizers` makes one
optimizer and one learning-rate scheduler per model part (pipeline stages hold several) and
returns them as an `Optimizers` container (as torchtitan's `OptimizersContainer`): the trainer
sees one object that unscales, measures and clips the gradients, steps, zeroes, reports its
memory and saves its state, whatever the optimizer. `OffloadedOptimizers` is the sibling for
`[optimizer] offload`, where the gradients and the update are on the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from llmscale.config import JobConfig, LRSchedulerSection, OptimizerSection
from llmscale.offload import OffloadedAdamW, grad_norm, is_fsdp_module, set_clip
from llmscale.offload.engine import fsdp_cpu_offload_bytes, issued_bytes, reset_meters
from llmscale.offload.lsp import LspSettings
from llmscale.parallel.dims import ParallelDims
from llmscale.parallel.grads import (
    GradNorm,
    clip_coefficient,
    grad_norm_and_overflow_,
    match_grad_placements_,
    scale_grads_,
)
from llmscale.tensors import DTYPES, is_dtensor, local_tensor
from llmscale.train.metrics import grad_bytes, optimizer_state_bytes, param_bytes


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Decay 2-D weights (matrices, embeddings); leave norms and biases undecayed."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups: list[dict[str, object]] = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _groups(modules: Iterable[nn.Module], weight_decay: float) -> list[dict[str, object]]:
    # foreach AdamW cannot take DTensors and plain tensors in one list; tensor parallelism leaves
    # some parameters plain (replicated: tied or learned-position embeddings, norms without SP),
    # so a group holding both is split in two (groups that are not mixed stay as they were).
    out: list[dict[str, object]] = []
    for m in modules:
        for g in param_groups(m, weight_decay):
            params: list[nn.Parameter] = g["params"]  # type: ignore[assignment]
            dist_ = [p for p in params if is_dtensor(p)]
            plain = [p for p in params if not is_dtensor(p)]
            out += [
                {**g, "params": ps} for ps in ((dist_, plain) if dist_ and plain else (params,))
            ]
    return [g for g in out if g["params"]]


def build_optimizer(
    model: nn.Module | Iterable[nn.Module], cfg: OptimizerSection
) -> torch.optim.AdamW:
    """torch's AdamW over one or more modules (pipeline stages hold several)."""
    modules = [model] if isinstance(model, nn.Module) else list(model)
    return torch.optim.AdamW(
        _groups(modules, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=True,
    )


def update_in_backward(cfg: JobConfig) -> bool:
    """Whether a unit may be updated during backward: nothing global (clip, overflow) to wait for."""
    return (
        cfg.optimizer.offload_overlap
        and cfg.train.max_grad_norm == 0
        and cfg.precision.mode != "fp16"
    )


def build_offloaded(model: nn.Module, cfg: JobConfig) -> OffloadedAdamW:
    """`OffloadedAdamW` over `model`'s parameters, attached to it.

    The model's parameters become the working copy: cast to the precision mode's dtype
    (bf16/fp16 weights on the device, fp32 master on the host). `"optimizer+params"` also
    keeps them on the host between uses (offload/params.py).
    """
    o = cfg.optimizer
    # FSDP2 and replicate reduce gradients on the last micro-step only (the trainer turns the
    # sync off before), and only then run the parameters' gradient hooks: once per step.
    reduced_once = any(is_fsdp_module(m) for m in model.modules())
    params = o.offload == "optimizer+params"
    # A tied embedding is read by the head too (the model's forward reads the weight directly).
    tied = params and cfg.model.tie_embeddings
    opt = OffloadedAdamW(
        model.named_parameters(),
        groups=param_groups(model, o.weight_decay),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        working_dtype=DTYPES[cfg.precision.mode],
        overlap=o.offload_overlap,
        update_in_backward=update_in_backward(cfg),
        n_microbatches=1 if reduced_once else cfg.n_microbatches,
        kernel=o.offload_kernel,
        offload_params=params,
        keep_resident=("tok_embeddings.weight",) if tied else (),
        lsp=lsp_settings(cfg),
    )
    return opt.attach(model)


def lsp_settings(cfg: JobConfig) -> LspSettings | None:
    """`offload = "lsp"`'s settings; the projectors' seed is the job's."""
    o = cfg.optimizer
    if o.offload != "lsp":
        return None
    return LspSettings(
        o.lsp_dim, o.lsp_nonzeros, o.lsp_refit_threshold, o.lsp_check_every, cfg.job.seed
    )


def build_optimizers(
    model_parts: Sequence[nn.Module], cfg: JobConfig, dims: ParallelDims | None = None
) -> Optimizers:
    """One optimizer and one LR scheduler per model part, in the container the job needs.

    `[optimizer] offload = "none"`, or FSDP2's CPU offload (`JobConfig.fsdp_cpu_offload`: its
    host shards are where torch's AdamW updates them): torch's AdamW. Otherwise `OffloadedAdamW`.
    """
    dims = dims or ParallelDims()
    if cfg.optimizer.offload == "none" or cfg.fsdp_cpu_offload:
        opts: list[torch.optim.Optimizer] = [
            build_optimizer(part, cfg.optimizer) for part in model_parts
        ]
        return Optimizers(model_parts, opts, cfg, dims, on_host=cfg.fsdp_cpu_offload)
    offloaded = [build_offloaded(part, cfg) for part in model_parts]
    return OffloadedOptimizers(model_parts, offloaded, cfg, dims)


def optimizer_memory(
    optimizers: Sequence[torch.optim.Optimizer], on_host: bool = False
) -> dict[str, Any]:
    """The metrics row's optimizer ledger over torch optimizers (one per model part).

    `optimizer_bytes` is the Adam moments and step counters wherever they live (as the planner
    predicts it); the `device_*`/`host_*` keys say where. `on_host`: optimizers whose parameters
    FSDP2 keeps on the host (`JobConfig.fsdp_cpu_offload`).
    """
    row: dict[str, Any] = dict.fromkeys(_LEDGER, 0)
    where = "host_optimizer_bytes" if on_host else "device_optimizer_bytes"
    row[where] = sum(optimizer_state_bytes(opt) for opt in optimizers)
    row["optimizer_bytes"] = row["device_optimizer_bytes"] + row["host_optimizer_bytes"]
    return row


_LEDGER = ("device_optimizer_bytes", "device_master_bytes", "host_optimizer_bytes",
           "host_master_bytes")  # fmt: skip
# Optimizer state keyed by parameter name (not by position in a param group), so that it is the
# union of the pipeline stages' states and loads into any other split.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers:
    """One optimizer and one LR scheduler per model part, used as one.

    The training loop's protocol, once per optimizer step after backward: `grad_norm(scale)`
    (unscale, global norm, overflow flag), `clip_(norm, max_norm)`, `grad_memory()` while the
    gradients exist, `step()` unless the step overflowed (a skipped step does not advance the
    schedule either, as Megatron), `zero_grad()`, then `memory()`. Here the optimizers are
    torch's AdamW on the parameters' device (FSDP2's host shards with `on_host`).
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        cfg: JobConfig,
        dims: ParallelDims,
        on_host: bool = False,
    ) -> None:
        self.model_parts = list(model_parts)
        self.parts = list(optimizers)
        self.schedulers = [
            build_scheduler(opt, cfg.train.steps, cfg.lr_scheduler) for opt in self.parts
        ]
        self.dims = dims
        self.on_host = on_host
        # FSDP2's CPU offload: what its copies per step depend on (`offload_bytes_moved`).
        self._n_microbatches = cfg.n_microbatches
        self._reshard = dims.dp_shard > 1 and cfg.parallel.zero_stage == 3
        # Parameters the gradient norm leaves out: a tied embedding's copy on the last pipeline
        # stage, whose gradient equals the embedding's (parallel/tied_embeddings.py).
        self._not_in_norm: set[int] = set()

    def __len__(self) -> int:
        return len(self.parts)

    def __iter__(self) -> Any:
        return iter(self.parts)

    def __getitem__(self, i: int) -> torch.optim.Optimizer:
        return self.parts[i]

    @property
    def lr(self) -> float:
        return float(self.parts[0].param_groups[0]["lr"])

    def _grads(self) -> list[torch.Tensor]:
        params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
        match_grad_placements_(params)
        return [p.grad for p in params if p.grad is not None]

    def leave_out_of_norm(self, params: Iterable[nn.Parameter]) -> None:
        """Unscale and clip `params`' gradients like the others', but leave them out of the
        gradient norm (copies of a tied weight: one process counts it once)."""
        self._not_in_norm = {id(p) for p in params}

    def grad_norm(self, scale: float | None) -> GradNorm:
        """Divide the gradients by the loss `scale` (None: none) in place; their global norm and
        whether any rank overflowed (both reduced over the job)."""
        grads = self._grads()
        if not self._not_in_norm:
            return grad_norm_and_overflow_(grads, self.dims, scale)
        params = [p for part in self.model_parts for p in part.parameters()]
        left_out = {id(p.grad) for p in params if id(p) in self._not_in_norm}
        copies = [g for g in grads if id(g) in left_out]
        if scale is not None and copies:  # the same op as on the counted gradients
            torch._foreach_mul_([local_tensor(g) for g in copies], 1.0 / scale)
        counted = [g for g in grads if id(g) not in left_out]
        return grad_norm_and_overflow_(counted, self.dims, scale)

    def clip_(self, norm: torch.Tensor, max_norm: float) -> None:
        """Scale the (unscaled) gradients so that their global `norm` is at most `max_norm`."""
        scale_grads_(self._grads(), clip_coefficient(norm, max_norm))

    def step(self) -> None:
        for opt, sched in zip(self.parts, self.schedulers, strict=True):
            opt.step()
            sched.step()

    def zero_grad(self) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=True)

    def grad_memory(self) -> dict[str, int]:
        """This rank's gradient bytes (on the host: the fp32 shards FSDP2 copied there)."""
        n = grad_bytes(self.model_parts)
        return {"grad_bytes": 0, "host_grad_bytes": n} if self.on_host else {"grad_bytes": n}

    def begin_step_traffic(self) -> None:
        """A step begins: `offload_bytes_moved` counts from here (nothing to do here)."""

    def offload_bytes_moved(self) -> int:
        """Bytes copied between device and host this step: none without offload; under FSDP2's
        CPU offload computed from what FSDP2 copies (`offload.engine.fsdp_cpu_offload_bytes`)."""
        if not self.on_host:
            return 0
        return fsdp_cpu_offload_bytes(self.model_parts, self._n_microbatches, self._reshard)

    def memory(self) -> dict[str, Any]:
        """The metrics row's parameter and optimizer ledger, in its final keys.

        Under FSDP2's CPU offload the fp32 shards on the host are the master weights.
        """
        row = optimizer_memory(self.parts, on_host=self.on_host)
        n = param_bytes(self.model_parts)
        if self.on_host:
            row["host_master_bytes"], row["param_bytes"] = n, 0
        else:
            row["param_bytes"] = n
        return row

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The union of the parts' optimizer states, keyed by parameter name (DCP-savable)."""
        sd: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.parts, strict=True):
            sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, opt in zip(self.model_parts, self.parts, strict=True):
            set_optimizer_state_dict(part, opt, state, options=_FLAT)  # its own names

    def scheduler_state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()  # they step together: one is all of them

    def load_scheduler_state_dict(self, state: dict[str, Any]) -> None:
        for sched in self.schedulers:
            sched.load_state_dict(state)

    def write_timelines(self, folder: Path, rank: int) -> list[Path]:
        """Offload pipeline timelines (none here)."""
        return []

    def close(self) -> None:
        """Let go of the optimizers, schedulers and model parts (`Trainer.close`)."""
        self.parts.clear()
        self.schedulers.clear()
        self.model_parts.clear()


class OffloadedOptimizers(Optimizers):
    """`OffloadedAdamW` per model part: gradients, norms and update on the host.

    `grad_norm` reduces the per-tensor norms the host worker took, unscaled; `clip_` folds
    1/scale and the clip coefficient into one factor the host update applies.
    """

    parts: list[OffloadedAdamW]  # type: ignore[assignment]

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizers: Sequence[OffloadedAdamW],
        cfg: JobConfig,
        dims: ParallelDims,
    ) -> None:
        super().__init__(model_parts, optimizers, cfg, dims)
        self._scale: float | None = None

    def grad_norm(self, scale: float | None) -> GradNorm:
        self._scale = scale
        return grad_norm(self.parts, scale, self.dims.stage_size)

    def clip_(self, norm: torch.Tensor, max_norm: float) -> None:
        set_clip(self.parts, norm, max_norm, self._scale)

    def begin_step_traffic(self) -> None:
        """Forget copies counted since the last step (a checkpoint load, an evaluation)."""
        for opt in self.parts:
            reset_meters((opt.d2h, opt.h2d))

    def offload_bytes_moved(self) -> int:
        """Bytes the copiers were asked to copy since `begin_step_traffic`, both directions,
        once the host worker has issued the step's uploads (it waits for the updates, not for
        the copies)."""
        return sum(issued_bytes((opt.d2h, opt.h2d), opt.worker) for opt in self.parts)

    def memory(self) -> dict[str, Any]:
        row: dict[str, Any] = dict.fromkeys(_LEDGER, 0)
        for opt in self.parts:
            for k, v in opt.memory_report().items():
                # Model chunks run one at a time: a peak is the largest chunk's, not a sum.
                # (one process under lsp: its error is the part's own)
                peak = k.endswith(("_peak_bytes", "_error"))
                row[k] = max(row.get(k, 0), v) if peak else row.get(k, 0) + v
        row["optimizer_bytes"] = row["device_optimizer_bytes"] + row["host_optimizer_bytes"]
        row["param_bytes"] = param_bytes(self.model_parts)
        return row

    def write_timelines(self, folder: Path, rank: int) -> list[Path]:
        """folder/timeline-rank{r}.json (-chunk{i} per further model chunk): `plot --timeline`.

        Waits for the last uploads, too.
        """
        out = []
        for i, opt in enumerate(self.parts):
            chunk = f"-chunk{i}" if i else ""
            out.append(opt.write_timeline(folder / f"timeline-rank{rank}{chunk}.json"))
        return out

    def close(self) -> None:
        """Stop each optimizer's transfer threads and remove its hooks, then let go of it."""
        for opt in self.parts:
            opt.close()
        super().close()


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
