"""The search's shortcuts (plan/search.py, plan/plan.py, plan/cache.py) answer what the
general paths answer: `Plan.varied` is `dataclasses.replace`; the memo's direct path returns
what it computed."""

from __future__ import annotations

import dataclasses

import pytest

from llmscale.model.config import get_preset
from llmscale.plan.cache import Memo, memoize
from llmscale.plan.plan import Plan

L7 = get_preset("llama2-7b")
BASE = Plan(
    model=L7, seq_len=1024, micro_batch_size=2, global_batch_size=32, precision="bf16",
    dp_replicate=2, tp=4, pp=2, pp_schedule="interleaved_1f1b", pp_chunks=2,
    sequence_parallel=True, offload="optimizer",
)  # fmt: skip


def test_plan_has_no_post_init() -> None:
    # `varied` skips the generated __init__; a __post_init__ would be skipped with it.
    assert not hasattr(Plan, "__post_init__")


def test_varied_is_replace() -> None:
    changes = {"recompute": "full", "zero_stage": 1, "offload": "none", "micro_batch_size": 4}
    a, b = BASE.varied(**changes), dataclasses.replace(BASE, **changes)
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert a.n_microbatches == b.n_microbatches == 4
    assert a.states_key() == b.states_key() and a.activations_key() == b.activations_key()
    assert BASE.recompute == "none" and BASE.micro_batch_size == 2  # the original is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tp = 8  # type: ignore[misc]


def test_varied_refuses_a_name_that_is_not_a_field() -> None:
    with pytest.raises(TypeError, match="no field zero"):
        BASE.varied(zero=1)


def test_memoize_computes_once_per_key() -> None:
    calls: list[tuple[int, str]] = []

    @memoize
    def f(a: int, b: str) -> str:
        calls.append((a, b))
        return b * a

    assert [f(2, "x"), f(2, "x"), f(3, "x"), f(2, "x")] == ["xx", "xx", "xxx", "xx"]
    assert calls == [(2, "x"), (3, "x")]


def test_memo_put_clears_when_full() -> None:
    memo: Memo[int] = Memo("test.small", maxsize=2)
    assert memo.get((1,), lambda: 10) == 10 and memo.put((2,), 20) == 20
    assert len(memo) == 2
    assert memo.get((3,), lambda: 30) == 30 and len(memo) == 1  # emptied, then the new one
    assert memo.get((1,), lambda: 11) == 11  # gone: computed again
