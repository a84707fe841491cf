"""The host half of the offloaded optimizer: each parameter's host buffers and AdamW on them.

Plain tensors in, plain tensors out: no hooks, no threads, no timeline. `HostSlot` is one
parameter's record (fp32 master, moments, step counter, the fp32 gradient accumulated over
micro-steps, the download/upload buffer in the working dtype); `HostAdamW` makes slots and runs
the arithmetic on them: accumulation, per-tensor norms, the update (torch's fused CPU AdamW, or
its per-tensor one, bit for bit the on-device foreach AdamW), the cast for the upload, the
state-dict entries and the memory ledger. `offload.adamw.OffloadedAdamW` schedules these calls.

A slot with `lsp` (LSP-Offload, `offload.lsp`) holds its gradient and moments in the d x d
subspace of its projectors and no master: the device weight is the only copy, and the update
(-lr x Adam's direction, d x d) goes up to be decompressed and applied there.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw as functional_adamw

from llmscale.offload.lsp import LspSlot, Projectors
from llmscale.tensors import local_tensor, tensor_bytes

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "master")


@functools.cache
def fused_cpu_adamw_available() -> bool:
    """Whether this torch has a fused AdamW kernel for CPU tensors (2.4+ does)."""
    try:
        p, g = torch.zeros(2), torch.ones(2)
        m, v, s = torch.zeros(2), torch.zeros(2), torch.zeros(())
        functional_adamw(
            [p], [g], [m], [v], [], [s], fused=True, amsgrad=False, beta1=0.9, beta2=0.99,
            lr=1e-3, weight_decay=0.0, eps=1e-8, maximize=False,
        )  # fmt: skip
        return bool(torch.isfinite(p).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def host_empty(like: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)


@dataclass(eq=False)
class HostSlot:
    """One parameter's offload record."""

    index: int  # position among the optimizer's parameters (model order)
    name: str
    param: nn.Parameter  # the device parameter (a DTensor under FSDP2)
    unit: int
    group: int
    master: torch.Tensor  # host fp32
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # 0-d fp32 on the host, as torch's AdamW keeps it
    grad: torch.Tensor  # host fp32 gradient, accumulated over micro-steps
    staging: torch.Tensor | None  # host buffer in the working dtype (None: fp32, no accumulation)
    micro: int = 0  # backward passes accumulated this step (training thread only)
    pending: Future[Any] | None = None  # the host accumulation still reading `staging`
    norm: torch.Tensor | None = None  # of the accumulated host gradient (host worker)
    host_param: torch.Tensor | None = None  # offload_params: the host working copy (fp32: master)
    lsp: LspSlot | None = None  # LSP-Offload: projectors and the d x d update buffers

    @property
    def local(self) -> torch.Tensor:
        """This rank's device tensor: what is offloaded and written back."""
        return local_tensor(self.param).detach()

    def state(self) -> dict[str, torch.Tensor]:
        """The optimizer-state entry: the host buffers themselves (a load writes into them).

        An LSP slot has no master; it keeps its projectors (device) and last error instead.
        """
        if self.lsp is not None:
            return {
                "step": self.step,
                "exp_avg": self.exp_avg,
                "exp_avg_sq": self.exp_avg_sq,
                **self.lsp.state(),
            }
        return {
            "step": self.step,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "master": self.master,
        }


@dataclass(eq=False)
class HostAdamW:
    """AdamW over host slots: accumulation, norms, update, state, ledger."""

    working_dtype: torch.dtype
    n_microbatches: int
    pin: bool
    fused: bool
    offload_params: bool

    def make_slot(self, index: int, name: str, p: nn.Parameter, unit: int, group: int) -> HostSlot:
        """Host buffers for `p`, the master a full-precision copy of its current value."""
        local = local_tensor(p).detach()
        master = host_empty(local, torch.float32, self.pin)
        master.copy_(local)
        needs_staging = self.working_dtype != torch.float32 or self.n_microbatches > 1
        staging = self.working_dtype if needs_staging else None
        slot = self._slot(index, name, p, unit, group, local.shape, master, staging)
        if self.offload_params:
            # fp32: the master is what is uploaded; else a host copy in the working dtype (filled
            # from the cast parameter in `attach`). Gradients download into `staging`, so
            # backward's re-uploads never read a buffer a download is writing.
            fp32 = self.working_dtype == torch.float32
            slot.host_param = master if fp32 else host_empty(local, self.working_dtype, self.pin)
        return slot

    def make_lsp_slot(
        self, index: int, name: str, p: nn.Parameter, unit: int, group: int, proj: Projectors
    ) -> HostSlot:
        """Host buffers for an LSP matrix: d x d gradient, moments and update, no master."""
        d = proj.d
        # compressed gradients are fp32: the first micro-step lands in `grad` directly
        staging = torch.float32 if self.n_microbatches > 1 else None
        none = torch.empty(0, dtype=torch.float32)  # no master: the device weight is the copy
        slot = self._slot(index, name, p, unit, group, (d, d), none, staging)
        slot.lsp = LspSlot(
            proj=proj,
            update_device=torch.zeros((d, d), dtype=torch.float32, device=slot.local.device),
            update_host=host_empty(slot.grad, torch.float32, self.pin),
            error=torch.full((), float("nan"), dtype=torch.float32),
        )
        return slot

    def _slot(
        self,
        index: int,
        name: str,
        p: nn.Parameter,
        unit: int,
        group: int,
        shape: Sequence[int],
        master: torch.Tensor,
        staging: torch.dtype | None,
    ) -> HostSlot:
        """A slot whose moments and fp32 gradient have `shape`, with a `staging` buffer of that
        dtype (None: none)."""
        grad = torch.empty(tuple(shape), dtype=torch.float32, pin_memory=self.pin)
        return HostSlot(
            index=index,
            name=name,
            param=p,
            unit=unit,
            group=group,
            master=master,
            exp_avg=torch.zeros(grad.shape, dtype=torch.float32),
            exp_avg_sq=torch.zeros(grad.shape, dtype=torch.float32),
            step=torch.zeros((), dtype=torch.float32),
            grad=grad,
            staging=None if staging is None else host_empty(grad, staging, self.pin),
        )

    def download_buffer(self, slot: HostSlot, dtype: torch.dtype, first: bool) -> torch.Tensor:
        """Where this micro-step's gradient (in `dtype`) is copied down to.

        The first fp32 one lands in the fp32 gradient itself; others in `staging`, which is
        (re)made in the gradient's dtype when needed: more micro-steps than `n_microbatches` said,
        or gradients in another dtype than the weights (FSDP2's reduce_dtype).
        """
        if first and dtype == torch.float32:
            return slot.grad
        if slot.staging is None or slot.staging.dtype != dtype:
            slot.staging = host_empty(slot.grad, dtype, self.pin)
        return slot.staging

    @staticmethod
    def accumulate(slot: HostSlot, first: bool) -> None:
        """Add the downloaded micro-step gradient (in `staging`) into the fp32 gradient."""
        assert slot.staging is not None
        if first:
            slot.grad.copy_(slot.staging)
        else:
            slot.grad.add_(slot.staging)

    @staticmethod
    def norms(slots: Sequence[HostSlot]) -> None:
        """Each slot's accumulated-gradient 2-norm (the kernel of clip_grad_norm_(foreach=True))."""
        if slots:
            for s, n in zip(slots, torch._foreach_norm([s.grad for s in slots], 2), strict=True):
                s.norm = n

    def update(
        self, slots: Sequence[HostSlot], hyper: Sequence[dict[str, Any]], coef: torch.Tensor | None
    ) -> None:
        """One AdamW step of `slots` with the groups' hyper-parameters; gradients times `coef`."""
        for gi, hp in enumerate(hyper):
            group = [s for s in slots if s.group == gi]
            if not group:
                continue
            grads = [s.grad for s in group]
            if coef is not None:
                torch._foreach_mul_(grads, coef)
            self._update_lsp([s for s in group if s.lsp is not None], hp)
            group = [s for s in group if s.lsp is None]
            if not group:
                continue
            beta1, beta2 = hp["betas"]
            functional_adamw(
                [s.master for s in group],
                grads,
                [s.exp_avg for s in group],
                [s.exp_avg_sq for s in group],
                [],
                [s.step for s in group],
                foreach=False,  # exact: torch's per-tensor loop, bit-equal to foreach, faster on CPU
                fused=self.fused,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=hp["lr"],
                weight_decay=hp["weight_decay"],
                eps=hp["eps"],
                maximize=False,
            )

    def _update_lsp(self, group: Sequence[HostSlot], hp: dict[str, Any]) -> None:
        """Adam in the subspace: the update buffer, zeroed, takes one AdamW step without decay,
        so it holds -lr x m̂ / (√v̂ + eps) (torch's own kernel); the decay goes with it."""
        if not group:
            return
        updates = [s.lsp.update_host for s in group if s.lsp is not None]
        torch._foreach_zero_(updates)
        beta1, beta2 = hp["betas"]
        functional_adamw(
            updates,
            [s.grad for s in group],
            [s.exp_avg for s in group],
            [s.exp_avg_sq for s in group],
            [],
            [s.step for s in group],
            foreach=False,
            fused=self.fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=hp["lr"],
            weight_decay=0.0,
            eps=hp["eps"],
            maximize=False,
        )
        for s in group:
            assert s.lsp is not None
            s.lsp.decay = 1.0 - hp["lr"] * hp["weight_decay"]

    def upload_source(self, slot: HostSlot) -> torch.Tensor:
        """The master cast to the working dtype (into `staging`); in fp32 the master itself.
        An LSP slot's is its d x d update."""
        if slot.lsp is not None:
            return slot.lsp.update_host
        if self.working_dtype == torch.float32:
            return slot.master
        assert slot.staging is not None
        slot.staging.copy_(slot.master)
        return slot.staging

    @staticmethod
    def cast_host_params(slots: Iterable[HostSlot]) -> None:
        """offload_params: the updated masters into the host working copies."""
        for s in slots:
            if s.host_param is not None and s.host_param is not s.master:
                s.host_param.copy_(s.master)

    @staticmethod
    def load(slot: HostSlot, entry: dict[str, Any]) -> None:
        """Copy a saved state entry into the slot's buffers (bitwise; skip an alias of them)."""
        mine = slot.state()
        for k in mine:
            src = local_tensor(entry[k])
            dst = mine[k]
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)

    @staticmethod
    def memory_report(slots: Sequence[HostSlot], host_params: bool = False) -> dict[str, int]:
        """Bytes by role and place: the optimizer state and master weights are on the host.

        `host_optimizer_bytes` is the two moments and the 0-d fp32 step counters (as
        `train.metrics.optimizer_state_bytes` counts them), `host_master_bytes` the fp32 master
        weights: 12 bytes per offloaded parameter plus 4 per tensor, as the planner predicts.
        `host_grad_bytes`/`host_staging_bytes` are the host gradient and transfer buffers,
        `host_param_bytes` the host working copies of offload_params (none in fp32: the master
        is uploaded), reported with `host_params`.
        """

        def on_device(ts: Iterable[torch.Tensor]) -> int:
            return tensor_bytes(t for t in ts if t.device.type != "cpu")

        def on_host(ts: Iterable[torch.Tensor]) -> int:
            return tensor_bytes(t for t in ts if t.device.type == "cpu")

        moments = [t for s in slots for t in (s.exp_avg, s.exp_avg_sq, s.step)]
        masters = [s.master for s in slots]
        lsp = [s.lsp for s in slots if s.lsp is not None]
        row = {
            "device_optimizer_bytes": on_device(moments),
            "device_master_bytes": on_device(masters),
            "host_optimizer_bytes": on_host(moments),
            "host_master_bytes": on_host(masters),
            "host_grad_bytes": on_host(s.grad for s in slots),
            "host_staging_bytes": on_host(s.staging for s in slots if s.staging is not None)
            + on_host(x.update_host for x in lsp),
        }
        if lsp:
            # projectors (rows int32, values fp32) and the update's landing buffer
            row["device_lsp_bytes"] = sum(
                x.proj.nbytes + x.proj.bags_nbytes + x.update_device.nbytes for x in lsp
            )
        if host_params:
            row["host_param_bytes"] = on_host(
                s.host_param
                for s in slots
                if s.host_param is not None and s.host_param is not s.master
            )
        return row
