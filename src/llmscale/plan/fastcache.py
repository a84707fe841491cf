"""A memo for the planner's hot helpers, keyed by object identity for non-primitive arguments.

`functools.lru_cache` hashes every argument on every call; the planner's arguments are frozen
dataclasses of twenty fields (ModelConfig, Kernels, Fabric), and hashing them dominated the
search. Here such arguments are keyed by `id()`. That is safe because the cache keeps every
argument it has seen alive, so no other object can take the same id while the entry exists;
equal but distinct objects only miss. Positional arguments only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

_PRIMITIVE = frozenset((int, float, str, bool, type(None)))
P = ParamSpec("P")
R = TypeVar("R")


def identity_cache(maxsize: int = 1 << 16) -> Callable[[Callable[P, R]], Callable[P, R]]:
    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        cache: dict[tuple[Any, ...], tuple[tuple[Any, ...], R]] = {}

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if kwargs:
                return fn(*args, **kwargs)
            key = tuple([a if a.__class__ in _PRIMITIVE else id(a) for a in args])
            hit = cache.get(key)
            if hit is not None:
                return hit[1]
            value = fn(*args, **kwargs)
            if len(cache) >= maxsize:
                cache.clear()
            cache[key] = (args, value)  # holding args keeps their ids unique
            return value

        wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
        return wrapper

    return decorate
