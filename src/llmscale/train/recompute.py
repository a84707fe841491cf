"""Activation checkpointing (recomputation) and a counter of the bytes autograd saves.

Modes (train.recompute):
- none: every block keeps what autograd saves;
- selective: only the attention core (SDPA) is recomputed: it keeps q, k, v instead of its
  output and log-sum-exp (Korthikanti et al. 2022 recompute the core for the s x s matrix; with
  SDPA that matrix is never stored, so the saving is smaller, but the mode is the same);
- every_k: every k-th block (layers k-1, 2k-1, ...) is recomputed whole;
- full: every block is recomputed; only its input is kept.

Checkpointing uses `torch.utils.checkpoint` in its non-reentrant form. It is applied by replacing
a module's `forward` on the instance, so that parameter names (and so checkpoints) do not
change with the mode.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.checkpoint import checkpoint

from llmscale.model.transformer import AttentionCore, TransformerBlock
from llmscale.tensors import local_tensor

_state = threading.local()


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    counter: SavedActivations | None = getattr(_state, "counter", None)
    live: LiveActivations | None = getattr(_state, "live", None)
    # The checkpoint keeps its inputs alive for the recomputation; autograd hooks don't see them.
    for a in args:
        if isinstance(a, torch.Tensor):
            if counter is not None:
                counter.add(a)
            if live is not None:
                live.hold_until_freed(a)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _wrap(module: nn.Module) -> None:
    if getattr(module, "_llmscale_recompute", False):
        return
    module.forward = functools.partial(_checkpointed, module.forward)  # type: ignore[method-assign]
    module._llmscale_recompute = True  # type: ignore[assignment]


def apply_recompute(model: nn.Module, mode: str, every_k: int = 2) -> list[str]:
    """Checkpoint the parts that `mode` names; returns the names of the wrapped modules."""
    wrapped: list[str] = []
    if mode == "none":
        return wrapped
    for name, module in model.named_modules():
        if (
            mode == "selective"
            and isinstance(module, AttentionCore)
            or isinstance(module, TransformerBlock)
            and (mode == "full" or (mode == "every_k" and (module.layer_id + 1) % every_k == 0))
        ):
            pass
        else:
            continue
        _wrap(module)
        wrapped.append(name)
    return wrapped


def recompute_fraction(mode: str, n_layers: int, every_k: int = 2) -> float:
    """Share of the forward FLOPs run a second time (for MFU: recomputation is not useful work)."""
    if mode == "full":
        return 1.0
    if mode == "every_k":
        return (n_layers // every_k) / n_layers
    return 0.0  # selective: the attention core is a small share; counted by the planner


class SavedActivations:
    """Counts the bytes autograd keeps for backward while active (a forward pass).

    Each storage is counted once (views share one); parameters and buffers are left out, so what
    remains is activations. Tensors kept by checkpointed regions count as their inputs only.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._seen: set[tuple[int, int]] = set()
        self.bytes = 0
        self.tensors = 0
        self._hooks: Any = None

    def add(self, t: torch.Tensor) -> None:
        for leaf in _plain_tensors(t):
            key = _storage_key(leaf)
            if key in self._excluded or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes += leaf.untyped_storage().nbytes()
            self.tensors += 1

    def _pack(self, t: torch.Tensor) -> Any:
        self.add(t)
        # Hooks do not nest (the innermost pair alone runs): hand the tensor on to a
        # LiveActivations watching the whole step, if one is.
        live: LiveActivations | None = getattr(_state, "live", None)
        return live._pack(t) if live is not None else t

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, LiveActivations._unpack)
        self._hooks.__enter__()
        _state.counter = self
        return self

    def __exit__(self, *exc: object) -> None:
        _state.counter = None
        self._hooks.__exit__(*exc)
        self._seen.clear()


class _Held:
    """What autograd keeps in place of a saved tensor while `LiveActivations` watches."""

    __slots__ = ("__weakref__", "keys", "owner", "tensor")

    def __init__(self, tensor: torch.Tensor, keys: list[tuple[int, int]], owner: LiveActivations):
        self.tensor, self.keys, self.owner = tensor, keys, owner

    def __del__(self) -> None:  # the graph node that saved it is gone (after its backward)
        self.owner._release(self.keys)


class LiveActivations:
    """The most activation bytes autograd held at once while active (forward and backward).

    A pipeline schedule runs several micro-batches' forwards before their backwards, so what a
    stage holds at its peak is the sum over the micro-batches in flight: the quantity the
    planner predicts with `inflight_units`. Every tensor autograd saves is counted from its
    save until the graph node holding it is freed (its backward ran), each storage once while
    any holder lives; parameters and buffers are left out, as in `SavedActivations`. A
    checkpointed region's inputs count until the tensor itself is freed.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._count: dict[tuple[int, int], int] = {}
        self._nbytes: dict[tuple[int, int], int] = {}
        self._lock = threading.RLock()
        self.bytes = 0
        self.peak_bytes = 0
        self._hooks: Any = None

    def _keys(self, t: torch.Tensor) -> list[tuple[tuple[int, int], int]]:
        out: list[tuple[tuple[int, int], int]] = []
        for leaf in _plain_tensors(t):
            key = _storage_key(leaf)
            if key not in self._excluded:
                out.append((key, leaf.untyped_storage().nbytes()))
        return out

    def _take(self, t: torch.Tensor) -> list[tuple[int, int]]:
        pieces = self._keys(t)
        with self._lock:
            for key, n in pieces:
                c = self._count.get(key, 0)
                self._count[key] = c + 1
                if c == 0:
                    self._nbytes[key] = n
                    self.bytes += n
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        return [k for k, _ in pieces]

    def _release(self, keys: list[tuple[int, int]]) -> None:
        with self._lock:
            for key in keys:
                c = self._count.get(key, 0) - 1
                if c > 0:
                    self._count[key] = c
                elif c == 0:
                    del self._count[key]
                    self.bytes -= self._nbytes.pop(key)

    def hold_until_freed(self, t: torch.Tensor) -> None:
        keys = self._take(t)
        if keys:
            weakref.finalize(t, self._release, keys)

    def _pack(self, t: torch.Tensor) -> Any:
        keys = self._take(t)
        return _Held(t, keys, self) if keys else t

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def __enter__(self) -> LiveActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _state.live = self
        return self

    def __exit__(self, *exc: object) -> None:
        _state.live = None
        self._hooks.__exit__(*exc)


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The countable plain tensors behind `t`: none for parameters, meta or sparse tensors."""
    if is_traceable_wrapper_subclass(t) and not _is_parameter(t):
        # DTensor, AsyncCollectiveTensor (TP): the memory is in the plain tensors inside. A
        # DTensor parameter (FSDP's unsharded one under TP) is checked before unwrapping.
        attrs, _ = t.__tensor_flatten__()
        out: list[torch.Tensor] = []
        for a in attrs:
            inner = getattr(t, a)
            if isinstance(inner, torch.Tensor):
                out.extend(_plain_tensors(inner))
        return out
    if t.device.type == "meta" or t.layout != torch.strided or _is_parameter(t):
        return []
    return [t]


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (matmul saves weight.t())."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    local = local_tensor(t)
    return (local.untyped_storage().data_ptr(), local.device.index or 0)


def model_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers, to exclude from activation counts."""
    return [*model.parameters(), *model.buffers()]
