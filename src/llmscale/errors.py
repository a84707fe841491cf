"""Errors a user can cause; the CLI turns them into one-line messages and exit code 2."""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    """What `llmscale` (and each worker under torchrun) exits with; the README lists them."""

    OK = 0
    FAILURE = 1  # an unexpected error: a traceback, a bug
    BAD_INPUT = 2  # ConfigError / UsageError: one line naming the field, the value, what is allowed
    DIVERGED = 3  # the loss or gradient norm stayed non-finite (train.max_bad_steps)
    PEER_LOST = 4  # a peer rank stopped answering within comm.timeout_seconds
    SIGINT = 130  # stopped by SIGINT (Ctrl-C), after saving a checkpoint
    SIGTERM = 143  # stopped by SIGTERM (e.g. a scheduler's preemption), after saving a checkpoint


class ConfigError(ValueError):
    """A bad value for a named field, with what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}: got {value!r}; allowed: {allowed}")


class UsageError(ValueError):
    """A bad command line or environment that is not one config field (missing file, ...)."""


class JobStopped(Exception):
    """A run that ends early on purpose: the CLI prints `message` as one line (rank 0 only
    under torchrun) and exits with `code` (ExitCode.DIVERGED, PEER_LOST, SIGINT, SIGTERM)."""

    def __init__(self, message: str, code: ExitCode) -> None:
        self.code = code
        super().__init__(message)
