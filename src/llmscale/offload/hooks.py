"""Where the offload pipeline meets the model: units, wait points and the hooks installed on it.

A *unit* is a group of parameters moved and updated together: each transformer block, plus the
parameters before the first block ("embed") and after the last one ("head") (`layer_units`).
A unit is waited for in the forward pre-hook of the module that first reads its weights
(`wait_points`). `UnitWaits` is what those pre-hooks do: wait for the unit's upload (or, with
offload_params, its fetch) and time the compute lane around it. `ModelHooks` installs the
pre-hooks, the root's forward hooks, the state-dict hooks and the parameters'
post-accumulate-grad hooks, and removes them all again. The gradient hooks and state-dict hooks
are the coordinator's (`offload.adamw.OffloadedAdamW`); the torch-private calls are in
`llmscale.torch_internals`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmscale.offload.engine import Ticket
from llmscale.offload.host_adam import HostSlot
from llmscale.offload.lsp_linear import Sink, install
from llmscale.offload.params import ParamOffload, UnitParams
from llmscale.offload.timeline import COMPUTE_LANE, TransferTimeline
from llmscale.torch_internals import fsdp_gather_streams, in_backward

LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def layer_units(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Group parameter names into pipeline units, in the given (forward) order.

    Each `...layers.N` block is a unit; the parameters before the first block form "embed", those
    after the last block "head". A name may not come back to an earlier unit.
    """
    units: list[tuple[str, list[str]]] = []
    seen_layer = False
    for name in names:
        m = LAYER.match(name)
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


@dataclass(eq=False)
class Unit:
    """A group of parameters moved and updated together, and its pipeline state this step."""

    index: int
    name: str
    slots: list[HostSlot]
    fired: int = 0  # gradient hooks run this step
    final_submitted: bool = False  # norms (and, in backward, the update) are queued
    norm_future: Future[Any] | None = None
    upload: Future[Any] | None = None  # resolves to the unit's last upload Ticket
    modules: list[nn.Module] = field(default_factory=list)  # whose forward waits for it


def is_fsdp_module(m: nn.Module) -> bool:
    """Whether `m` was `fully_shard`-ed (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(m, FSDPModule)


def wait_points(model: nn.Module, unit: str, names: Sequence[str], sharded: bool) -> set[str]:
    """Names of the modules whose forward pre-hook waits for unit `unit` ("" = the root).

    Its block; the root for "embed" (the model may read those weights directly); the owning
    modules otherwise. Under FSDP2 the nearest `fully_shard`-ed module above the weights, whose
    own pre-forward hook all-gathers them.
    """
    if sharded:
        points = set()
        for name in names:
            path = name.rpartition(".")[0]
            while path and not is_fsdp_module(model.get_submodule(path)):
                path = path.rpartition(".")[0]
            points.add(path)
        return points
    if unit == "embed":
        return {""}
    m = LAYER.match(names[0])
    if m:
        return {m.group(1)}  # the whole block
    return {name.rpartition(".")[0] for name in names}


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for the parameters only (FSDP2 handles its sharded ones in `_apply`)."""
    if all(p.dtype == dtype for p in model.parameters()):
        return
    buffers = dict(model.named_buffers())
    model.to(dtype)
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b


class ModelHooks:
    """The hooks one offloaded optimizer holds on a model and its parameters; `remove()` all."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def on_grad(self, params: Iterable[nn.Parameter], fn: Callable[[torch.Tensor], None]) -> None:
        """`fn(param)` once each parameter's gradient has been accumulated."""
        self._handles += [
            p.register_post_accumulate_grad_hook(fn)  # type: ignore[no-untyped-call]  # torch: Tensor.register_post_accumulate_grad_hook unannotated
            for p in params
        ]

    def before_forward(self, module: nn.Module, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args, module, inputs)` before `module`'s forward, ahead of its other pre-hooks
        (under FSDP2: before its all-gather)."""
        self._handles.append(
            module.register_forward_pre_hook(functools.partial(fn, *args), prepend=True)
        )

    def after_forward(self, module: nn.Module, fn: Callable[..., None]) -> None:
        self._handles.append(module.register_forward_hook(fn))

    def state_dict(
        self,
        model: nn.Module,
        before_save: Callable[..., None],
        before_load: Callable[..., None],
        after_load: Callable[..., None],
        after_save: Callable[..., None] | None = None,
    ) -> None:
        """Around the model's `state_dict` and `load_state_dict`."""
        # (torch leaves these four Module.register_*_hook methods unannotated)
        self._handles.append(model.register_state_dict_pre_hook(before_save))  # type: ignore[no-untyped-call]
        self._handles.append(model.register_load_state_dict_pre_hook(before_load))  # type: ignore[no-untyped-call]
        self._handles.append(model.register_load_state_dict_post_hook(after_load))  # type: ignore[no-untyped-call]
        if after_save is not None:
            # (a partial: torch marks the hook object, which a bound method cannot carry)
            hook = functools.partial(after_save)
            self._handles.append(model.register_state_dict_post_hook(hook))  # type: ignore[no-untyped-call]

    def swap_forward(self, module: nn.Linear, sink: Sink) -> None:
        """Run `module` through `offload.lsp_linear`'s compressed weight gradient."""
        self._handles.append(install(module, sink))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class UnitWaits:
    """The wait points: before a unit's weights are read, its upload (or fetch) is waited for.

    Also the compute lane of the timeline: `cursor` marks where the running compute interval
    (a unit's forward or backward) began. `params`/`unit_params` are set under offload_params.
    """

    def __init__(
        self, units: list[Unit], timeline: TransferTimeline, step: Callable[[], int]
    ) -> None:
        self.units = units
        self.timeline = timeline
        self.step = step
        self.params: ParamOffload | None = None
        self.unit_params: list[UnitParams] = []
        self.cursor: Any = None  # compute-lane mark where the current compute interval began
        self.fwd_unit: int | None = None
        # After a unit's upload is waited for (LSP-Offload: decompress it into the weights)
        self.after_upload: Callable[[Unit], None] | None = None

    def compute(self, unit: str, phase: str, start: Any, end: Any) -> None:
        self.timeline.add(self.step(), unit, phase, COMPUTE_LANE, start, end)

    def close_interval(self, unit: str, phase: str) -> None:
        """End the running compute interval now, as `unit`'s `phase`."""
        now = self.timeline.stream_now()
        if self.cursor is not None:
            self.compute(unit, phase, self.cursor, now)

    def pre_forward_root(self, units: list[Unit], module: nn.Module, args: Any) -> None:
        if self.params is not None and not in_backward():
            self.params.start_forward()
        self.pre_forward(units, module, args)

    def pre_forward(self, units: list[Unit], module: nn.Module, args: Any) -> None:
        if not units:
            return
        if in_backward():  # recomputation inside backward: weights already waited for
            for u in units:
                if self.params is not None:
                    self.params.fetch(self.unit_params[u.index], "refetch")
                self.wait_unit(u)
            return
        now = self.timeline.stream_now()
        if self.fwd_unit is not None and self.cursor is not None:
            self.compute(self.units[self.fwd_unit].name, "forward", self.cursor, now)
        also = fsdp_gather_streams(module)
        for u in units:
            if self.params is not None:
                self.params.begin_unit(self.unit_params[u.index], args)
            self.wait_unit(u, self.timeline.stream_now(), also)
        self.cursor = self.timeline.stream_now()
        self.fwd_unit = units[0].index

    def post_forward_root(self, module: nn.Module, args: Any, output: Any) -> None:
        now = self.timeline.stream_now()
        if self.fwd_unit is not None and self.cursor is not None:
            self.compute(self.units[self.fwd_unit].name, "forward", self.cursor, now)
        if self.params is not None and not in_backward():
            self.params.end_forward(output)
        self.fwd_unit = None
        self.cursor = now

    def wait_unit(self, unit: Unit, start: Any = None, also: Sequence[Any] = ()) -> None:
        """Wait for `unit`'s last upload (its fetch under offload_params); timed from `start`."""
        if self.params is not None:  # the unit's parameter fetch (its update is waited by it)
            if self.params.wait(self.unit_params[unit.index]) and start is not None:
                self.compute(unit.name, "wait", start, self.timeline.stream_now())
            return
        fut, unit.upload = unit.upload, None
        if fut is None:
            return
        ticket: Ticket = fut.result()
        ticket.wait_stream(also)
        if self.after_upload is not None:
            self.after_upload(unit)
        if start is not None:
            self.compute(unit.name, "wait", start, self.timeline.stream_now())

    def wait_backward(self, up: UnitParams) -> None:
        """Before a unit's backward: wait for its parameters (timed on the compute lane)."""
        assert self.params is not None
        start = self.timeline.stream_now()
        if self.cursor is not None:
            self.compute(up.name, "backward", self.cursor, start)
        if self.params.wait(up):
            self.compute(up.name, "wait", start, self.timeline.stream_now())
        self.cursor = self.timeline.stream_now()
