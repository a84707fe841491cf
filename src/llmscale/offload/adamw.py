"""OffloadedAdamW: AdamW whose fp32 master weights and moments live in host memory.

ZeRO-Offload (Ren et al. 2021) keeps the optimizer state and the fp32 master weights on the CPU,
streams gradients down and updated weights up; LSP-Offload and ZeRO-Offload both pipeline those
transfers layer by layer. Here the pipeline works on *units* (each transformer block, plus the
parameters before the first block and after the last one), in this order:

1. backward: as each parameter's gradient is accumulated (a post-accumulate-grad hook), it is
   copied to the host (device-to-host copier) and the device gradient is released; the host
   worker adds it into an fp32 host buffer (gradient accumulation happens there, in fp32, every
   micro-step). When a unit has all its gradients of the step, the worker takes their norms.
2. step: the global gradient norm (for clipping) and the fp16 overflow flag (a non-finite norm)
   need *every* unit's gradients, so the update cannot start before the last gradient is in.
   It then runs unit by unit in forward order on the host worker, each unit's new weights cast
   to the working dtype and copied up at once. The kernel is torch's fused CPU AdamW
   (`kernel="fused"`, the default) or torch's per-tensor AdamW (`kernel="exact"`: bit for bit
   what the on-device foreach AdamW computes; about 3x slower on CPU than fused, whose rounding
   differs by ~1e-8 relative per step).
   Without clipping and without loss scaling (`update_in_backward=True`) nothing waits for a
   global quantity, and a unit is updated as soon as its gradients are in, during backward.
3. next forward: a unit's forward pre-hook waits for that unit's upload only, so the updates and
   uploads of later units run under the forward of earlier ones.

With `offload_params=True` ("optimizer+params") the parameters, too, are on the host between
uses: step 2 casts each updated unit into a host copy of the working weights, and `params`
(`ParamOffload`) gives a unit device storage only around its forward and its backward.

On CUDA the copiers are side streams with pinned host buffers; elsewhere worker threads (see
`engine`). With `overlap=False` every copy and update runs inline: the serial baseline.

With `lsp` (LSP-Offload, `offload.lsp`) the 2-D weights of the transformer blocks
(`plan.lsp.is_lsp_matrix`) move through learned sparse projectors instead: in step 1 each
gradient G is compressed on the device to P G Qᵀ (d x d) and that goes down; the host runs Adam
on d x d moments; in step 2 the d x d update goes up, and in step 3 the unit's wait point
decompresses it (Pᵀ U Q) into the weight before the forward reads it. The first micro-step of
the first step, and of every `check_every`-th step, measures the reconstruction error of its
gradient and (re)fits the projectors on it on the device when it exceeds `refit_threshold` (the
first step always fits); a refit re-projects the host moments (the change of basis goes down).
Every device-host copy goes through the same copiers. Under FSDP2 each rank holds row shards of
the matrices: the compression, the error and the fits are sums over the shard group
(`offload.lsp_shard`), so every rank holds the same whole projectors and d x d state.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from llmscale.offload.engine import DONE, Ticket, make_agents
from llmscale.offload.hooks import (
    ModelHooks,
    Unit,
    UnitWaits,
    cast_parameters,
    is_fsdp_module,
    layer_units,
    wait_points,
)
from llmscale.offload.host_adam import (
    HostAdamW,
    HostSlot,
    fused_cpu_adamw_available,
)
from llmscale.offload.lsp import LspSettings, Projectors, reproject_moments
from llmscale.offload.lsp_shard import ShardedProjectors, global_shape, shard_of
from llmscale.offload.params import ParamOffload, Piece, UnitParams
from llmscale.offload.timeline import TransferTimeline
from llmscale.parallel.grads import (
    GradNorm,
    clip_coefficient,
    global_norm_and_overflow,
    grad_like_param,
    shard_count,
)
from llmscale.plan.lsp import is_lsp_matrix, matrix_dims
from llmscale.tensors import is_dtensor, local_tensor
from llmscale.torch_internals import dtensor_like


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with its state in host memory and a layer-wise pipeline.

    `named_params` are (name, parameter) pairs in forward order (`model.named_parameters()`);
    under FSDP2 the parameters are DTensors and their local shards are what is offloaded.
    `groups` are torch's parameter groups over the same trainable parameters, each with its
    weight decay (`train.optim.param_groups`: the job's one decay rule); `weight_decay` is the
    default for a group that names none.
    The working parameters are cast to `working_dtype` in place (bf16/fp16 runs hold only
    low-precision weights on the device). Call `attach(model)` to install the forward pre-hooks
    (wait for a unit's upload) and the state-dict hooks (wait for all uploads).

    The training loop's protocol, once per optimizer step after backward:
    `unscale_and_clip(optimizers, scaler, max_norm)` (overflow flag and global norm; or its two
    halves, `grad_norm` and `set_clip`), `step()` unless skipped, `zero_grad()`.

    The jobs are split: `host_adam.HostAdamW` does the arithmetic on the host buffers,
    `hooks.ModelHooks` holds the hooks, `params.ParamOffload` moves the weights of
    offload_params, `engine` the copies and host work; this class schedules them and records
    the timeline.

    `offload_params=True` also keeps the working weights on the host between uses (see
    `offload.params`): `prefetch` units are fetched ahead of the one running, and the parameters
    named in `keep_resident` (read outside their own unit, as a tied embedding is by the head)
    stay on the device from their unit's forward until their gradient is in. The model's
    `state_dict` then holds the host copies.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        *,
        groups: Sequence[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        working_dtype: torch.dtype | None = None,
        overlap: bool = True,
        update_in_backward: bool = False,
        n_microbatches: int = 1,
        kernel: str = "fused",
        pin_memory: bool | None = None,
        link_bytes_per_s: float | None = None,
        units: Callable[[Sequence[str]], list[tuple[str, list[str]]]] = layer_units,
        timeline_steps: int = 4,
        offload_params: bool = False,
        prefetch: int = 1,
        keep_resident: Sequence[str] = (),
        lsp: LspSettings | None = None,
    ) -> None:
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("OffloadedAdamW needs at least one parameter that requires grad")
        if update_in_backward and not overlap:
            raise ValueError("update_in_backward needs overlap=True")
        if kernel not in ("fused", "exact"):
            raise ValueError(f"kernel={kernel!r}: fused | exact")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: units fetched ahead, >= 0")
        if lsp is not None and offload_params:
            raise ValueError("lsp: the weights stay on the device (offload_params is not for it)")
        self.fused = kernel == "fused" and fused_cpu_adamw_available()
        groups = [dict(g, params=list(g["params"])) for g in groups if list(g["params"])]
        grouped = [id(p) for g in groups for p in g["params"]]
        if sorted(grouped) != sorted(id(p) for _, p in named):
            raise ValueError("groups must hold each trainable parameter of named_params once")
        super().__init__(
            groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

        self.device = local_tensor(named[0][1]).device
        self.overlap = overlap
        self.update_in_backward = update_in_backward
        self.n_microbatches = n_microbatches
        self.pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.working_dtype = working_dtype or local_tensor(named[0][1]).dtype
        self.offload_params = offload_params
        self.lsp = lsp
        self.prefetch = prefetch
        self.keep_resident = set(keep_resident)
        self.params: ParamOffload | None = None  # made by `attach` under offload_params
        self.host = HostAdamW(
            self.working_dtype, n_microbatches, self.pin, self.fused, offload_params
        )
        self.hooks = ModelHooks()
        self._unit_params: list[UnitParams] = []
        self.timeline = TransferTimeline(self.device, keep_steps=timeline_steps)
        self.d2h, self.h2d, self.worker = make_agents(
            self.device, overlap, self.timeline, link_bytes_per_s
        )
        self._finalizer = weakref.finalize(self, _close_agents, (self.d2h, self.h2d, self.worker))

        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        by_name = dict(named)
        unknown = self.keep_resident - set(by_name)
        if unknown:
            raise ValueError(f"keep_resident: {sorted(unknown)} are not trainable parameters")
        self.units: list[Unit] = []
        self.slots: list[HostSlot] = []
        self._slot_of: dict[int, HostSlot] = {}
        # LSP matrices held as FSDP2 row shards: their projector arithmetic over the shard group
        self._lsp_rows: dict[int, ShardedProjectors] = {}
        for ui, (uname, names) in enumerate(units([n for n, _ in named])):
            unit = Unit(ui, uname, [])
            for name in names:
                p = by_name[name]
                shape = global_shape(p)  # the whole matrix's: projectors are per matrix
                if lsp is not None and is_lsp_matrix(name, shape):
                    d, s = matrix_dims(shape, lsp.dim, lsp.nonzeros)
                    m, n = shape
                    proj = Projectors.new(
                        m, n, d, s, lsp.seed * 1_000_003 + len(self.slots), self.device
                    )
                    slot = self.host.make_lsp_slot(
                        len(self.slots), name, p, ui, group_of[id(p)], proj
                    )
                    rows = shard_of(p)
                    if rows is not None:
                        self._lsp_rows[id(slot)] = ShardedProjectors(proj, rows)
                else:
                    slot = self.host.make_slot(len(self.slots), name, p, ui, group_of[id(p)])
                # Non-empty from the start, so DCP's get_state_dict never runs a fake step.
                self.state[p] = slot.state()
                unit.slots.append(slot)
                self.slots.append(slot)
                self._slot_of[id(slot.param)] = slot
            self.units.append(unit)
        self.slots.sort(key=lambda s: s.index)
        self.hooks.on_grad((s.param for s in self.slots), self._on_grad)
        self._update_order = list(self.units)  # forward order; `attach` may move some first
        self._step_index = 0
        self._coef: torch.Tensor | None = None  # 1/loss_scale x clip coefficient, for this step
        self.waits = UnitWaits(self.units, self.timeline, lambda: self._step_index)
        self.waits.after_upload = self._apply_lsp

    # ---- module hooks ----------------------------------------------------------------------
    def attach(self, model: nn.Module) -> OffloadedAdamW:
        """Cast the weights to the working dtype; hook the forward and the state dict.

        The master copies were taken in full precision when the optimizer was made; from here
        the model's parameters are the working copy (under FSDP2 the sharded ones: FSDP2 keeps
        the same parameter objects and its all-gathers read them in that dtype). Buffers keep
        their dtype (RoPE tables stay fp32).

        Each unit is waited for in the forward pre-hook of the module that first reads its weights:
        its block; the root for "embed" (the model may read those weights directly); the owning
        modules otherwise. Under FSDP2 it is the nearest `fully_shard`-ed module above the
        weights, whose own pre-forward hook all-gathers them: ours is prepended to run first.
        Units waited for at the root are updated first.
        """
        cast_parameters(model, self.working_dtype)
        for s in self.slots:
            if s.local.dtype != self.working_dtype:
                raise ValueError(f"{s.name} is not a parameter of the attached model")
        sharded = any(is_fsdp_module(m) for m in model.modules())
        if self.offload_params and sharded:
            raise ValueError(
                "offload_params: FSDP2 owns the parameters' storage (use its CPUOffloadPolicy)"
            )
        at_root: list[Unit] = []
        for u in self.units:
            owners = wait_points(model, u.name, [s.name for s in u.slots], sharded)
            if "" in owners:
                at_root.append(u)
            for owner in sorted(o for o in owners if o):
                mod = model.get_submodule(owner)
                u.modules.append(mod)
                self.hooks.before_forward(mod, self.waits.pre_forward, [u])
        self._update_order = at_root + [u for u in self.units if u not in at_root]
        for mod in model.modules():
            slot = self._slot_of.get(id(getattr(mod, "weight", None)))
            if isinstance(mod, nn.Linear) and slot is not None and self._factored(slot):
                self.hooks.swap_forward(mod, self._on_factors)
        self.hooks.before_forward(model, self.waits.pre_forward_root, at_root)
        self.hooks.after_forward(model, self.waits.post_forward_root)
        if self.offload_params:
            self._start_param_offload()
        self.hooks.state_dict(
            model,
            before_save=self._sync_hook,
            before_load=self._load_pre_hook,
            after_load=self._master_from_params_hook,
            after_save=self._host_params_hook if self.offload_params else None,
        )
        return self

    def _factored(self, slot: HostSlot) -> bool:
        """Whether `slot`'s gradient is compressed from its layer's factors
        (`offload.lsp_linear`): an LSP matrix held whole on this rank, as a plain tensor. Under
        FSDP2 or replicate the gradient is reduced over ranks by FSDP2 first, and compressed
        from that (row shards: `offload.lsp_shard`)."""
        return (
            slot.lsp is not None and id(slot) not in self._lsp_rows and not is_dtensor(slot.param)
        )

    def _start_param_offload(self) -> None:
        """Take the host copies of the (cast) weights, then free their device storage."""
        for s in self.slots:
            assert s.host_param is not None
            if s.host_param is not s.master:
                s.host_param.copy_(s.local)
        self._unit_params = [
            UnitParams(
                u.index,
                u.name,
                [Piece(s.local, s.host_param, s.local.nbytes) for s in u.slots],  # type: ignore[arg-type]
                keep=any(s.name in self.keep_resident for s in u.slots),
            )
            for u in self.units
        ]
        self.params = ParamOffload(
            self._unit_params,
            self.h2d,
            self.worker,
            self.timeline,
            self.device,
            step_index=lambda: self._step_index,
            pending_update=lambda i: self.units[i].upload,
            prefetch=self.prefetch,
            on_wait=self.waits.wait_backward,
        )
        self.waits.params, self.waits.unit_params = self.params, self._unit_params
        self.params.start()

    def _sync_hook(self, *args: Any, **kwargs: Any) -> None:
        self.synchronize()

    def _load_pre_hook(self, *args: Any, **kwargs: Any) -> None:
        self.synchronize()
        if self.params is not None:
            self.params.materialize()  # load_state_dict copies into the device parameters

    def _master_from_params_hook(self, *args: Any, **kwargs: Any) -> None:
        """After loading model weights, the host master follows them where they differ.

        Where the loaded weight is the master rounded to the working dtype the master is kept:
        a checkpoint load (DCP) has written it already, in full precision.
        """
        for s in self.slots:
            if s.lsp is not None:
                continue  # no master: the device weight is the copy
            local = s.local
            if not torch.equal(s.master.to(local.dtype), local.detach().cpu()):
                s.master.copy_(local)
            if s.host_param is not None and s.host_param is not s.master:
                s.host_param.copy_(local)
        if self.params is not None:
            self.params.release_all()

    def _host_params_hook(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        """offload_params: the state dict holds the host copies (the device has none)."""
        for s in self.slots:
            key = prefix + s.name
            if key in state_dict and s.host_param is not None:
                host = s.host_param
                state_dict[key] = dtensor_like(s.param, host) if is_dtensor(s.param) else host

    # ---- backward: gradient download and host accumulation ----------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        slot = self._slot_of[id(p)]
        if p.grad is None and self._factored(slot):
            return  # (autograd may run its hook with no gradient: `_on_factors` took it)
        assert p.grad is not None
        # Under TP autograd may leave a Partial (sequence-parallel norms) or Replicate
        # (vocab-parallel embedding) gradient: its parameter's layout first, as on the device.
        g = local_tensor(grad_like_param(p, p.grad))
        p.grad = None  # the device gradient lives only until its copy has read it
        self._take_grad(slot, g)

    def _on_factors(self, p: nn.Parameter, x: torch.Tensor, dy: torch.Tensor) -> None:
        """An LSP matrix's gradient as its layer's input X and output gradient dY
        (`offload.lsp_linear`): compressed from them, or, on a micro-step that checks the
        projectors, formed whole (G = dYᵀ X, as autograd would) and taken as any gradient."""
        slot = self._slot_of[id(p)]
        assert slot.lsp is not None
        if slot.micro == 0 and self._lsp_check_due(slot):
            self._take_grad(slot, dy.t().mm(x))
            return
        self._take_grad(slot, slot.lsp.proj.compress_factors(x, dy), compressed=True)

    def _take_grad(self, slot: HostSlot, g: torch.Tensor, compressed: bool = False) -> None:
        """Download this micro-step's gradient `g` of `slot` (an LSP matrix's compressed here
        unless `compressed` already) and queue its host accumulation."""
        unit = self.units[slot.unit]
        self.waits.close_interval(unit.name, "backward")
        if unit.final_submitted:
            if self.update_in_backward:
                raise RuntimeError(
                    f"unit {unit.name!r} got gradients after its update ran in backward: more "
                    f"backward passes than n_microbatches={self.n_microbatches} in one step"
                )
            unit.final_submitted = False  # its norms are stale; taken again at step time
        first = slot.micro == 0
        slot.micro += 1
        if slot.lsp is not None and not compressed:
            if first:
                self._lsp_check(slot, unit, g)
            g = self._lsp_ops(slot).compress(g)  # d x d fp32: what goes down
        dst = self.host.download_buffer(slot, g.dtype, first)
        direct = dst is slot.grad
        # The buffer must be free: the last step's upload out of it done (the forward waited for
        # it unless this unit's modules never ran), the last micro-step's host add done with it.
        # (Under offload_params nothing is uploaded from it.)
        if self.params is None:
            self.waits.wait_unit(unit)
        if slot.pending is not None and not slot.pending.done():
            t0 = self.timeline.stream_now()
            slot.pending.result()
            self.waits.compute(unit.name, "wait", t0, self.timeline.stream_now())
        ticket = self.d2h.copy(dst, g, self._step_index, unit.name, "download")
        del g
        slot.pending = self.worker.submit(
            self._accumulate, slot, ticket, first, direct, self._step_index
        )
        unit.fired += 1
        if unit.fired == len(unit.slots) * self.n_microbatches:
            self._submit_final(unit)
        if self.params is not None:
            self.params.grad_arrived(self._unit_params[unit.index])
        self.waits.cursor = self.timeline.stream_now()

    # ---- LSP-Offload: check, fit, re-project, apply --------------------------------------------
    def _lsp_check(self, slot: HostSlot, unit: Unit, g: torch.Tensor) -> None:
        """On a check step, the reconstruction error of `g`; (re)fit when it is too large.

        Check steps are those where the matrix has taken a multiple of `check_every` optimizer
        steps (its step counter, which checkpoints keep): the first one always fits. After a
        refit the change of basis goes down and the host worker re-projects the moments (FIFO:
        before this step's update); at the first fit the moments are zero and stay so.
        """
        assert slot.lsp is not None and self.lsp is not None
        if not self._lsp_check_due(slot):
            return
        done = int(slot.step.item())
        lsp, step, ops = slot.lsp, self._step_index, self._lsp_ops(slot)
        if done > 0:
            self.d2h.copy(lsp.error, ops.relative_error(g), step, unit.name, "download").wait()
            if not float(lsp.error) > self.lsp.refit_threshold:  # (a NaN gradient: no refit)
                return
        old = lsp.proj.snapshot()
        trace = ops.fit(g)  # (a zero or non-finite gradient: unchanged, error NaN)
        self.d2h.copy(lsp.error, torch.stack(trace).min(), step, unit.name, "download").wait()
        if done > 0:  # (a NaN error never gets here: no refit; at the first fit M = V = 0)
            a, b = lsp.proj.change_of_basis(old)
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin) for t in (a, b)]
            tickets = [
                self.d2h.copy(h, t, step, unit.name, "download")
                for h, t in zip(host, (a, b), strict=True)
            ]
            self.worker.submit(self._reproject, slot, host, tickets)

    def _lsp_check_due(self, slot: HostSlot) -> bool:
        """Whether this step checks `slot`'s projectors: its step count a multiple of
        `check_every` (the first step fits)."""
        assert self.lsp is not None
        return int(slot.step.item()) % self.lsp.check_every == 0

    @staticmethod
    def _reproject(slot: HostSlot, ab: list[torch.Tensor], tickets: list[Ticket]) -> None:
        for t in tickets:
            t.wait()
        reproject_moments(slot.exp_avg, slot.exp_avg_sq, ab[0], ab[1])

    def _lsp_ops(self, slot: HostSlot) -> Projectors | ShardedProjectors:
        """Whose compress / relative_error / fit read `slot`'s gradient: its projectors, or
        under FSDP2 their row-shard view (sums over the shard group, `offload.lsp_shard`)."""
        assert slot.lsp is not None
        return self._lsp_rows.get(id(slot), slot.lsp.proj)

    def _apply_lsp(self, unit: Unit) -> None:
        """Decompress and apply the unit's uploaded LSP updates (its upload is waited for)."""
        for s in unit.slots:
            if s.lsp is not None and s.lsp.pending:
                rows = self._lsp_rows.get(id(s))
                if rows is not None:
                    rows.apply(s.lsp, s.local)  # this rank's rows of the update
                else:
                    s.lsp.apply(s.local)

    def norm_shard_count(self, p: torch.Tensor) -> int:
        """Into how many pieces the host gradient of `p` is split over the mesh, for the
        global norm: an LSP matrix's compressed gradient is whole on every rank (1)."""
        slot = self._slot_of.get(id(p))
        return 1 if slot is not None and slot.lsp is not None else shard_count(p)

    def lsp_reconstruction_error(self) -> float | None:
        """Mean over the LSP matrices of their last measured relative reconstruction error."""
        errs = [float(s.lsp.error) for s in self.slots if s.lsp is not None]
        return sum(errs) / len(errs) if errs else None

    def _accumulate(
        self, slot: HostSlot, ticket: Ticket, first: bool, direct: bool, step: int
    ) -> None:
        ticket.wait()
        if direct:
            return
        t0 = time.perf_counter()
        self.host.accumulate(slot, first)
        self.timeline.add(step, self.units[slot.unit].name, "accumulate", "cpu", t0, _now())

    def _hyper(self) -> list[dict[str, Any]]:
        """The groups' hyper-parameters as they are now (the scheduler may change lr later)."""
        return [
            {"lr": g["lr"], "betas": g["betas"], "eps": g["eps"], "weight_decay": g["weight_decay"]}
            for g in self.param_groups
        ]

    def _submit_final(self, unit: Unit) -> None:
        unit.final_submitted = True
        slots = [s for s in unit.slots if s.micro > 0]
        unit.norm_future = self.worker.submit(self._norms, unit, slots, self._step_index)
        if self.update_in_backward:
            unit.upload = self.worker.submit(
                self._update_unit, unit, slots, None, self._hyper(), self._step_index
            )

    def _norms(self, unit: Unit, slots: list[HostSlot], step: int) -> None:
        t0 = time.perf_counter()
        self.host.norms(slots)
        self.timeline.add(step, unit.name, "norm", "cpu", t0, _now())

    def _finish_backward(self) -> None:
        """Queue the norms of units still missing them, then wait for all norms."""
        for u in self.units:
            if not u.final_submitted and any(s.micro > 0 for s in u.slots):
                self._submit_final(u)
        for u in self.units:
            if u.norm_future is not None:
                u.norm_future.result()

    # ---- the step protocol ------------------------------------------------------------------
    def _active(self) -> list[HostSlot]:
        return [s for s in self.slots if s.micro > 0]

    def local_grad_norms(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, 2-norm of this rank's accumulated host gradient), in parameter order.

        For the parameters that got a gradient this step; waits for the norms (taken on the
        host as each unit's gradients arrived), not for any update.
        """
        self._finish_backward()
        return [(s.param, s.norm) for s in self._active() if s.norm is not None]

    def set_grad_multiplier(self, coef: torch.Tensor | None) -> None:
        """What the update multiplies this step's host gradients by: 1/loss scale x clip."""
        if coef is not None and self.update_in_backward:
            raise RuntimeError(
                "update_in_backward: the update ran before any clipping or loss scaling"
            )
        self._coef = coef

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Queue the update and upload of every unit (forward order); inline without overlap."""
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        self._finish_backward()
        if self.params is not None:
            self.params.release_all()  # a device copy left over would go stale now
        if not self.update_in_backward:
            hyper = self._hyper()
            for u in self._update_order:
                slots = [s for s in u.slots if s.micro > 0]
                if slots:
                    u.upload = self.worker.submit(
                        self._update_unit, u, slots, self._coef, hyper, self._step_index
                    )
        if not self.overlap:
            self.synchronize()

    def _update_unit(
        self,
        unit: Unit,
        slots: list[HostSlot],
        coef: torch.Tensor | None,
        hyper: list[dict[str, Any]],
        step: int,
    ) -> Ticket:
        t0 = time.perf_counter()
        self.host.update(slots, hyper, coef)
        self.timeline.add(step, unit.name, "update", "cpu", t0, _now())
        return self._upload(unit, slots, step)

    def _upload(self, unit: Unit, slots: list[HostSlot], step: int) -> Ticket:
        """Cast each master to the working dtype (host) and copy it up; the last ticket.

        Under offload_params only the cast, into the host copy that the next fetch uploads.
        """
        ticket: Ticket = DONE
        if self.offload_params:
            t0 = time.perf_counter()
            self.host.cast_host_params(slots)
            if self.working_dtype != torch.float32:
                self.timeline.add(step, unit.name, "cast", "cpu", t0, _now())
            return ticket
        for s in slots:
            t0 = time.perf_counter()
            src = self.host.upload_source(s)
            if self.working_dtype != torch.float32:
                self.timeline.add(step, unit.name, "cast", "cpu", t0, _now())
            if s.lsp is not None:
                ticket = self.h2d.copy(s.lsp.update_device, src, step, unit.name, "upload")
                s.lsp.pending = True  # applied by the unit's wait point
            else:
                ticket = self.h2d.copy(s.local, src, step, unit.name, "upload")
        return ticket

    def zero_grad(self, set_to_none: bool = True) -> None:
        """End of the step: forget this step's gradient bookkeeping (host buffers are reused)."""
        for s in self.slots:
            s.param.grad = None
            s.micro = 0
        for u in self.units:
            u.fired = 0
            u.final_submitted = False
            u.norm_future = None
        self._coef = None
        if self.params is not None:
            self.params.end_step()
        self._step_index += 1
        self.timeline.prune(self._step_index)

    def synchronize(self) -> None:
        """Block until every queued host task and copy (uploads included) has finished."""
        self.worker.submit(_noop).result()
        for u in self.units:
            fut, u.upload = u.upload, None
            if fut is not None:
                fut.result().wait()
                self._apply_lsp(u)
        if self.params is not None:
            self.params.synchronize()

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (per-parameter step, exp_avg, exp_avg_sq) plus the fp32 `master`.

        The tensors are the host buffers themselves, so DCP loads into them in place. Under
        FSDP2 they are wrapped as DTensors sharded like their parameter (an LSP matrix's stay
        plain: whole and the same on every rank, so a checkpoint loads under any dp_shard).
        """
        self.synchronize()
        sd = super().state_dict()
        for key, p in zip(
            (k for g in sd["param_groups"] for k in g["params"]),
            (p for g in self.param_groups for p in g["params"]),
            strict=True,
        ):
            # (an LSP matrix's state is whole on every rank: projectors and d x d moments)
            if is_dtensor(p) and self._slot_of[id(p)].lsp is None:
                sd["state"][key] = {
                    k: (dtensor_like(p, v) if k != "step" else v)
                    for k, v in sd["state"][key].items()
                }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy saved state into the host buffers (bitwise), then upload the masters."""
        self.synchronize()
        if self.params is not None:
            self.params.release_all()  # refetched from the new host copies when next used
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved_groups)} param groups, expected "
                f"{len(self.param_groups)}"
            )
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("optimizer state's param groups do not match this model's")
            for key, p in zip(saved["params"], group["params"], strict=True):
                entry = state_dict["state"].get(key)
                if entry is not None:
                    self.host.load(self._slot_of[id(p)], entry)
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
        for u in self.units:
            # (an LSP matrix's weight is the model's own, loaded with it: nothing to upload)
            self._upload(u, [s for s in u.slots if s.lsp is None], self._step_index).wait()

    # ---- memory ledger ----------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes by role and place (`HostAdamW.memory_report`); with offload_params also
        `device_param_peak_bytes`, the most parameter bytes held on the device at once during
        the last step."""
        row = self.host.memory_report(self.slots, host_params=self.params is not None)
        err = self.lsp_reconstruction_error()
        if err is not None:
            row["lsp_reconstruction_error"] = err  # type: ignore[assignment]
        if self.params is not None:
            row["device_param_peak_bytes"] = self.params.last_peak_bytes
        return row

    def write_timeline(self, path: Any) -> Any:
        self.synchronize()
        return self.timeline.write(
            path,
            device=str(self.device),
            overlap=self.overlap,
            update_in_backward=self.update_in_backward,
            units=[u.name for u in self.units],
            update_order=[u.name for u in self._update_order],
            wait_points={
                u.name: [type(m).__name__ for m in u.modules] or ["<root>"] for u in self.units
            },
            kernel="fused" if self.fused else "exact",
            offload_params=self.offload_params,
            lsp=self.lsp._asdict() if self.lsp is not None else None,
            prefetch=self.prefetch if self.offload_params else None,
        )

    def close(self) -> None:
        """Remove the hooks and stop the worker threads (the parameters back on the device)."""
        self.synchronize()
        if self.params is not None:
            self.params.materialize()
            self.params = self.waits.params = None
        self.hooks.remove()
        self._finalizer()


class LossScale(Protocol):
    """What the offload path reads of a loss scaler (`train.precision.DynamicLossScaler`)."""

    enabled: bool
    scale: float


@torch.no_grad()
def grad_norm(
    optimizers: Sequence[OffloadedAdamW], scale: float | None, stage_size: int = 1
) -> GradNorm:
    """The unscaled global gradient norm and the overflow flag, from the host norms.

    The per-tensor norms the pipeline took on the host (of the still-scaled gradients) go
    through the device path's reduction (`parallel.grads.global_norm_and_overflow`); the total
    is then divided by the loss `scale` (exact: a power of two). None: no loss scaling.
    """
    pairs = [(opt, *pn) for opt in optimizers for pn in opt.local_grad_norms()]
    stats = global_norm_and_overflow(
        [n for _, _, n in pairs],
        [opt.norm_shard_count(p) for opt, p, _ in pairs],
        stage_size,
        scale is not None,
    )
    if scale is not None and scale != 1.0:
        return GradNorm(stats.norm * (1.0 / scale), stats.found_inf)
    return stats


def set_clip(
    optimizers: Sequence[OffloadedAdamW],
    norm: torch.Tensor,
    max_norm: float,
    scale: float | None,
) -> None:
    """Give the update its gradient factor: 1/`scale` times the clip coefficient for `norm`.

    Nothing is multiplied here; the host update applies the factor to the host gradients.
    """
    coef = clip_coefficient(norm, max_norm)
    if scale is not None and scale != 1.0:
        inv = 1.0 / scale
        coef = coef * inv if coef is not None else torch.tensor(inv)
    for opt in optimizers:
        opt.set_grad_multiplier(coef)


@torch.no_grad()
def unscale_and_clip(
    optimizers: Sequence[OffloadedAdamW],
    scaler: LossScale,
    max_norm: float,
    stage_size: int = 1,
) -> tuple[bool, torch.Tensor]:
    """Overflow check, unscale and clip for offloaded optimizers (one per model part).

    `grad_norm`, then `set_clip`: the overflow flag and the norm over the job (weighted by
    shards / `stage_size`, dp x tp: the ranks holding a stage's parameters), as the on-device
    path computes them. Returns (found_inf, unscaled global norm).
    """
    scale = scaler.scale if scaler.enabled else None
    stats = grad_norm(optimizers, scale, stage_size)
    set_clip(optimizers, stats.norm, max_norm, scale)
    return stats.found_inf, stats.norm


def _now() -> float:
    return time.perf_counter()


def _noop() -> None:
    return None


def _close_agents(agents: tuple[Any, ...]) -> None:
    for a in agents:
        a.close()
