"""`offload = "optimizer+params"`: each unit's device parameters exist only while the unit runs.

Between uses a parameter keeps its tensor (its shape, its autograd identity, the references
autograd saved for backward) but its *storage* is resized to zero bytes, as FSDP1 frees a flat
parameter's storage; refilling it resizes the storage back and copies into it from the host
through an alias tensor (`storage_alias`), so the parameter's version counter does not move and
what autograd saved during forward is valid again in backward. A unit is

- fetched before its forward (the next unit prefetched: `prefetch` units ahead) and released when
  the next unit's forward begins. The last unit stays for the backward that starts with it (as
  FSDP2 keeps its root unsharded), unless another forward begins first (a pipeline's warm-up);
- fetched again before its backward, by a hook on the tensor the unit returned (the next unit's
  input, or the model's output), which fires when that tensor's gradient is complete: before
  any of the unit's backward, and before a recomputed (checkpointed) forward inside it. The unit
  before it is prefetched;
- released once every one of its parameters has its gradient of this backward pass (after the
  last use: autograd accumulates a parameter's gradient after every node that reads it), and in
  any case at the end of the backward pass (a callback queued on the autograd engine).

`resident` units (a tied embedding, read by the head too) are fetched at their forward and
kept until their gradient is in. A parameter read while released fails loudly (torch refuses a
tensor whose storage is too small), so a missed fetch cannot go unnoticed.

On CUDA a fetch allocates on the upload stream and copies there; the compute stream waits for
the copy's event. A release marks the storage as used by the current (compute) stream first
(`record_stream`), so the caching allocator does not hand the memory out before the kernels
already queued on it have read it (FSDP1 did the same). Elsewhere the copy runs on the upload
thread and a release waits for it.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llmscale.offload.engine import DONE, Copier, HostWorker, Ticket
from llmscale.offload.timeline import PARAMS_LANE, TransferTimeline
from llmscale.torch_internals import at_end_of_backward, graph_task_id


def storage_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s storage with its own version counter: writing it leaves `t`'s alone."""
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


def _done(value: Any) -> cf.Future[Any]:
    fut: cf.Future[Any] = cf.Future()
    fut.set_result(value)
    return fut


@dataclass(eq=False)
class Piece:
    """One parameter of a unit: its device tensor and the host tensor it is filled from."""

    device: torch.Tensor  # the rank's local tensor (shares the parameter's storage)
    host: torch.Tensor  # working dtype, on the host
    nbytes: int


@dataclass(eq=False)
class UnitParams:
    """One unit's device parameters and their state."""

    index: int
    name: str
    pieces: list[Piece]
    resident: bool = True
    keep: bool = False  # read outside its own unit: kept from its forward to its gradient
    fetch: cf.Future[Any] | None = None  # resolves to the last copy's Ticket
    since: Any = None  # timeline mark of the fetch
    grads: int = 0  # parameters of this unit whose gradient arrived this backward pass
    bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.bytes = sum(p.nbytes for p in self.pieces)


class ParamOffload:
    """Device storage of the units' parameters, present only while a unit is in use.

    `units` are in forward order. `pending_update(i)` is the future of unit i's host update (or
    None): a fetch waits for it, queued behind it on the host worker instead of blocking.
    """

    def __init__(
        self,
        units: Sequence[UnitParams],
        copier: Copier,
        worker: HostWorker,
        timeline: TransferTimeline,
        device: torch.device,
        step_index: Callable[[], int],
        pending_update: Callable[[int], cf.Future[Any] | None],
        prefetch: int = 1,
        on_wait: Callable[[UnitParams], None] | None = None,
    ) -> None:
        self.units = list(units)
        self.copier = copier
        self.worker = worker
        self.timeline = timeline
        self.device = device
        self.step_index = step_index
        self.pending_update = pending_update
        self.prefetch = prefetch
        self.on_wait = on_wait or self.wait  # the optimizer times the wait on its compute lane
        self.current: UnitParams | None = None  # the unit whose forward is running
        self.held: UnitParams | None = None  # the last unit, kept from its forward to its backward
        self._callback_task: int | None = None  # graph task whose end releases everything
        self.resident_bytes = sum(u.bytes for u in self.units if u.resident)
        self.peak_bytes = self.resident_bytes
        self.last_peak_bytes = self.peak_bytes
        seen: set[int] = set()
        for u in self.units:
            for p in u.pieces:
                _check_own_storage(p.device, u.name, seen)

    def start(self) -> None:
        """Release every unit (the parameters were on the device until now); peak from here."""
        self.release_all()
        self.peak_bytes = self.last_peak_bytes = self.resident_bytes

    # ---- storage ------------------------------------------------------------------------
    def fetch(self, u: UnitParams, phase: str) -> None:
        """Give `u` its storage and queue the copies into it (no wait); a no-op if resident."""
        if u.resident:
            return
        stream = getattr(self.copier, "stream", None)  # none when copies run inline
        if self.device.type == "cuda" and stream is not None:
            with torch.cuda.stream(stream):
                for p in u.pieces:
                    p.device.untyped_storage().resize_(p.nbytes)
        else:
            for p in u.pieces:
                p.device.untyped_storage().resize_(p.nbytes)
        u.resident = True
        u.since = self.timeline.stream_now()
        self.resident_bytes += u.bytes
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)
        step = self.step_index()
        update = self.pending_update(u.index)
        if update is not None and not update.done():
            u.fetch = self.worker.submit(self._copy_up, u, phase, step)
        else:
            if update is not None:
                update.result()  # surface a failed update here
            u.fetch = _done(self._copy_up(u, phase, step))

    def _copy_up(self, u: UnitParams, phase: str, step: int) -> Ticket:
        ticket: Ticket = DONE
        with torch.no_grad():
            for p in u.pieces:
                ticket = self.copier.copy(storage_alias(p.device), p.host, step, u.name, phase)
        return ticket

    def wait(self, u: UnitParams) -> bool:
        """Make the current stream wait for `u`'s copies; False when none was pending."""
        fut, u.fetch = u.fetch, None
        if fut is None:
            return False
        fut.result().wait_stream()
        return True

    def release(self, u: UnitParams) -> None:
        """Free `u`'s device storage (the tensors stay); a no-op when it has none."""
        if not u.resident:
            return
        fut, u.fetch = u.fetch, None
        if fut is not None:
            ticket = fut.result()  # the copy was issued: it writes into this storage
            if self.device.type != "cuda":
                ticket.wait()  # a copy thread is writing into it
        cuda = self.device.type == "cuda"
        for p in u.pieces:
            if cuda:
                p.device.record_stream(torch.cuda.current_stream(self.device))
            p.device.untyped_storage().resize_(0)
        u.resident = False
        u.grads = 0
        self.resident_bytes -= u.bytes
        if u.since is not None:
            now = self.timeline.stream_now()
            self.timeline.add(self.step_index(), u.name, "resident", PARAMS_LANE, u.since, now)
        u.since = None

    def release_all(self) -> None:
        """Release every resident unit."""
        self.held = None
        for u in self.units:
            self.release(u)

    def materialize(self) -> None:
        """Fetch every unit and wait for all copies (to read or load the parameters)."""
        for u in self.units:
            self.fetch(u, "fetch")
        for u in self.units:
            fut = u.fetch
            if fut is not None:
                fut.result().wait()

    def synchronize(self) -> None:
        """Wait for every queued copy (the units stay as they are)."""
        for u in self.units:
            if u.fetch is not None:
                u.fetch.result().wait()

    def end_step(self) -> None:
        """Close the step's peak (reported by `memory_report`) and start the next one."""
        self.last_peak_bytes = self.peak_bytes
        self.peak_bytes = self.resident_bytes

    # ---- forward ------------------------------------------------------------------------
    def start_forward(self) -> None:
        """The model's forward begins: fetch the first unit and prefetch after it."""
        self.current = None
        held, self.held = self.held, None
        if held is not None and not held.keep:
            self.release(held)  # its backward did not come first: fetched again for it
        if self.units:
            self._fetch_ahead(self.units[0].index - 1, +1, self.prefetch + 1)

    def begin_unit(self, u: UnitParams, args: Iterable[Any]) -> None:
        """`u`'s forward begins: the previous unit's is over (its output is among `args`)."""
        if u is self.current:
            return
        prev, self.current = self.current, u
        if prev is not None:
            if torch.is_grad_enabled():
                self._hook_backward(prev, args)
            if not prev.keep:
                self.release(prev)
        self.fetch(u, "fetch")
        self._fetch_ahead(u.index, +1, self.prefetch)

    def end_forward(self, output: Any) -> None:
        """The model's forward is over: the last unit's backward starts from `output`."""
        last, self.current = self.current, None
        grad = torch.is_grad_enabled()
        if last is not None and grad:
            self._hook_backward(last, (output,))
            self.held = last
        for u in self.units:
            if not (grad and (u.keep or u is last)):
                self.release(u)

    def _fetch_ahead(self, index: int, direction: int, count: int) -> None:
        by_index = {u.index: u for u in self.units}
        for k in range(1, count + 1):
            nxt = by_index.get(index + direction * k)
            if nxt is not None:
                self.fetch(nxt, "fetch" if direction > 0 else "refetch")

    # ---- backward -----------------------------------------------------------------------
    def _hook_backward(self, u: UnitParams, values: Iterable[Any]) -> None:
        for t in _tensors(values):
            if t.requires_grad:
                t.register_hook(lambda grad, u=u: self._pre_backward(u))  # type: ignore[no-untyped-call]  # torch: Tensor.register_hook unannotated

    def _pre_backward(self, u: UnitParams) -> None:
        task = graph_task_id()
        if task != self._callback_task:
            self._callback_task = task
            at_end_of_backward(self._end_backward)
        self.fetch(u, "refetch")
        self._fetch_ahead(u.index, -1, self.prefetch)
        self.on_wait(u)

    def grad_arrived(self, u: UnitParams) -> None:
        """One of `u`'s parameters has its gradient of this pass; the last one frees the unit."""
        u.grads += 1
        if u.grads >= len(u.pieces):
            self.release(u)

    def _end_backward(self) -> None:
        self._callback_task = None
        self.held = None
        self.release_all()
        for u in self.units:
            u.grads = 0


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
    return out


def _check_own_storage(t: torch.Tensor, unit: str, seen: set[int]) -> None:
    """A parameter whose storage is freed must own all of it, alone."""
    st = t.untyped_storage()
    if t.numel() == 0:
        return
    if (
        t.storage_offset() != 0
        or not t.is_contiguous()
        or st.nbytes() != t.numel() * t.element_size()
        or st.data_ptr() in seen
    ):
        raise ValueError(
            f"unit {unit!r}: a parameter does not own its storage (a view or a shared buffer); "
            "optimizer+params frees each parameter's storage between uses"
        )
    seen.add(st.data_ptr())
