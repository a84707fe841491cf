"""Where the offload pipeline's copies and host work run.

Two kinds of agent, each with a serial (FIFO) queue:
- a *copier* per direction (device-to-host gradients, host-to-device parameters). On CUDA it is a
  side stream: `copy` launches a non-blocking copy between pinned host memory and the device
  and returns at once; completion is an event. Elsewhere it is one worker thread per direction,
  so the same pipeline runs (and is tested) on a CPU-only host. `InlineCopier` copies at once on
  the calling thread: the no-overlap baseline.
- a *host worker* for the CPU side of the update (accumulate, norms, Adam, cast): one thread,
  or inline.

A copy returns a `Ticket`: `wait()` blocks the calling host thread until the copy is done;
`wait_stream(also)` makes the current device stream, and the streams in `also`, wait for it (on
CUDA without blocking the host). FIFO order matters: a unit's last ticket done means all its earlier copies are done.

Every copier counts the bytes it is asked to copy (`src.nbytes`, at the moment `copy` is called,
before the copy runs) on a `TrafficMeter` shared by both directions: the metrics row's
`offload_bytes_moved` (docs/offload.md, "Bytes moved").
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor, Shard

from llmscale.offload.timeline import TransferTimeline


class Ticket(Protocol):
    def wait(self) -> None: ...

    def wait_stream(self, also: Sequence[Any] = ()) -> None: ...


class DoneTicket:
    """A copy that has already finished."""

    def wait(self) -> None:
        return None

    def wait_stream(self, also: Sequence[Any] = ()) -> None:
        return None


DONE = DoneTicket()


class FutureTicket:
    """A copy running on a worker thread."""

    def __init__(self, future: cf.Future[Any]) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()

    def wait_stream(self, also: Sequence[Any] = ()) -> None:
        self.future.result()  # the host waits: every stream after it is ordered


class CudaTicket:
    """A copy queued on a CUDA stream; `event` is recorded right after it."""

    def __init__(self, event: Any, device: torch.device) -> None:
        self.event = event
        self.device = device

    def wait(self) -> None:
        self.event.synchronize()

    def wait_stream(self, also: Sequence[Any] = ()) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)
        for stream in also:
            stream.wait_event(self.event)


class TrafficMeter:
    """Bytes copied between device and host, both directions, since the last `reset`.

    Copies are counted when they are issued, on whatever thread issues them (the training
    thread's downloads, the host worker's uploads), hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._by_lane: dict[str, int] = {}

    def add(self, lane: str, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes
            self._by_lane[lane] = self._by_lane.get(lane, 0) + nbytes

    def reset(self) -> None:
        with self._lock:
            self._bytes = 0
            self._by_lane = {}

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def by_lane(self) -> dict[str, int]:
        """Bytes per copier lane ("d2h", "h2d") since the last reset."""
        with self._lock:
            return dict(self._by_lane)


class Copier(Protocol):
    lane: str
    meter: TrafficMeter

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, step: int, unit: str, phase: str
    ) -> Ticket: ...

    def close(self) -> None: ...


class Link:
    """A simulated link of `bytes_per_s`: copies queue on it, each taking nbytes / bandwidth.

    Deadlines run from the previous copy's deadline, not from when the thread woke up, so a
    late wake-up (a loaded host) is absorbed rather than added to every copy.
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._busy_until = 0.0

    def wait(self, started: float, nbytes: int) -> None:
        """Sleep until a copy of `nbytes` begun at `started` would have left the link."""
        done = max(started, self._busy_until) + nbytes / self.bytes_per_s
        self._busy_until = done
        remaining = done - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def _throttle(link: Link | None, started: float, nbytes: int) -> None:
    if link is not None:
        link.wait(started, nbytes)


class InlineCopier:
    """Copies at once on the calling thread (the no-overlap baseline)."""

    def __init__(
        self,
        lane: str,
        timeline: TransferTimeline | None,
        link_bytes_per_s: float | None = None,
        meter: TrafficMeter | None = None,
    ) -> None:
        self.lane = lane
        self.timeline = timeline
        self.link = Link(link_bytes_per_s) if link_bytes_per_s else None
        self.meter = meter if meter is not None else TrafficMeter()

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, step: int, unit: str, phase: str
    ) -> Ticket:
        self.meter.add(self.lane, src.nbytes)
        return self._copy(dst, src, step, unit, phase)

    def _copy(
        self, dst: torch.Tensor, src: torch.Tensor, step: int, unit: str, phase: str
    ) -> Ticket:
        t0 = time.perf_counter()
        dst.copy_(src)
        _throttle(self.link, t0, src.nbytes)
        if self.timeline is not None:
            self.timeline.add(step, unit, phase, self.lane, t0, time.perf_counter())
        return DONE

    def close(self) -> None:
        return None


class ThreadCopier(InlineCopier):
    """One worker thread per direction: the CPU-host stand-in for a copy engine.

    Each copy is `InlineCopier.copy`, run on the thread. `link_bytes_per_s` makes each copy last
    at least as long as it would over a link of that bandwidth (sleeping, so the cores stay
    free): a way to see on a CPU host how much of a PCIe-like transfer the pipeline hides.
    """

    def __init__(
        self,
        lane: str,
        timeline: TransferTimeline | None,
        link_bytes_per_s: float | None = None,
        meter: TrafficMeter | None = None,
    ) -> None:
        super().__init__(lane, timeline, link_bytes_per_s, meter)
        # Copies are memory-bound; one intra-op thread each keeps them off compute's cores.
        self._pool = cf.ThreadPoolExecutor(
            1,
            thread_name_prefix=f"llmscale-{lane}",
            initializer=torch.set_num_threads,
            initargs=(1,),
        )

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, step: int, unit: str, phase: str
    ) -> Ticket:
        self.meter.add(self.lane, src.nbytes)  # counted when issued, as on the other copiers
        return FutureTicket(self._pool.submit(self._copy, dst, src, step, unit, phase))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaCopier:
    """A side stream for one copy direction, with pinned host buffers on the other end.

    Device-to-host copies first wait for the compute stream as it is when the copy is issued
    (the gradient was produced there); the source's memory is then recorded on the side stream
    so the caching allocator does not reuse it before the copy has read it. Host-to-device copies
    do not wait for compute: their destination is a parameter no kernel will read again until
    the next forward, which waits for the copy's event.
    """

    def __init__(
        self,
        lane: str,
        device: torch.device,
        timeline: TransferTimeline | None,
        meter: TrafficMeter | None = None,
    ) -> None:
        self.lane = lane
        self.device = device
        self.timeline = timeline
        self.meter = meter if meter is not None else TrafficMeter()
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch: cuda.Stream unannotated

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, step: int, unit: str, phase: str
    ) -> Ticket:
        self.meter.add(self.lane, src.nbytes)
        if self.lane == "d2h":
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        timing = self.timeline is not None
        start = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]  # torch: cuda.Event unannotated
        end = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]  # torch: cuda.Event unannotated
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            end.record(self.stream)
        if src.is_cuda:
            src.record_stream(self.stream)
        if self.timeline is not None:
            self.timeline.add(step, unit, phase, self.lane, start, end)
        return CudaTicket(end, self.device)

    def close(self) -> None:
        self.stream.synchronize()


class HostWorker(Protocol):
    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]: ...

    def close(self) -> None: ...


class InlineWorker:
    """Runs host work at once on the calling thread; returns a finished future."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # surfaced by .result(), as a thread's would be
            fut.set_exception(e)
            raise
        return fut

    def close(self) -> None:
        return None


class ThreadWorker:
    """One host thread for the CPU side of the update, fed in FIFO order.

    `intra_op_threads` caps the threads its kernels use (torch's setting is per thread): on a
    CUDA host the update should have the cores (None: torch's default); on a CPU host the
    cores belong to compute, which it overlaps, and oversubscribing them costs both.
    """

    def __init__(self, intra_op_threads: int | None = None) -> None:
        name = "llmscale-cpu-adam"
        if intra_op_threads:
            self._pool = cf.ThreadPoolExecutor(
                1, name, initializer=torch.set_num_threads, initargs=(intra_op_threads,)
            )
        else:
            self._pool = cf.ThreadPoolExecutor(1, name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def make_agents(
    device: torch.device,
    overlap: bool,
    timeline: TransferTimeline | None,
    link_bytes_per_s: float | None = None,
) -> tuple[Copier, Copier, HostWorker]:
    """(download copier, upload copier, host worker) for a device and an overlap setting.

    Both copiers count on one `TrafficMeter` (`copier.meter`).
    """
    meter = TrafficMeter()
    if not overlap:
        return (
            InlineCopier("d2h", timeline, link_bytes_per_s, meter),
            InlineCopier("h2d", timeline, link_bytes_per_s, meter),
            InlineWorker(),
        )
    if device.type == "cuda":
        return (
            CudaCopier("d2h", device, timeline, meter),
            CudaCopier("h2d", device, timeline, meter),
            ThreadWorker(),
        )
    return (
        ThreadCopier("d2h", timeline, link_bytes_per_s, meter),
        ThreadCopier("h2d", timeline, link_bytes_per_s, meter),
        ThreadWorker(intra_op_threads=1),
    )


def issued_bytes(copiers: Sequence[Copier], worker: HostWorker) -> int:
    """Bytes the copiers' meter(s) counted since their reset, once every host task queued so
    far has run: the host updates issue their uploads (and queued parameter fetches) from the
    worker, so this waits for them to be *issued*, not for the copies to finish."""
    worker.submit(_noop).result()
    meters = {id(c.meter): c.meter for c in copiers}
    return sum(m.bytes for m in meters.values())


def reset_meters(copiers: Sequence[Copier]) -> None:
    for c in copiers:
        c.meter.reset()


def _noop() -> None:
    return None


def fsdp_cpu_offload_bytes(
    model_parts: Sequence[torch.nn.Module], n_microbatches: int, reshard: bool
) -> int:
    """Bytes FSDP2's `CPUOffloadPolicy` copies between device and host in one optimizer step.

    FSDP2 makes these copies itself (not through a copier), so they are computed from what it
    copies (torch 2.13, `FSDPParam.all_gather_inputs` and `foreach_reduce`):
    - host to device, at every all-gather: each parameter's *padded* local shard in its own
      dtype (fp32; cast to the compute dtype after the copy). A unit is all-gathered before its
      forward in every micro-step, and again before its backward when it was resharded after
      forward (`reshard`: fully_shard with zero_stage 3, which passes reshard_after_forward=True
      to every unit, the root included);
    - device to host, once per step (gradient sync is on for the last micro-step only): each
      parameter's reduce-scattered gradient shard (unpadded) in the parameter's dtype.
    A unit is a `fully_shard`-ed (or replicated) module and the parameters under it that no
    inner such module holds.
    """
    from llmscale.offload.hooks import is_fsdp_module  # same layer; hooks imports engine

    total = 0
    for part in model_parts:
        units = [(name, m) for name, m in part.named_modules() if is_fsdp_module(m)]
        inner = {name for name, _ in units if name}
        for name, mod in units:
            prefix = f"{name}." if name else ""
            own = [
                p
                for pname, p in mod.named_parameters()
                if not any(f"{prefix}{pname}".startswith(f"{i}.") for i in inner if i != name)
            ]
            gathers = n_microbatches * (2 if reshard else 1)
            for p in own:
                local = p.to_local() if isinstance(p, DTensor) else p
                total += gathers * _padded_shard_numel(p) * p.element_size()
                total += local.numel() * p.element_size()
    return total


def _padded_shard_numel(p: torch.Tensor) -> int:
    """Elements of a parameter's local shard as FSDP2 pads it: ceil(rows / shards of dim 0)
    rows of the local row width (a plain tensor: all of it)."""
    if not isinstance(p, DTensor) or p.dim() == 0:
        return p.numel()
    shards = 1
    for placement, size in zip(p.placements, p.device_mesh.shape, strict=True):
        if isinstance(placement, Shard) and placement.dim == 0:
            shards *= size
    width = math.prod(p.to_local().shape[1:])
    return int(-(-p.shape[0] // shards) * width)
