"""The planner's one memo: results of its hot helpers, keyed by value and object identity.

`functools.lru_cache` hashes every argument on every call; the planner's arguments include
frozen dataclasses of twenty fields (ModelConfig, Kernels, Fabric, MemoryOptions), and hashing
them dominated the search. Here a key's primitives (int, float, str, bool, None) are kept as they
are and every other object is keyed by `id()`. That is safe because an entry keeps the objects of
its key alive, so no other object can take the same id while the entry exists; equal but
distinct objects only miss.

Every memo registers itself; `clear_all()` empties them all (benchmarks that time a cold
search call it). Keys that name a `Plan`'s fields are built by the Plan's `*_key` methods, next
to the fields they list (plan/plan.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, Generic, ParamSpec, TypeVar

_PRIMITIVE = frozenset((int, float, str, bool, type(None)))
P = ParamSpec("P")
R = TypeVar("R")

_MEMOS: list[Memo[Any]] = []


class Memo(Generic[R]):
    """A dict from keys (tuples of primitives and object ids) to results, bounded in size."""

    def __init__(self, name: str, maxsize: int = 1 << 16) -> None:
        self.name = name
        self.maxsize = maxsize
        self._data: dict[tuple[Hashable, ...], tuple[tuple[object, ...], R]] = {}
        _MEMOS.append(self)

    def get(
        self, key: tuple[Hashable, ...], compute: Callable[[], R], keep: tuple[object, ...] = ()
    ) -> R:
        """The result for `key`, computed (and kept) on a miss. A key names objects by `id()`;
        `keep` holds those objects, so that their ids stay theirs while the entry exists."""
        hit = self._data.get(key)
        if hit is not None:
            return hit[1]
        return self.put(key, compute(), keep)

    def put(self, key: tuple[Hashable, ...], value: R, keep: tuple[object, ...] = ()) -> R:
        """Keep `value` for `key` (emptying the memo first when it is full); `value`."""
        if len(self._data) >= self.maxsize:
            self._data.clear()
        self._data[key] = (keep, value)
        return value

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


def memoize(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` with its positional arguments as a `Memo` key (keyword calls are not cached)."""
    memo: Memo[R] = Memo(f"{fn.__module__}.{fn.__qualname__}")

    data = memo._data

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs:
            return fn(*args, **kwargs)
        key = tuple([a if a.__class__ in _PRIMITIVE else id(a) for a in args])
        hit = data.get(key)  # `memo.get` without a closure per call: the planner's hot path
        if hit is not None:
            return hit[1]
        return memo.put(key, fn(*args, **kwargs), args)

    return wrapper


def memoize_values(fn: Callable[P, R]) -> Callable[P, R]:
    """`memoize` for a function whose positional arguments are all values compared by value
    (ints, strings, bools, tuples of them: no object to key by id): the arguments themselves
    are the key, without building one (the schedule walks' memos, asked thousands of times)."""
    memo: Memo[R] = Memo(f"{fn.__module__}.{fn.__qualname__}")

    data = memo._data

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs:
            return fn(*args, **kwargs)
        hit = data.get(args)
        if hit is not None:
            return hit[1]
        return memo.put(args, fn(*args, **kwargs))

    return wrapper


def clear_all() -> None:
    """Empty every planner memo."""
    for memo in _MEMOS:
        memo.clear()


def entries() -> int:
    """Results held by every planner memo together."""
    return sum(len(memo) for memo in _MEMOS)
