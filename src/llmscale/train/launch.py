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

import logging
import os
import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from llmscale.errors import ExitCode

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


def job_exit_code(codes: dict[int, int]) -> int:
    """The job's exit code from each failed worker's (rank -> code; negative: killed by signal).

    The lowest rank with a meaningful code (2, 3, 4, 130, 143) decides: a worker killed by a
    peer's failure, or by the agent tearing the job down, says nothing about why it stopped.
    Otherwise 1 (a crash, a traceback).
    """
    for rank in sorted(codes):
        if codes[rank] in _MEANINGFUL:
            return codes[rank]
    return int(ExitCode.FAILURE) if any(codes.values()) else int(ExitCode.OK)


@contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent's own log lines (its SIGTERMs, its failure summary) are not the user's news."""
    log = logging.getLogger("torch.distributed.elastic")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
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
    )
    try:
        with _quiet_agent():
            elastic_launch(config, sys.executable)("-m", "llmscale", *argv)
    except ChildFailedError as e:
        return job_exit_code({rank: f.exitcode for rank, f in e.failures.items()})
    except SignalException as e:
        # The agent passed the signal on to the workers and waited for them (they save a
        # checkpoint and stop): exit as a signalled process does.
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 128 + int(signal.SIGINT)
    return int(ExitCode.OK)
