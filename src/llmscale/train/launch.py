"""`llmscale train --nproc-per-node N`: N local workers, started by torch's elastic agent.

The same agent torchrun runs (`torch.distributed.launcher.elastic_launch`, standalone: a c10d
rendezvous on a free local port), run inside this process rather than as the `torchrun` script,
so that what the user sees is llmscale's: the config and the memory check are validated once,
here, before any worker starts (bad input: one line, exit code 2); the workers print as under a
bare torchrun (only rank 0 says why a run stopped); and the command exits with the workers'
code (`errors.ExitCode`: 3 diverged, 4 a peer stopped answering, ...) instead of torchrun's 1
and its `ChildFailedError` traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from llmscale.errors import ExitCode

if TYPE_CHECKING:
    from llmscale.config import JobConfig

# One signal delivered to the launcher and to its workers together (a terminal's process group,
# a scheduler signalling every process of a job step) reaches each worker twice: directly and
# forwarded by the launcher. This launcher counts each SIGINT it forwards in a file named by
# $LLMSCALE_FORWARDED_SIGINTS (one byte each, written before the copy is sent), so a worker
# tells a second Ctrl-C from a forwarded copy of the first (`direct_sigints`). Under another
# launcher (torchrun), a worker takes a repeat within SAME_SIGNAL_SECONDS as the same one: the
# agent forwards it only once its monitor loop has woken and it has begun shutting the workers
# down, and the worker's handler runs only between Python bytecodes (not inside a backward
# pass or a save), so on a loaded machine the two can be seconds apart.
SAME_SIGNAL_SECONDS = 5.0
FORWARDED_SIGINTS_ENV = "LLMSCALE_FORWARDED_SIGINTS"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def under_launcher() -> bool:
    """This process is a worker of torch's elastic agent (this launcher, or torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def direct_sigints(received: int) -> int | None:
    """Of the `received` SIGINTs a worker of this launcher has seen, how many came directly
    rather than forwarded by the launcher; None under another launcher or none (no count)."""
    path = os.environ.get(FORWARDED_SIGINTS_ENV)
    if not path or not under_launcher():
        return None
    try:
        forwarded = os.stat(path).st_size
    except OSError:  # the launcher is gone, and with it the count
        return None
    return received - forwarded


def second_ctrl_c(received: int, since_first: float) -> bool:
    """Whether a worker's `received`-th SIGINT, `since_first` seconds after the one that asked
    for a stop, is a second Ctrl-C rather than a copy of the first: counted under this
    launcher (a second direct one, `direct_sigints`), timed under another (none within
    SAME_SIGNAL_SECONDS), always without a launcher."""
    direct = direct_sigints(received)
    if direct is not None:
        return direct >= 2
    return not (under_launcher() and since_first < SAME_SIGNAL_SECONDS)


def ctrl_c_again_wait() -> str:
    """What the stop notice says to wait before a second Ctrl-C counts ("" when nothing)."""
    timed = under_launcher() and direct_sigints(0) is None
    return f"after {SAME_SIGNAL_SECONDS:g} s " if timed else ""


_COUNT_PREFIX = "llmscale-sigint-"  # the count file's name: this prefix, the launcher's pid, -


def _remove_stale_counts(directory: Path) -> None:
    """Delete the count files in `directory` that launchers no longer running left there (a
    launcher killed with SIGKILL cannot remove its own)."""
    for path in directory.glob(f"{_COUNT_PREFIX}*-*"):
        pid = path.name[len(_COUNT_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that launcher is still running
        except ProcessLookupError:
            pass
        except OSError:  # another user's process: alive
            continue
        with suppress(OSError):  # another user's file, or removed meanwhile
            path.unlink()


@contextmanager
def _counted_sigint_forwarding() -> Iterator[None]:
    """The launcher's SIGINT handler for the launch: the first SIGINT is counted in a file the
    workers read (`direct_sigints`), then handed to the agent as its own handler would
    (SignalException: it forwards the signal to the workers and waits for them to save and
    stop). Later ones are left to the workers: a terminal's Ctrl-C reaches them directly."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    _remove_stale_counts(Path(tempfile.gettempdir()))
    fd, path = tempfile.mkstemp(prefix=f"{_COUNT_PREFIX}{os.getpid()}-")
    os.close(fd)
    saved_env = os.environ.get(FORWARDED_SIGINTS_ENV)
    forwarded = [0]

    def handler(signum: int, frame: Any) -> None:
        if forwarded[0]:
            return
        forwarded[0] += 1
        with open(path, "ab") as f:
            f.write(b"1")
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.SIGINT)

    os.environ[FORWARDED_SIGINTS_ENV] = path
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: the agent registers no handler either
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if saved_env is None:
            os.environ.pop(FORWARDED_SIGINTS_ENV, None)
        else:
            os.environ[FORWARDED_SIGINTS_ENV] = saved_env
        Path(path).unlink(missing_ok=True)


def die_with_launcher() -> bool:
    """A worker gets SIGTERM when its launcher dies (Linux's parent-death signal), and so stops
    after a checkpoint, as on a SIGTERM to the job, instead of training on as an orphan that
    holds the run folder. True when set (Linux, under a launcher)."""
    if not (sys.platform.startswith("linux") and under_launcher()):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)
    return True


# In the job's store (kept across the launcher's restarts): the run folder this job claimed.
CLAIMED_KEY = "llmscale/claimed-run-dir"


def restart_attempt() -> int:
    """Which attempt of the job this worker belongs to (0: the first; more under --max-restarts)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def resume_own_run(cfg: JobConfig, store: Any) -> bool:
    """Under --max-restarts, a restarted attempt continues the run its first attempt claimed
    (recorded in the job's store by `mark_claimed`), resuming from its newest checkpoint, even
    without --resume (and never overwriting it again under --overwrite): the restart is not a
    rerun. False (cfg untouched) on a first attempt, or when no attempt of this job claimed the
    folder (the first one was refused: the same refusal comes again)."""
    if restart_attempt() == 0 or store is None or cfg.checkpoint.resume:
        return False
    try:
        if not store.check([CLAIMED_KEY]):
            return False
        claimed = store.get(CLAIMED_KEY).decode()
    except Exception:  # the store is gone: nothing to go by
        return False
    if claimed != str(Path(cfg.job.run_dir).resolve()):
        return False
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, resume=True)
    cfg.job = dataclasses.replace(cfg.job, overwrite=False)
    return True


def mark_claimed(cfg: JobConfig, store: Any) -> None:
    """Rank 0, once the run folder is this job's: restarted attempts resume it."""
    if store is not None and under_launcher():
        store.set(CLAIMED_KEY, str(Path(cfg.job.run_dir).resolve()))


# Exit codes that say more than "a worker failed": the first worker to exit with one of them
# decides the job's code.
_MEANINGFUL = {int(c) for c in ExitCode} - {int(ExitCode.OK), int(ExitCode.FAILURE)}


def worker_argv(argv: Sequence[str], launcher_flags: Sequence[str]) -> list[str]:
    """`argv` (the `train` command's arguments) without the launcher's own flags and values."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in launcher_flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


class WorkerExit(NamedTuple):
    """How one worker ended: its exit code (negative: killed by that signal) and when (s)."""

    code: int
    time: float


def job_outcome(exits: dict[int, WorkerExit]) -> tuple[int, str | None]:
    """The job's exit code from its failed workers (by global rank), and a message to print
    when no worker printed one.

    The lowest rank that exited with a meaningful code (2, 3, 4, 130, 143) decides; that
    worker printed why. Otherwise, when the first worker to fail was killed by a signal (the
    agent then stops the others before they can say which peer they lost), the job lost a
    peer: code 4, naming it. Otherwise 1: a crash, whose traceback the worker printed.
    """
    for rank in sorted(exits):
        if exits[rank].code in _MEANINGFUL:
            return exits[rank].code, None
    failed = {r: e for r, e in exits.items() if e.code != 0}
    if not failed:
        return int(ExitCode.OK), None
    # The agent stops the survivors with SIGTERM: of two failures in the same second (the
    # agent's timestamps are whole seconds), theirs is not the cause.
    first = min(failed, key=lambda r: (failed[r].time, failed[r].code == -signal.SIGTERM, r))
    code = failed[first].code
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return int(ExitCode.PEER_LOST), (
            f"rank {first} of the job died ({name}); the job stopped. Restart it with "
            "--resume to continue from the last checkpoint"
        )
    return int(ExitCode.FAILURE), None


@contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent's own log lines (its SIGTERMs, its failure summary) are not the user's news.

    Each of torch's elastic modules sets its logger's level itself (from $LOGLEVEL), so every
    such logger is raised to CRITICAL for the launch, not only their parent.
    """
    names = [
        n
        for n in logging.root.manager.loggerDict
        if n.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))
    ]
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def launch_local(nproc: int, argv: Sequence[str], max_restarts: int = 0) -> int:
    """Run `python -m llmscale <argv>` as `nproc` workers of one standalone job; its exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # As torchrun does: one thread per worker unless the user said otherwise.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        # The agent's own handlers: SIGINT is `_counted_sigint_forwarding`'s.
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",
    )
    try:
        with _quiet_agent(), _counted_sigint_forwarding():
            elastic_launch(config, sys.executable)("-m", "llmscale", *argv)
    except ChildFailedError as e:
        exits = {r: WorkerExit(f.exitcode, f.timestamp) for r, f in e.failures.items()}
        code, message = job_outcome(exits)
        if message:
            sys.stderr.write(f"llmscale train: {message}\n")
        return code
    except SignalException as e:
        # The agent passed the signal on to the workers and waited for them (they save a
        # checkpoint and stop): exit as a signalled process does.
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 128 + int(signal.SIGINT)
    return int(ExitCode.OK)
