"""Fault injection for the fault suite (tests/faults/): a rank that dies or stalls at a step.

`LLMSCALE_FAULT=ACTION:RANK:STEP` makes global rank RANK, right after optimizer step STEP (and
its checkpoint, when one is due), send itself SIGKILL (ACTION `kill`: a crash) or SIGSTOP
(`stop`: a hung rank, alive but silent). It fires on a job's first attempt only (torchrun's
`TORCHELASTIC_RESTART_COUNT` is 0 or unset), so that under `torchrun --max-restarts N` the
restarted workers run through. Unset (always, outside the tests), it does nothing.
"""

from __future__ import annotations

import os
import signal

ENV = "LLMSCALE_FAULT"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def maybe_inject(rank: int, step: int) -> None:
    """Signal this process when `LLMSCALE_FAULT` names this rank and step (first attempt)."""
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    action, want_rank, want_step = spec.split(":")
    if int(want_rank) == rank and int(want_step) == step:
        os.kill(os.getpid(), SIGNALS[action])
