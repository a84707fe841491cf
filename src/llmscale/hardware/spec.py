"""Reading catalog TOML: every number must arrive with its source.

A number is written `{ value = 989.5, source = "h100" }`, where `source` is a key of the file's
[sources] table or a citation of its own (any text with a space or a URL). A bare number, a
number without a source, an unknown source key or an unknown field is a ConfigError that names
the file, the entry and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmscale.errors import ConfigError

SOURCED_FORM = '{ value = <number>, source = "<key of [sources] or a citation>" }'


@dataclass(frozen=True)
class Sourced:
    """A number and where it comes from."""

    value: float
    source: str


def resolve_source(where: str, source: object, sources: dict[str, str]) -> str:
    """The citation text for `source`: a [sources] key, or a citation given inline."""
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"{where}.source", source, "a non-empty citation or a key of [sources]")
    if source in sources:
        return sources[source]
    if " " in source.strip() or "://" in source:
        return source
    raise ConfigError(
        f"{where}.source",
        source,
        "a key of [sources] (" + ", ".join(sorted(sources)) + ") or a citation",
    )


def sourced(where: str, raw: object, sources: dict[str, str]) -> Sourced:
    """Parse one sourced number; a bare number is rejected."""
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, SOURCED_FORM)
    extra = set(raw) - {"value", "source"}
    if extra:
        raise ConfigError(f"{where}.{sorted(extra)[0]}", raw, SOURCED_FORM)
    value = raw.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.value", value, "a number")
    if value < 0:
        raise ConfigError(f"{where}.value", value, "a number >= 0")
    if "source" not in raw:
        raise ConfigError(f"{where}.source", None, "every number needs a source: " + SOURCED_FORM)
    return Sourced(float(value), resolve_source(where, raw["source"], sources))


class Entry:
    """One `[kind.name]` table; each read marks its key used, `done()` rejects the rest."""

    def __init__(self, where: str, table: object, sources: dict[str, str]) -> None:
        if not isinstance(table, dict):
            raise ConfigError(where, table, "a table of fields")
        self.where = where
        self.table: dict[str, Any] = table
        self.sources = sources
        self._used: set[str] = set()

    def _get(self, key: str, required: bool = True) -> Any:
        self._used.add(key)
        if key not in self.table:
            if required:
                raise ConfigError(f"{self.where}.{key}", None, "a value (the field is required)")
            return None
        return self.table[key]

    def text(self, key: str) -> str:
        v = self._get(key)
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{self.where}.{key}", v, "a non-empty string")
        return v

    def texts(self, key: str) -> tuple[str, ...]:
        v = self._get(key)
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ConfigError(f"{self.where}.{key}", v, "a list of non-empty strings")
        return tuple(v)

    def flag(self, key: str) -> bool:
        v = self._get(key)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}.{key}", v, "true or false")
        return v

    def number(self, key: str) -> Sourced:
        return sourced(f"{self.where}.{key}", self._get(key), self.sources)

    def optional_number(self, key: str) -> Sourced | None:
        raw = self._get(key, required=False)
        return None if raw is None else sourced(f"{self.where}.{key}", raw, self.sources)

    def numbers(self, key: str) -> dict[str, Sourced]:
        """A sub-table whose every value is a sourced number (e.g. peak FLOP/s per dtype)."""
        v = self._get(key)
        if not isinstance(v, dict) or not v:
            raise ConfigError(f"{self.where}.{key}", v, "a table of sourced numbers")
        return {k: sourced(f"{self.where}.{key}.{k}", x, self.sources) for k, x in v.items()}

    def done(self, allowed: str) -> None:
        extra = sorted(set(self.table) - self._used)
        if extra:
            raise ConfigError(f"{self.where}.{extra[0]}", self.table[extra[0]], allowed)


def read_sources(file: str, raw: dict[str, Any]) -> dict[str, str]:
    """The file's [sources] table: key -> citation text."""
    table = raw.get("sources", {})
    if not isinstance(table, dict) or not all(
        isinstance(v, str) and v.strip() for v in table.values()
    ):
        raise ConfigError(f"{file}: sources", table, 'a table of key = "citation"')
    return dict(table)


def entries(file: str, raw: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """The `[kind.*]` tables of a file (empty when it has none)."""
    table = raw.get(kind, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{file}: {kind}", table, f"tables [{kind}.<name>]")
    return table
