"""Errors a user can cause; the CLI turns them into one-line messages and exit code 2."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad value for a named field, with what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}: got {value!r}; allowed: {allowed}")


class UsageError(ValueError):
    """A bad command line or environment that is not one config field (missing file, ...)."""
