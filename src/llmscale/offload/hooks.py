"""Where the offload pipeline meets the model: units, wait points and the hooks installed on it.

A *unit* is a group of parameters moved and updated together: each transformer block, plus the
parameters before the first block ("embed") and after the last one ("head") (`layer_units`).
A unit is waited for in the forward pre-hook of the module that first reads its weights
(`wait_points`); `ModelHooks` installs those pre-hooks, the root's forward hooks, the
state-dict hooks and the parameters' post-accumulate-grad hooks, and removes them all again.
What the hooks do is the coordinator's (`offload.adamw.OffloadedAdamW`); the torch-private
calls they need are in `offload.torch_internals`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

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
        self._handles += [p.register_post_accumulate_grad_hook(fn) for p in params]

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
        self._handles.append(model.register_state_dict_pre_hook(before_save))
        self._handles.append(model.register_load_state_dict_pre_hook(before_load))
        self._handles.append(model.register_load_state_dict_post_hook(after_load))
        if after_save is not None:
            # (a partial: torch marks the hook object, which a bound method cannot carry)
            self._handles.append(model.register_state_dict_post_hook(functools.partial(after_save)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
