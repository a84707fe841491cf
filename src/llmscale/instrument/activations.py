"""What autograd keeps for backward: one forward's saved bytes and the most held at once.

- `SavedActivations` counts the bytes saved during a forward (the `activation_bytes` metric);
- `LiveActivations` follows every saved tensor until the graph node holding it is freed, and
  keeps the most held at once (`activation_peak_bytes`: a pipeline's micro-batches in flight);
- `ActivationMeter` is the trainer's one instrument per step, built from the two.

Both count through autograd's saved-tensor hooks. Torch runs only the innermost pair of hooks,
so the instruments entered are kept on one stack here and a single pack function serves them
all. Activation checkpointing keeps its region's inputs itself, outside those hooks (and runs
the region under hooks of its own): the checkpoint wrapper (`parallel/activation_checkpoint.py`)
reports the inputs (and the op outputs a selective policy stores) with `note_checkpoint_kept`,
the one call from there to here.

Like torch's hooks, an instrument counts the forwards run in the thread that entered it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from llmscale.tensors import local_tensor
from llmscale.torch_internals import is_wrapper_subclass

_StorageKey = tuple[int, int]

# The instruments entered, innermost last (entered and left in stack order).
_active: list[SavedActivations | LiveActivations] = []


def note_checkpoint_kept(args: Iterable[Any]) -> None:
    """Count what a checkpointed region keeps outside autograd's saved-tensor hooks: its tensor
    inputs (for its recompute) and the op outputs a selective policy stores (selective_op).

    Called by the checkpoint wrapper at each forward it runs; autograd's saved-tensor hooks do
    not see these tensors. A `LiveActivations` counts each until the tensor itself is freed.
    """
    if not _active:
        return
    for a in args:
        if isinstance(a, torch.Tensor):
            for inst in _active:
                inst.hold(a)


def _pack(t: torch.Tensor) -> Any:
    holds: list[tuple[LiveActivations, list[_StorageKey]]] = []
    for inst in _active:
        if isinstance(inst, LiveActivations):
            keys = inst._take(t)
            if keys:
                holds.append((inst, keys))
        else:
            inst.add(t)
    # Detached: an output a node saves (SDPA's, log_softmax's) would otherwise refer to that node
    # (its grad_fn) from its own saved slot, a cycle Python cannot collect, which only running the
    # node without retain_graph breaks (a split backward's B retains it; nodes W does not rerun
    # then lived on). Autograd re-attaches the grad_fn when it unpacks.
    return _Held(t.detach(), holds) if holds else t


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Held) else packed


class _Instrument:
    """Entering pushes the instrument on the stack and installs the shared saved-tensor hooks."""

    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._hooks: Any = None

    def hold(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        _active.append(self)  # type: ignore[arg-type]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        _active.remove(self)  # type: ignore[arg-type]


class SavedActivations(_Instrument):
    """Counts the bytes autograd keeps for backward while active (a forward pass).

    Each storage is counted once (views share one); parameters and buffers are left out, so what
    remains is activations. Tensors kept by checkpointed regions count as what the region keeps: its inputs
    (and, under an op-level policy, the op outputs it stores).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(exclude)
        self._seen: set[_StorageKey] = set()
        self.bytes = 0
        self.tensors = 0

    def add(self, t: torch.Tensor) -> None:
        for leaf in _plain_tensors(t):
            key = _storage_key(leaf)
            if key in self._excluded or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes += leaf.untyped_storage().nbytes()
            self.tensors += 1

    hold = add

    def __enter__(self) -> SavedActivations:
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._seen.clear()


class _Held:
    """What autograd keeps in place of a saved tensor while a `LiveActivations` watches."""

    __slots__ = ("__weakref__", "holds", "tensor")

    def __init__(
        self, tensor: torch.Tensor, holds: list[tuple[LiveActivations, list[_StorageKey]]]
    ) -> None:
        self.tensor, self.holds = tensor, holds

    def __del__(self) -> None:  # the graph node that saved it is gone (after its backward)
        for owner, keys in self.holds:
            owner._release(keys)


class LiveActivations(_Instrument):
    """The most activation bytes autograd held at once while active (forward and backward).

    A pipeline schedule runs several micro-batches' forwards before their backwards, so what a
    stage holds at its peak is the sum over the micro-batches in flight: the quantity the
    planner predicts with `inflight_units`. Every tensor autograd saves is counted from its
    save until the graph node holding it is freed (its backward ran), each storage once while
    any holder lives; parameters and buffers are left out, as in `SavedActivations`. A
    checkpointed region's inputs count until the tensor itself is freed.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(exclude)
        self._count: dict[_StorageKey, int] = {}
        self._nbytes: dict[_StorageKey, int] = {}
        self._lock = threading.RLock()  # backward may free graph nodes in autograd's threads
        self.bytes = 0
        self.peak_bytes = 0

    def _take(self, t: torch.Tensor) -> list[_StorageKey]:
        pieces = [
            (key, leaf.untyped_storage().nbytes())
            for leaf in _plain_tensors(t)
            if (key := _storage_key(leaf)) not in self._excluded
        ]
        with self._lock:
            for key, n in pieces:
                c = self._count.get(key, 0)
                self._count[key] = c + 1
                if c == 0:
                    self._nbytes[key] = n
                    self.bytes += n
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        return [k for k, _ in pieces]

    def _release(self, keys: list[_StorageKey]) -> None:
        with self._lock:
            for key in keys:
                c = self._count.get(key, 0) - 1
                if c > 0:
                    self._count[key] = c
                elif c == 0:
                    del self._count[key]
                    self.bytes -= self._nbytes.pop(key)

    def hold(self, t: torch.Tensor) -> None:
        """Count `t` until the tensor itself is freed."""
        keys = self._take(t)
        if keys:
            weakref.finalize(t, self._release, keys)

    def __enter__(self) -> LiveActivations:
        return super().__enter__()  # type: ignore[no-any-return]


class ActivationMeter:
    """One training step's activation metrics on this rank, over its model parts.

    `saved_bytes`: what the first micro-batch's forward saved, summed over the parts (the
    `activation_bytes` metric). Without pipelining the caller wraps micro-batch 0's forward and
    loss in `counting()`. Pipelined, entering the meter counts each part's first forward of the
    step (forward hooks) and, over the whole schedule, `peak_bytes`: the most held at once with
    several micro-batches in flight (`activation_peak_bytes`).
    """

    def __init__(self, parts: Sequence[nn.Module], pipelined: bool) -> None:
        self.parts = list(parts)
        self.pipelined = pipelined
        self.saved_bytes = 0
        self.peak_bytes: int | None = None
        self._exclude = [t for part in self.parts for t in model_state_tensors(part)]
        self._live: LiveActivations | None = None
        self._open: SavedActivations | None = None  # a part's first forward, while it runs
        self._hooks: list[Any] = []

    @contextlib.contextmanager
    def counting(self) -> Iterator[SavedActivations]:
        """Count what the block's forward saves; its bytes add to `saved_bytes`."""
        with SavedActivations(self._exclude) as counter:
            yield counter
        self.saved_bytes += counter.bytes

    def __enter__(self) -> ActivationMeter:
        if self.pipelined:
            self._live = LiveActivations(self._exclude).__enter__()
            for part in self.parts:
                self._hooks.extend(self._count_first_forward(part))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._open is not None:  # a forward that raised: its post-hook never ran
            self._open.__exit__(*exc)
            self._open = None
        if self._live is not None:
            self._live.__exit__(*exc)
            self.peak_bytes = self._live.peak_bytes
            self._live = None

    def _count_first_forward(self, part: nn.Module) -> list[Any]:
        """Hooks that count what `part`'s next forward saves, once per step."""
        done = False

        def pre(module: nn.Module, args: Any) -> None:
            if not done:
                self._open = SavedActivations(self._exclude).__enter__()

        def post(module: nn.Module, args: Any, output: Any) -> None:
            nonlocal done
            if not done and self._open is not None:
                self._open.__exit__(None, None, None)
                self.saved_bytes += self._open.bytes
                self._open = None
                done = True

        return [part.register_forward_pre_hook(pre), part.register_forward_hook(post)]


def model_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers, to exclude from activation counts."""
    return [*model.parameters(), *model.buffers()]


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The countable plain tensors behind `t`: none for parameters, meta or sparse tensors."""
    if is_wrapper_subclass(t) and not _is_parameter(t):
        # DTensor, AsyncCollectiveTensor (TP): the memory is in the plain tensors inside. A
        # DTensor parameter (FSDP's unsharded one under TP) is checked before unwrapping.
        attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]  # torch: a wrapper subclass's, not on Tensor's stubs
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


def _storage_key(t: torch.Tensor) -> _StorageKey:
    local = local_tensor(t)
    return (local.untyped_storage().data_ptr(), local.device.index or 0)


def storage_bytes(t: torch.Tensor) -> list[tuple[_StorageKey, int]]:
    """The storages behind `t` (a DTensor's local tensor, each plain piece once) and their
    bytes; none for parameters and meta tensors: what the pipeline's memory accounting counts
    (`parallel.pipeline.PipelineMemory`), keyed as the activation meter keys them."""
    return [(_storage_key(leaf), leaf.untyped_storage().nbytes()) for leaf in _plain_tensors(t)]
