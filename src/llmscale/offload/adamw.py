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
"""

from __future__ import annotations

import functools
import math
import re
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adamw import adamw as functional_adamw

from llmscale.offload.engine import DONE, Ticket, make_agents
from llmscale.offload.params import ParamOffload, Piece, UnitParams
from llmscale.offload.timeline import COMPUTE_LANE, Timeline
from llmscale.tensors import is_dtensor, local_tensor, tensor_bytes
from llmscale.train.precision import DynamicLossScaler

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "master")
_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


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


def layer_units(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Group parameter names into pipeline units, in the given (forward) order.

    Each `...layers.N` block is a unit; the parameters before the first block form "embed", those
    after the last block "head". A name may not come back to an earlier unit.
    """
    units: list[tuple[str, list[str]]] = []
    seen_layer = False
    for name in names:
        m = _LAYER.match(name)
        if m:
            key = m.group(1)
            seen_layer = True
        else:
            key = "head" if seen_layer else "embed"
        if not units or units[-1][0] != key:
            if any(k == key for k, _ in units):
                raise ValueError(f"parameter {name!r} returns to unit {key!r} out of order")
            units.append((key, []))
        units[-1][1].append(name)
    return units


def _host_empty(like: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)


@dataclass(eq=False)
class _Slot:
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

    @property
    def local(self) -> torch.Tensor:
        """This rank's device tensor: what is offloaded and written back."""
        return local_tensor(self.param).detach()


@dataclass(eq=False)
class _Unit:
    index: int
    name: str
    slots: list[_Slot]
    fired: int = 0  # gradient hooks run this step
    final_submitted: bool = False  # norms (and, in backward, the update) are queued
    norm_future: Future[Any] | None = None
    upload: Future[Any] | None = None  # resolves to the unit's last upload Ticket
    modules: list[nn.Module] = field(default_factory=list)


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with its state in host memory and a layer-wise pipeline.

    `named_params` are (name, parameter) pairs in forward order (`model.named_parameters()`);
    under FSDP2 the parameters are DTensors and their local shards are what is offloaded.
    Weight decay applies to tensors of two or more dimensions, as `train.optim.param_groups`.
    The working parameters are cast to `working_dtype` in place (bf16/fp16 runs hold only
    low-precision weights on the device). Call `attach(model)` to install the forward pre-hooks
    (wait for a unit's upload) and the state-dict hooks (wait for all uploads).

    The training loop's protocol, once per optimizer step after backward:
    `unscale_and_clip(optimizers, scaler, max_norm)` (overflow flag and global norm), `step()`
    unless skipped, `zero_grad()`.

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
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        working_dtype: torch.dtype | None = None,
        overlap: bool = True,
        update_in_backward: bool = False,
        accum_steps: int = 1,
        kernel: str = "fused",
        pin_memory: bool | None = None,
        link_bytes_per_s: float | None = None,
        units: Callable[[Sequence[str]], list[tuple[str, list[str]]]] = layer_units,
        timeline_steps: int = 4,
        offload_params: bool = False,
        prefetch: int = 1,
        keep_resident: Sequence[str] = (),
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
        self.fused = kernel == "fused" and fused_cpu_adamw_available()
        decay = [p for _, p in named if p.dim() >= 2]
        no_decay = [p for _, p in named if p.dim() < 2]
        groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        groups = [g for g in groups if g["params"]]
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})

        self.device = local_tensor(named[0][1]).device
        self.overlap = overlap
        self.update_in_backward = update_in_backward
        self.accum_steps = accum_steps
        self.pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.working_dtype = working_dtype or local_tensor(named[0][1]).dtype
        self.offload_params = offload_params
        self.prefetch = prefetch
        self.keep_resident = set(keep_resident)
        self.params: ParamOffload | None = None  # made by `attach` under offload_params
        self._unit_params: list[UnitParams] = []
        self.timeline = Timeline(self.device, keep_steps=timeline_steps)
        self.d2h, self.h2d, self.worker = make_agents(
            self.device, overlap, self.timeline, link_bytes_per_s
        )
        self._finalizer = weakref.finalize(self, _close_agents, (self.d2h, self.h2d, self.worker))

        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        by_name = dict(named)
        unknown = self.keep_resident - set(by_name)
        if unknown:
            raise ValueError(f"keep_resident: {sorted(unknown)} are not trainable parameters")
        self.units: list[_Unit] = []
        self.slots: list[_Slot] = []
        self._slot_of: dict[int, _Slot] = {}
        for ui, (uname, names) in enumerate(units([n for n, _ in named])):
            unit = _Unit(ui, uname, [])
            for name in names:
                slot = self._make_slot(len(self.slots), name, by_name[name], ui, group_of)
                unit.slots.append(slot)
                self.slots.append(slot)
                self._slot_of[id(slot.param)] = slot
            self.units.append(unit)
        self.slots.sort(key=lambda s: s.index)
        self._hooks = [
            s.param.register_post_accumulate_grad_hook(self._on_grad) for s in self.slots
        ]
        self._module_hooks: list[Any] = []
        self._update_order = list(self.units)  # forward order; `attach` may move some first
        self._step_index = 0
        self._coef: torch.Tensor | None = None  # 1/loss_scale x clip coefficient, for this step
        self._cursor: Any = None  # compute-lane mark where the current compute interval began
        self._fwd_unit: int | None = None

    def _make_slot(
        self, index: int, name: str, p: nn.Parameter, unit: int, group_of: dict[int, int]
    ) -> _Slot:
        local = local_tensor(p).detach()
        master = _host_empty(local, torch.float32, self.pin)
        master.copy_(local)
        needs_staging = self.working_dtype != torch.float32 or self.accum_steps > 1
        slot = _Slot(
            index=index,
            name=name,
            param=p,
            unit=unit,
            group=group_of[id(p)],
            master=master,
            exp_avg=torch.zeros(local.shape, dtype=torch.float32),
            exp_avg_sq=torch.zeros(local.shape, dtype=torch.float32),
            step=torch.zeros((), dtype=torch.float32),
            grad=_host_empty(local, torch.float32, self.pin),
            staging=_host_empty(local, self.working_dtype, self.pin) if needs_staging else None,
        )
        if self.offload_params:
            # fp32: the master is what is uploaded; else a host copy in the working dtype (filled
            # from the cast parameter in `attach`). Gradients download into `staging`, so
            # backward's re-uploads never read a buffer a download is writing.
            fp32 = self.working_dtype == torch.float32
            slot.host_param = master if fp32 else _host_empty(local, self.working_dtype, self.pin)
        # Non-empty from the start, so DCP's get_state_dict never runs a fake step to make it.
        self.state[p] = {
            "step": slot.step,
            "exp_avg": slot.exp_avg,
            "exp_avg_sq": slot.exp_avg_sq,
            "master": slot.master,
        }
        return slot

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
        _cast_parameters(model, self.working_dtype)
        for s in self.slots:
            if s.local.dtype != self.working_dtype:
                raise ValueError(f"{s.name} is not a parameter of the attached model")
        sharded = any(_is_fsdp_module(m) for m in model.modules())
        if self.offload_params and sharded:
            raise ValueError(
                "offload_params: FSDP2 owns the parameters' storage (use its CPUOffloadPolicy)"
            )
        at_root: list[_Unit] = []
        for u in self.units:
            owners = self._wait_points(model, u, sharded)
            if "" in owners:
                at_root.append(u)
            for owner in sorted(o for o in owners if o):
                mod = model.get_submodule(owner)
                u.modules.append(mod)
                self._module_hooks.append(
                    mod.register_forward_pre_hook(
                        functools.partial(self._pre_forward, [u]), prepend=True
                    )
                )
        self._update_order = at_root + [u for u in self.units if u not in at_root]
        self._module_hooks.append(
            model.register_forward_pre_hook(
                functools.partial(self._pre_forward_root, at_root), prepend=True
            )
        )
        self._module_hooks.append(model.register_forward_hook(self._post_forward_root))
        self._module_hooks.append(model.register_state_dict_pre_hook(self._sync_hook))
        self._module_hooks.append(model.register_load_state_dict_pre_hook(self._load_pre_hook))
        self._module_hooks.append(
            model.register_load_state_dict_post_hook(self._master_from_params_hook)
        )
        if self.offload_params:
            self._start_param_offload()
            # (a partial: torch marks the hook object, which a bound method cannot carry)
            hook = functools.partial(self._host_params_hook)
            self._module_hooks.append(model.register_state_dict_post_hook(hook))
        return self

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
            on_wait=self._wait_backward,
        )
        self.params.start()

    @staticmethod
    def _wait_points(model: nn.Module, unit: _Unit, sharded: bool) -> set[str]:
        """Names of the modules whose forward pre-hook waits for `unit` ("" = the root)."""
        if sharded:
            points = set()
            for s in unit.slots:
                path = s.name.rpartition(".")[0]
                while path and not _is_fsdp_module(model.get_submodule(path)):
                    path = path.rpartition(".")[0]
                points.add(path)
            return points
        if unit.name == "embed":
            return {""}
        m = _LAYER.match(unit.slots[0].name)
        if m:
            return {m.group(1)}  # the whole block
        return {s.name.rpartition(".")[0] for s in unit.slots}

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
                state_dict[key] = _dtensor_like(s.param, host) if is_dtensor(s.param) else host

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _compute(self, unit: str, phase: str, start: Any, end: Any) -> None:
        self.timeline.add(self._step_index, unit, phase, COMPUTE_LANE, start, end)

    def _pre_forward_root(self, units: list[_Unit], module: nn.Module, args: Any) -> None:
        if self.params is not None and not self._in_backward():
            self.params.start_forward()
        self._pre_forward(units, module, args)

    def _pre_forward(self, units: list[_Unit], module: nn.Module, args: Any) -> None:
        if not units:
            return
        if self._in_backward():  # recomputation inside backward: weights already waited for
            for u in units:
                if self.params is not None:
                    self.params.fetch(self._unit_params[u.index], "refetch")
                self._wait_unit(u)
            return
        now = self.timeline.stream_now()
        if self._fwd_unit is not None and self._cursor is not None:
            self._compute(self.units[self._fwd_unit].name, "forward", self._cursor, now)
        also = _fsdp_gather_streams(module)
        for u in units:
            if self.params is not None:
                self.params.begin_unit(self._unit_params[u.index], args)
            self._wait_unit(u, self.timeline.stream_now(), also)
        self._cursor = self.timeline.stream_now()
        self._fwd_unit = units[0].index

    def _post_forward_root(self, module: nn.Module, args: Any, output: Any) -> None:
        now = self.timeline.stream_now()
        if self._fwd_unit is not None and self._cursor is not None:
            self._compute(self.units[self._fwd_unit].name, "forward", self._cursor, now)
        if self.params is not None and not self._in_backward():
            self.params.end_forward(output)
        self._fwd_unit = None
        self._cursor = now

    def _wait_unit(self, unit: _Unit, start: Any = None, also: Sequence[Any] = ()) -> None:
        if self.params is not None:  # the unit's parameter fetch (its update is waited by it)
            if self.params.wait(self._unit_params[unit.index]) and start is not None:
                self._compute(unit.name, "wait", start, self.timeline.stream_now())
            return
        fut, unit.upload = unit.upload, None
        if fut is None:
            return
        ticket: Ticket = fut.result()
        ticket.wait_stream(also)
        if start is not None:
            self._compute(unit.name, "wait", start, self.timeline.stream_now())

    def _wait_backward(self, up: UnitParams) -> None:
        """Before a unit's backward: wait for its parameters (timed on the compute lane)."""
        assert self.params is not None
        start = self.timeline.stream_now()
        if self._cursor is not None:
            self._compute(up.name, "backward", self._cursor, start)
        if self.params.wait(up):
            self._compute(up.name, "wait", start, self.timeline.stream_now())
        self._cursor = self.timeline.stream_now()

    # ---- backward: gradient download and host accumulation ----------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        now = self.timeline.stream_now()
        slot = self._slot_of[id(p)]
        unit = self.units[slot.unit]
        if self._cursor is not None:
            self._compute(unit.name, "backward", self._cursor, now)
        assert p.grad is not None
        g = p.grad
        if is_dtensor(g) and is_dtensor(p) and tuple(g.placements) != tuple(p.placements):
            # Under TP autograd may leave a Partial (sequence-parallel norms) or Replicate
            # (vocab-parallel embedding) gradient: give it its parameter's layout first, as
            # parallel.grads.match_grad_placements_ does on the device path.
            g = g.redistribute(device_mesh=p.device_mesh, placements=p.placements)
        g = local_tensor(g)
        p.grad = None  # the device gradient lives only until its copy has read it
        if unit.final_submitted:
            if self.update_in_backward:
                raise RuntimeError(
                    f"unit {unit.name!r} got gradients after its update ran in backward: more "
                    f"backward passes than accum_steps={self.accum_steps} in one step"
                )
            unit.final_submitted = False  # its norms are stale; taken again at step time
        first = slot.micro == 0
        slot.micro += 1
        direct = first and g.dtype == torch.float32
        if not direct and (slot.staging is None or slot.staging.dtype != g.dtype):
            # More micro-steps than accum_steps said, or gradients in another dtype than the
            # weights (FSDP2's reduce_dtype): a download buffer of the gradient's own dtype.
            slot.staging = _host_empty(slot.master, g.dtype, self.pin)
        dst = slot.grad if direct else slot.staging
        assert dst is not None
        # The buffer must be free: the last step's upload out of it done (the forward waited for
        # it unless this unit's modules never ran), the last micro-step's host add done with it.
        # (Under offload_params nothing is uploaded from it.)
        if self.params is None:
            self._wait_unit(unit)
        if slot.pending is not None and not slot.pending.done():
            t0 = self.timeline.stream_now()
            slot.pending.result()
            self._compute(unit.name, "wait", t0, self.timeline.stream_now())
        ticket = self.d2h.copy(dst, g, self._step_index, unit.name, "download")
        del g
        slot.pending = self.worker.submit(
            self._accumulate, slot, ticket, first, direct, self._step_index
        )
        unit.fired += 1
        if unit.fired == len(unit.slots) * self.accum_steps:
            self._submit_final(unit)
        if self.params is not None:
            self.params.grad_arrived(self._unit_params[unit.index])
        self._cursor = self.timeline.stream_now()

    def _accumulate(
        self, slot: _Slot, ticket: Ticket, first: bool, direct: bool, step: int
    ) -> None:
        ticket.wait()
        if direct:
            return
        t0 = time.perf_counter()
        assert slot.staging is not None
        if first:
            slot.grad.copy_(slot.staging)
        else:
            slot.grad.add_(slot.staging)
        self.timeline.add(step, self.units[slot.unit].name, "accumulate", "cpu", t0, _now())

    def _hyper(self) -> list[dict[str, Any]]:
        """The groups' hyper-parameters as they are now (the scheduler may change lr later)."""
        return [
            {"lr": g["lr"], "betas": g["betas"], "eps": g["eps"], "weight_decay": g["weight_decay"]}
            for g in self.param_groups
        ]

    def _submit_final(self, unit: _Unit) -> None:
        unit.final_submitted = True
        slots = [s for s in unit.slots if s.micro > 0]
        unit.norm_future = self.worker.submit(self._norms, unit, slots, self._step_index)
        if self.update_in_backward:
            unit.upload = self.worker.submit(
                self._update_unit, unit, slots, None, self._hyper(), self._step_index
            )

    def _norms(self, unit: _Unit, slots: list[_Slot], step: int) -> None:
        t0 = time.perf_counter()
        if slots:
            # The same kernel as clip_grad_norm_(foreach=True): per-tensor 2-norms.
            for s, n in zip(slots, torch._foreach_norm([s.grad for s in slots], 2), strict=True):
                s.norm = n
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
    def _active(self) -> list[_Slot]:
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
        unit: _Unit,
        slots: list[_Slot],
        coef: torch.Tensor | None,
        hyper: list[dict[str, Any]],
        step: int,
    ) -> Ticket:
        t0 = time.perf_counter()
        for gi, hp in enumerate(hyper):
            group = [s for s in slots if s.group == gi]
            if not group:
                continue
            grads = [s.grad for s in group]
            if coef is not None:
                torch._foreach_mul_(grads, coef)
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
        self.timeline.add(step, unit.name, "update", "cpu", t0, _now())
        return self._upload(unit, slots, step)

    def _upload(self, unit: _Unit, slots: list[_Slot], step: int) -> Ticket:
        """Cast each master to the working dtype (host) and copy it up; the last ticket.

        Under offload_params only the cast, into the host copy that the next fetch uploads.
        """
        ticket: Ticket = DONE
        if self.offload_params:
            t0 = time.perf_counter()
            for s in slots:
                if s.host_param is not None and s.host_param is not s.master:
                    s.host_param.copy_(s.master)
            if self.working_dtype != torch.float32:
                self.timeline.add(step, unit.name, "cast", "cpu", t0, _now())
            return ticket
        for s in slots:
            if self.working_dtype == torch.float32:
                src = s.master
            else:
                t0 = time.perf_counter()
                assert s.staging is not None
                s.staging.copy_(s.master)
                self.timeline.add(step, unit.name, "cast", "cpu", t0, _now())
                src = s.staging
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
        if self.params is not None:
            self.params.synchronize()

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (per-parameter step, exp_avg, exp_avg_sq) plus the fp32 `master`.

        The tensors are the host buffers themselves, so DCP loads into them in place. Under
        FSDP2 they are wrapped as DTensors sharded like their parameter.
        """
        self.synchronize()
        sd = super().state_dict()
        for key, p in zip(
            (k for g in sd["param_groups"] for k in g["params"]),
            (p for g in self.param_groups for p in g["params"]),
            strict=True,
        ):
            if is_dtensor(p):
                sd["state"][key] = {
                    k: (_dtensor_like(p, v) if k != "step" else v)
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
                if entry is None:
                    continue
                mine = self.state[p]
                for k in STATE_KEYS:
                    src = local_tensor(entry[k])
                    dst = mine[k]
                    if src.data_ptr() != dst.data_ptr():
                        dst.copy_(src)
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
        for u in self.units:
            self._upload(u, u.slots, self._step_index).wait()

    # ---- memory ledger ----------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes by role and place: the optimizer state and master weights are on the host.

        `host_optimizer_bytes` is the two moments and the 0-d fp32 step counters (as
        `train.metrics.optimizer_state_bytes` counts them), `host_master_bytes` the fp32 master
        weights: 12 bytes per offloaded parameter plus 4 per tensor, as the planner predicts.
        `host_grad_bytes`/`host_staging_bytes` are the host gradient and transfer buffers,
        `host_param_bytes` the host working copies of offload_params (none in fp32: the master is
        uploaded) and `device_param_peak_bytes` the most parameter bytes it held on the device at
        once during the last step.
        """

        def on_device(ts: Iterable[torch.Tensor]) -> int:
            return tensor_bytes(t for t in ts if t.device.type != "cpu")

        def on_host(ts: Iterable[torch.Tensor]) -> int:
            return tensor_bytes(t for t in ts if t.device.type == "cpu")

        moments = [t for s in self.slots for t in (s.exp_avg, s.exp_avg_sq, s.step)]
        masters = [s.master for s in self.slots]
        return {
            "device_optimizer_bytes": on_device(moments),
            "device_master_bytes": on_device(masters),
            "host_optimizer_bytes": on_host(moments),
            "host_master_bytes": on_host(masters),
            "host_grad_bytes": on_host(s.grad for s in self.slots),
            "host_staging_bytes": on_host(s.staging for s in self.slots if s.staging is not None),
            **(
                {
                    "host_param_bytes": on_host(
                        s.host_param
                        for s in self.slots
                        if s.host_param is not None and s.host_param is not s.master
                    ),
                    "device_param_peak_bytes": self.params.last_peak_bytes,
                }
                if self.params is not None
                else {}
            ),
        }

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
            prefetch=self.prefetch if self.offload_params else None,
        )

    def close(self) -> None:
        """Remove the hooks and stop the worker threads (the parameters back on the device)."""
        self.synchronize()
        if self.params is not None:
            self.params.materialize()
            self.params = None
        for h in [*self._hooks, *self._module_hooks]:
            h.remove()
        self._hooks, self._module_hooks = [], []
        self._finalizer()


@torch.no_grad()
def unscale_and_clip(
    optimizers: Sequence[OffloadedAdamW],
    scaler: DynamicLossScaler,
    max_norm: float,
    stage_size: int = 1,
) -> tuple[bool, torch.Tensor]:
    """Overflow check, unscale and clip for offloaded optimizers (one per model part).

    The on-device path's reductions (`DynamicLossScaler.unscale_and_check`,
    `parallel.grads.clip_grad_norm_`), from the per-tensor norms the pipeline took on the host:
    the overflow flag (a norm is finite exactly when every element is) is all-reduced with MAX
    over the job; the norm is the root of the job-wide sum of each local norm's square, weighted
    by (shards of the tensor) / `stage_size` (dp x tp: the ranks holding a stage's parameters).
    Returns (found_inf, unscaled global norm). Nothing is multiplied here: 1/scale and the clip
    coefficient become one factor that the update applies to the host gradients.
    """
    from llmscale.parallel.grads import _shards

    pairs = [pn for opt in optimizers for pn in opt.local_grad_norms()]
    found = False
    inv = 1.0
    if scaler.enabled:
        flag = (
            torch.logical_not(torch.isfinite(torch.stack([n for _, n in pairs]))).any().float()
            if pairs
            else torch.zeros(())
        )
        found = bool(_all_reduce(flag, dist.ReduceOp.MAX).item())
        inv = 1.0 / scaler.scale
    if pairs:
        norms = torch.stack([n for _, n in pairs]).float()
        weights = torch.tensor([_shards(p) / stage_size for p, _ in pairs])
        sq = (norms**2 * weights).sum()
    else:
        sq = torch.zeros(())
    total = _all_reduce(sq, dist.ReduceOp.SUM).sqrt()
    if inv != 1.0:  # exact: the scale is a power of two
        total = total * inv
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0) if math.isfinite(max_norm) else None
    if inv != 1.0:
        coef = coef * inv if coef is not None else torch.tensor(inv)
    for opt in optimizers:
        opt.set_grad_multiplier(coef)
    return found, total


def _all_reduce(t: torch.Tensor, op: Any) -> torch.Tensor:
    """Over the whole job when a process group is up (on the backend's device); else `t`."""
    if not (dist.is_available() and dist.is_initialized()):
        return t
    on = t.to(_collective_device(None))
    dist.all_reduce(on, op=op)
    return on.cpu()


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for the parameters only (FSDP2 handles its sharded ones in `_apply`)."""
    if all(p.dtype == dtype for p in model.parameters()):
        return
    buffers = dict(model.named_buffers())
    model.to(dtype)
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b


def _now() -> float:
    return time.perf_counter()


def _noop() -> None:
    return None


def _close_agents(agents: tuple[Any, ...]) -> None:
    for a in agents:
        a.close()


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fsdp_gather_streams(module: nn.Module) -> list[Any]:
    """The CUDA streams on which FSDP2 reads `module`'s shards for its all-gather.

    FSDP2 copies the shards in and all-gathers them on streams of its own, which wait for the
    compute stream once, in the root's pre-forward; a block's upload waited for on the compute
    stream alone would not order its all-gather after the upload. So those streams wait for the
    upload's event too. None off CUDA, or for a module that is not fully_shard-ed.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    ctx = getattr(get_state(), "_comm_ctx", None)
    streams = [getattr(ctx, a, None) for a in ("all_gather_copy_in_stream", "all_gather_stream")]
    return [st for st in streams if isinstance(st, torch.cuda.Stream)]


def _is_fsdp_module(m: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(m, FSDPModule)


def _dtensor_like(param: Any, host: torch.Tensor) -> Any:
    """`host` (this rank's shard, in host memory) as a DTensor sharded like `param`.

    Built from the spec directly: `DTensor.from_local` would move a CPU shard onto the mesh's
    device.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = param._spec
    meta = TensorMeta(shape=param.shape, stride=param.stride(), dtype=host.dtype)
    new_spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return DTensor(host, new_spec, requires_grad=False)
