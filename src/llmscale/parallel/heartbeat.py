"""Which rank stopped answering: a heartbeat per rank in the rendezvous store.

A collective that times out (gloo: "Timed out waiting ...ms for recv") or loses a peer ("Connection
closed by peer") does not say which rank is to blame; with hundreds of ranks that is the one
thing the user needs. So every rank runs a daemon thread that bumps a counter,
``heartbeat/<rank>``, in the job's rendezvous store (the c10d TCPStore torchrun's agent hosts)
every `interval` seconds. The thread runs beside the training loop, so a rank that computes,
saves a checkpoint or waits in a collective keeps beating; a rank that is dead (SIGKILL, a
crash) or stalled (SIGSTOP, a hung host) stops.

Two readers use the counters:

- `peer_lost(exc)`, when a collective raised: it watches the counters for a few intervals and
  names the ranks whose counter did not move: `JobStopped(..., ExitCode.PEER_LOST)`.
- the same thread, every interval: a rank whose counter has not moved for `monitor_after`
  seconds is lost even if no collective noticed: this rank then prints the message (the lowest
  rank still alive does) and leaves with exit code 4 at once (`os._exit`: the main thread is
  blocked inside a collective and cannot be interrupted). On gloo that is the timeout plus two
  intervals, a fallback behind gloo's own timeout error; under NCCL it is the timeout itself and
  the process group waits three intervals longer, so that the heartbeat, which can name the lost
  rank, acts before NCCL's watchdog tears the process down (SIGABRT, no name).

A rank the launcher stops (torch's agent sends SIGTERM to the survivors when one worker dies)
adds `DONE` to its counter before it dies of the signal (`_leave`; `note_signal` for a SIGTERM
the trainer's handler took during the loop), so that only the ranks that died on their own are
named, by the survivors and by the launcher (train/launch.py `job_outcome`), which would
otherwise also name every rank it had just stopped.

A rank stopped at once by a second Ctrl-C adds `INTERRUPTED` instead (`stop(interrupted=True)`):
its peers, which may have missed that Ctrl-C (two signals pending at once merge into one) and
now wait for it inside a collective, leave at once with its exit code 130 and print nothing
(the interrupted rank said why), instead of naming it as lost.

Staleness is measured on the reader's own clock (when it last saw a counter change), so the
hosts' clocks need not agree. A rank that finishes its run adds `DONE` to its counter, so that a
rank leaving early is never taken for a lost one. Counters are created with the store's atomic
`add`, read with one `multi_get` once every rank has written.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from llmscale.errors import ExitCode, JobStopped

KEY = "heartbeat/{rank}"
DONE = 10**12  # added to a counter when its rank finished: never stale again
INTERRUPTED = 10**15  # added when its rank stopped at once on a second Ctrl-C: peers leave too


def interval_for(timeout_seconds: float) -> float:
    """Seconds between beats: a tenth of the timeout, between 0.5 s and 5 s."""
    return min(5.0, max(0.5, timeout_seconds / 10))


class PeerLost(JobStopped):
    """A peer stopped answering: exit code 4; `reporter_rank` is the rank that prints it (the
    lowest rank still alive: rank 0 unless rank 0 is the one lost)."""

    def __init__(self, message: str, lost: list[int], reporter_rank: int) -> None:
        super().__init__(message, ExitCode.PEER_LOST)
        self.lost = lost
        self.reporter_rank = reporter_rank


class PeerInterrupted(JobStopped):
    """A peer stopped at once on a second Ctrl-C (`INTERRUPTED`): this rank stops too, exit
    130, and prints nothing (`reporter_rank` -1: no rank; the interrupted one said why)."""

    reporter_rank = -1

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"stopped at once with rank(s) {ranks} (Ctrl-C again)", ExitCode.SIGINT)
        self.ranks = ranks


class Heartbeat:
    """This rank's heartbeat thread and its view of every rank's counter."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_seconds: float,
        on_lost: Callable[[PeerLost], None] | None = None,
        monitor_after: float | None = None,
        on_interrupted: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout_seconds
        self.interval = interval_for(timeout_seconds)
        # Silence after which the thread itself ends the job (see `start`).
        self.monitor_after = (
            timeout_seconds + 2 * self.interval if monitor_after is None else monitor_after
        )
        self.on_lost = on_lost if on_lost is not None else _exit_lost
        self.on_interrupted = on_interrupted if on_interrupted is not None else _exit_interrupted
        self.keys = [KEY.format(rank=r) for r in range(world_size)]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._monitoring = True
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last changed)
        self._thread: threading.Thread | None = None

    # ---- writing --------------------------------------------------------------------------
    def start(self) -> Heartbeat:
        self.store.add(self.keys[self.rank], 1)
        self._thread = threading.Thread(target=self._run, name="llmscale-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, finished: bool = True, interrupted: bool = False) -> None:
        """End the thread; `finished` marks this rank as done (never stale for the others),
        `interrupted` as stopped at once by a second Ctrl-C (the others leave too)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
        if finished or interrupted:
            # Failing, the store's host is gone: nobody is left to ask.
            with contextlib.suppress(Exception):
                self.store.add(self.keys[self.rank], INTERRUPTED if interrupted else DONE)

    def pause_monitor(self) -> None:
        """The main thread handles a failure itself (`peer_lost`): the thread only beats."""
        with self._lock:
            self._monitoring = False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(self.keys[self.rank], 1)
                with self._lock:
                    if not self._monitoring:
                        continue
                lost = self._stale(self.monitor_after)
            except Exception:
                continue  # a store hiccup; the collectives' own timeouts still apply
            if self.interrupted_ranks():
                self.on_interrupted()
                return
            if lost:
                with self._lock:
                    if not self._monitoring:
                        continue
                    self._monitoring = False
                self.on_lost(self.lost_error(lost))
                return

    # ---- reading --------------------------------------------------------------------------
    def read(self) -> dict[int, int]:
        """Every rank's counter (0 for a rank that has not beaten yet)."""
        if self.store.check(self.keys):
            values = self.store.multi_get(self.keys)
            return {r: int(v) for r, v in enumerate(values)}
        return {r: int(self.store.add(k, 0)) for r, k in enumerate(self.keys)}

    def _observe(self) -> float:
        now = time.monotonic()
        for r, count in self.read().items():
            last = self._seen.get(r)
            if last is None or last[0] != count:
                self._seen[r] = (count, now)
        return now

    def _stale(self, older_than: float) -> list[int]:
        """Ranks whose counter has not changed for `older_than` seconds (this rank never)."""
        now = self._observe()
        return [
            r
            for r, (count, since) in sorted(self._seen.items())
            if r != self.rank and count < DONE and now - since > older_than
        ]

    def interrupted_ranks(self) -> list[int]:
        """Other ranks stopped at once by a second Ctrl-C, as last read (`INTERRUPTED`)."""
        return [
            r
            for r, (count, _) in sorted(self._seen.items())
            if r != self.rank and count >= INTERRUPTED
        ]

    def silent_ranks(self, window: float | None = None) -> list[int]:
        """Ranks whose counter does not move within `window` (3 intervals): the lost ones.

        Returns early once every other rank has moved.
        """
        window = 3 * self.interval if window is None else window
        self._observe()
        start = {r: count for r, (count, _) in self._seen.items()}
        moved = {self.rank} | {r for r, c in start.items() if c >= DONE}
        deadline = time.monotonic() + window
        while len(moved) < self.world_size and time.monotonic() < deadline:
            time.sleep(min(0.2, self.interval / 2))
            self._observe()
            moved |= {r for r, (c, _) in self._seen.items() if c != start[r]}
        return [r for r in range(self.world_size) if r not in moved]

    def silence(self, r: int) -> float:
        """Seconds since this rank last saw rank `r`'s counter move (0 when never watched)."""
        seen = self._seen.get(r)
        return time.monotonic() - seen[1] if seen is not None else 0.0

    def lost_error(self, lost: list[int]) -> PeerLost:
        alive = [r for r in range(self.world_size) if r not in lost]
        who = ("rank " if len(lost) == 1 else "ranks ") + ", ".join(map(str, lost))
        quiet = max(self.silence(r) for r in lost)
        return PeerLost(
            f"{who} of {self.world_size} stopped answering (no heartbeat for {quiet:.0f} s; "
            f"comm.timeout_seconds = {self.timeout:g}); the job stopped. Restart it with "
            "--resume to continue from the last checkpoint",
            lost,
            reporter_rank=min(alive) if alive else 0,
        )


def _exit_lost(e: PeerLost) -> None:
    """The thread's way out: the main thread is stuck in a collective, so print and leave now."""
    if int(os.environ.get("RANK", "0")) == e.reporter_rank:
        sys.stderr.write(f"llmscale train: {e}\n")
        sys.stderr.flush()
    os._exit(int(e.code))


def _exit_interrupted() -> None:
    """The thread's way out when a peer stopped at once on a second Ctrl-C: that rank printed
    why; this one leaves with the same code, now (its main thread may wait on that peer)."""
    os._exit(int(ExitCode.SIGINT))


# ---- the process's heartbeat (started by init_distributed) -----------------------------------

_current: Heartbeat | None = None


_signalled = 0  # a SIGTERM the trainer's handler took (note_signal), 0 = none
_previous_sigterm: Any = None


def note_signal(signum: int) -> None:
    """The trainer's SIGTERM handler saw `signum`: should a collective now fail, this process
    is being stopped, not losing a peer of its own (`peer_lost` leaves at once)."""
    global _signalled
    if signum == signal.SIGTERM:
        _signalled = signum


def _leave(signum: int, frame: Any = None) -> None:
    """SIGTERM outside the training loop (or after a collective failed under one): mark this
    rank as gone on purpose, so no peer names it, then die of the signal as by default."""
    hb = _current
    if hb is not None:
        with contextlib.suppress(Exception):
            hb.store.add(hb.keys[hb.rank], DONE)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def start(
    store: Any, rank: int, world_size: int, timeout_seconds: float, monitor_after: float | None
) -> Heartbeat:
    """Start this process's heartbeat (one per process group); `monitor_after`: see Heartbeat.
    Until `stop`, a SIGTERM outside the trainer's own handler is `_leave`."""
    global _current, _signalled, _previous_sigterm
    stop(finished=False)
    _signalled = 0
    _current = Heartbeat(
        store, rank, world_size, timeout_seconds, monitor_after=monitor_after
    ).start()
    with contextlib.suppress(ValueError):  # not the main thread: the default stays
        _previous_sigterm = signal.signal(signal.SIGTERM, _leave)
    # A daemon thread inside a store call when the interpreter finalises is unwound through
    # C++ frames, which can abort the process: end it first (a no-op once stopped).
    atexit.register(stop, False)
    return _current


def stop(finished: bool = True, interrupted: bool = False) -> None:
    global _current, _previous_sigterm
    if _current is not None:
        _current.stop(finished, interrupted)
        _current = None
    if _previous_sigterm is not None:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, _previous_sigterm)
        _previous_sigterm = None


# Texts of the errors gloo, NCCL and the store raise when a peer is gone or silent.
_PEER_ERRORS = (
    "timed out",
    "timeout",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "nccl",
    "gloo",
)


def is_peer_error(exc: BaseException) -> bool:
    """A collective's failure (timeout, lost connection), here or in any exception it wraps."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistError):
            return True
        if isinstance(e, RuntimeError) and any(t in str(e).lower() for t in _PEER_ERRORS):
            return True
        # DCP's CheckpointException keeps the ranks' exceptions in `failures`.
        for inner in getattr(e, "failures", {}).values() if hasattr(e, "failures") else ():
            if isinstance(inner, BaseException) and is_peer_error(inner):
                return True
        e = e.__cause__ or e.__context__
    return False


def peer_lost(exc: BaseException) -> PeerLost | PeerInterrupted | None:
    """The `PeerLost` error to raise for `exc`, when it is a collective's failure under a
    running heartbeat (`PeerInterrupted` when a peer stopped at once on a second Ctrl-C);
    None otherwise (the exception is not about a peer)."""
    hb = _current
    if hb is None or isinstance(exc, JobStopped) or not is_peer_error(exc):
        return None
    if _signalled:  # the launcher is stopping this job (a worker died): it names that worker
        _leave(_signalled)
    hb.pause_monitor()
    try:
        lost = hb.silent_ranks()
        interrupted = hb.interrupted_ranks()
        if interrupted:  # a peer stopped at once on Ctrl-C: so does this rank
            return PeerInterrupted(interrupted)
    except Exception:
        return PeerLost(
            "the rendezvous store stopped answering (the launcher on the first node is gone?) "
            f"after a collective failed: {str(exc).splitlines()[0][:200]}",
            [],
            reporter_rank=0,
        )
    if lost:
        return hb.lost_error(lost)
    first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return PeerLost(
        f"a collective failed but every rank's heartbeat is alive (a rank is stuck in its own "
        f"work, or the ranks disagree on the collective; comm.timeout_seconds = "
        f"{hb.timeout:g}): {first}",
        [],
        reporter_rank=0,
    )
