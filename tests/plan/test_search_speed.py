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


# Another value of every Plan field (plan/plan.py), for the kept values' test below.
OTHER = {
    "model": get_preset("llama3-8b"), "seq_len": 2048, "micro_batch_size": 4,
    "global_batch_size": 128, "recompute": "full", "recompute_every_k": 3, "precision": "fp32",
    "offload": "none", "lsp_dim": 256, "lsp_nonzeros": 8, "dp_replicate": 4, "dp_shard": 2,
    "tp": 8, "pp": 4, "pp_schedule": "zbv", "pp_chunks": 4, "pp_layers": (10, 8, 8, 6),
    "cp": 2, "sequence_parallel": False, "zero_stage": 1, "offload_activations": 2,
    "float8_recipe": "rowwise",
}  # fmt: skip


def test_kept_values_read_only_their_fields() -> None:
    # A kept value (`plan._Kept`) is carried by `varied` to a plan that changes none of the
    # fields it names: changing any other field must leave it as it was, and changing one of
    # its own gives the value a new plan computes.
    from llmscale.plan.plan import _KEPT

    assert set(OTHER) == {f.name for f in dataclasses.fields(Plan)}
    assert {"dp", "n_microbatches", "chunks", "v_shape", "lowp_weights", "fsdp"} <= set(_KEPT)
    for base in (BASE, dataclasses.replace(BASE, pp_schedule="zero_bubble", dp_shard=4)):
        for name in _KEPT:
            getattr(base, name)  # kept in base from here on
        assert set(_KEPT) <= set(vars(base))
        for field, value in OTHER.items():
            fresh = dataclasses.replace(base, **{field: value})
            carried = base.varied(**{field: value})
            for name, kept in _KEPT.items():
                assert getattr(carried, name) == getattr(fresh, name), (field, name)
                if field not in kept.reads:
                    assert getattr(fresh, name) == getattr(base, name), (field, name)
                    assert name in vars(carried)  # carried, not computed again
    # a change to a field it names is seen (a control that can fail)
    assert BASE.varied(dp_shard=4).dp == 8 and BASE.varied(pp_schedule="zbv").chunks == 2


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


def test_memoize_values_keys_by_value() -> None:
    from llmscale.plan.cache import clear_all, memoize_values

    calls: list[tuple[int, tuple[int, ...]]] = []

    @memoize_values
    def f(a: int, layers: tuple[int, ...]) -> int:
        calls.append((a, layers))
        return a * sum(layers)

    # equal tuples are one key (memoize keys a tuple by its id); cleared with the other memos
    assert [f(2, (1, 2)), f(2, tuple([1, 2])), f(3, (1, 2)), f(2, (1, 2))] == [6, 6, 9, 6]
    assert calls == [(2, (1, 2)), (3, (1, 2))]
    clear_all()
    assert f(2, (1, 2)) == 6 and len(calls) == 3


def test_memo_put_clears_when_full() -> None:
    memo: Memo[int] = Memo("test.small", maxsize=2)
    assert memo.get((1,), lambda: 10) == 10 and memo.put((2,), 20) == 20
    assert len(memo) == 2
    assert memo.get((3,), lambda: 30) == 30 and len(memo) == 1  # emptied, then the new one
    assert memo.get((1,), lambda: 11) == 11  # gone: computed again


@pytest.mark.parametrize(
    ("schedule", "dp_shard"), [("1f1b", 2), ("zbv", 2), ("interleaved_1f1b", 2), ("1f1b", 1)]
)
def test_floors_answer_as_worst_total(schedule: str, dp_shard: int) -> None:
    # Every (recompute, zero, offload) of a layout, at limits between its plans' floors: the
    # search's `_Floors` says "over" exactly when some costed rank's floor is over, which is
    # when `worst_total` answers from its floors (a total over the limit) before the rest.
    # (dp 1: the offload decides whether the forward's weights are low precision.)
    from llmscale.plan import memory as mem
    from llmscale.plan.search import RECOMPUTE_ORDER, _Floors

    knobs = dataclasses.replace(
        BASE, pp=4, dp_replicate=1, dp_shard=dp_shard, tp=2, global_batch_size=64, micro_batch_size=1,
        pp_schedule=schedule, pp_chunks=2, offload="none", sequence_parallel=False,
    )  # fmt: skip
    recs, zeros, offloads = list(RECOMPUTE_ORDER), [1, 2, 3], ["none", "optimizer"]
    ends, opt = (0, 3), mem.DEFAULT_OPTIONS
    over = 1 + opt.allocator_overhead
    settings = [(r, z, o) for r in range(5) for z in range(3) for o in range(2)]

    def floor(r: int, z: int, o: int, rank: int) -> float:
        plan = knobs.varied(recompute=recs[r], zero_stage=zeros[z], offload=offloads[o])
        return over * mem.rank_pieces(plan, rank, opt)._replace(pending_weight_grads=0).allocated

    for s in settings:  # the floor's sum without its record is the record's, to the bit
        plan = knobs.varied(recompute=recs[s[0]], zero_stage=zeros[s[1]], offload=offloads[s[2]])
        for r in ends:
            st, a = mem.rank_states(plan, r, opt), mem.rank_activity(plan, r, opt)
            assert mem.floor_allocated(st, a) == mem.floor_pieces(st, a).allocated > 0
            assert mem.floor_pieces(st, a).allocated * over == floor(*s, r)
    firsts = sorted({floor(*s, 0) for s in settings})
    assert len(firsts) >= 8  # the settings differ in memory
    for limit in (firsts[2], firsts[len(firsts) // 2], firsts[-3]):
        floors = _Floors(knobs, recs, zeros, offloads, ends, opt, limit)  # type: ignore[arg-type]
        answers = [floors.pieces(*s) for s in settings]
        assert [a is None for a in answers] == [
            any(floor(*s, r) > limit for r in ends) for s in settings
        ]
        assert 0 < sum(a is None for a in answers) < len(settings)
        for s, known in zip(settings, answers, strict=True):
            plan = floors.plan(*s)
            assert plan == knobs.varied(recompute=recs[s[0]], zero_stage=zeros[s[1]],
                                        offload=offloads[s[2]])  # fmt: skip
            total = mem.worst_total(plan, opt, ends, limit)
            if known is None:
                assert total > limit
            else:  # the floors it was given are its own
                assert known == [mem.rank_pieces(plan, r, opt)._replace(pending_weight_grads=0)
                                 for r in ends]  # fmt: skip
                assert mem.worst_total(plan, opt, ends, limit, known) == total


def test_the_keys_floors_shares_pieces_on() -> None:
    # `_Floors` reuses a rank's states across recompute modes and the two sequence-parallel
    # settings, and its activity across ZeRO stages, offloads of the same low-precision
    # weights and the dp splits of one dp: the memo keys must not name those (a key that
    # starts to must also change `_Floors`).
    base = dataclasses.replace(
        BASE, dp_replicate=2, dp_shard=4, global_batch_size=64, offload="none", zero_stage=3
    )
    same_states = [
        dict(recompute="full"), dict(recompute="selective"), dict(sequence_parallel=False),
    ]  # fmt: skip
    for change in same_states:
        assert dataclasses.replace(base, **change).states_key() == base.states_key()
    same_activity = [
        dict(zero_stage=1), dict(zero_stage=2), dict(offload="optimizer"),
        dict(dp_replicate=1, dp_shard=8), dict(dp_replicate=8, dp_shard=1),
    ]  # fmt: skip
    for change in same_activity:
        assert dataclasses.replace(base, **change).activations_key() == base.activations_key()
    # ... and they do name what the search varies within those (a control that can fail)
    assert dataclasses.replace(base, zero_stage=1).states_key() != base.states_key()
    assert dataclasses.replace(base, recompute="full").activations_key() != base.activations_key()
    assert (
        dataclasses.replace(base, dp_replicate=1, dp_shard=4).activations_key()
        != base.activations_key()
    )  # another dp: another micro-batch count


@pytest.mark.parametrize(
    ("name", "gpus", "gpu", "seq", "batch"),
    [("llama2-70b", 8, "h100", 4096, 64), ("llama3-8b", 16, "h100", 8192, 64)],
)
def test_time_floor_skips_only_plans_never_shown(
    monkeypatch: pytest.MonkeyPatch, name: str, gpus: int, gpu: str, seq: int, batch: int
) -> None:
    # The search times a fitting plan in full only while its step-time floor can beat the
    # plans it keeps: with and without the shortcut it answers the same, having timed fewer;
    # and the floor is no more than the estimate for every plan the search times.
    from llmscale.plan import search as sr
    from llmscale.plan import time as tm
    from llmscale.plan.cluster import Cluster

    model, cluster = get_preset(name), Cluster.of(gpu)
    timed: list[tuple[float, float]] = []
    estimate = tm.estimate_step_time

    def counted(plan, cluster, params, simulate=False, ranks=None, validate=True):  # type: ignore[no-untyped-def]
        t = estimate(plan, cluster, params, simulate, ranks, validate)
        if ranks is not None:  # the loop's (the finals are simulated)
            floor = tm.step_time_floor(plan, cluster, params, ranks)
            timed.append((floor, t.seconds))
            # stopped once past a bar: a floor still, past that bar
            early = tm.step_time_floor(plan, cluster, params, ranks, past=floor / 2)
            assert floor / 2 < early <= floor
        return t

    monkeypatch.setattr(sr.tm, "estimate_step_time", counted)
    runs = {}
    for prune in (False, True):
        monkeypatch.setattr(sr, "PRUNE_BY_TIME_FLOOR", prune)
        timed.clear()
        res = sr.search(model, gpus, cluster, seq, batch, top=5)
        runs[prune] = (res, list(timed))
    (full, all_timed), (pruned, few_timed) = runs[False], runs[True]
    assert len(all_timed) == full.feasible > len(few_timed) > 0  # some plans were skipped
    assert all(floor <= seconds for floor, seconds in all_timed)
    assert sum(floor < seconds for floor, seconds in all_timed) > 0  # a floor, not the estimate
    # knob loops left uncosted: fewer plans costed, and of them fewer fit
    assert pruned.evaluated < full.evaluated and pruned.feasible < full.feasible
    assert [(c.plan, c.time, c.memory.total) for c in pruned.candidates] == [
        (c.plan, c.time, c.memory.total) for c in full.candidates
    ]
    assert len(full.candidates) == 5


@pytest.mark.parametrize("stack", ["llmscale", "torchtitan", "megatron-core", "megatron-2021"])
@pytest.mark.parametrize(
    ("name", "gpus", "gpu", "seq", "batch"),
    [
        ("llama2-70b", 32, "h200", 4096, 256),
        ("llama3-8b", 16, "h100", 8192, 64),
        ("llama3-70b", 64, "gb200", 8192, 256),  # activation offload ranks high (llmscale, mcore)
    ],
)
def test_time_pruning_keeps_every_shown_plan(
    monkeypatch: pytest.MonkeyPatch,
    stack: str,
    name: str,
    gpus: int,
    gpu: str,
    seq: int,
    batch: int,
) -> None:
    # Each stack's search shows the same plans, times and memory with the time floors on (a
    # plan's, and a knob loop's: `search._slower_than`) as with them off, having costed fewer.
    from llmscale.plan import cache
    from llmscale.plan import search as sr
    from llmscale.report.search_report import plan_report

    runs = {}
    for prune in (False, True):
        monkeypatch.setattr(sr, "PRUNE_BY_TIME_FLOOR", prune)
        cache.clear_all()
        runs[prune] = plan_report(name, gpus, gpu, seq, batch, top=10, stack=stack).result
    full, pruned = runs[False], runs[True]
    assert [(c.plan, c.time, c.memory.total) for c in pruned.candidates] == [
        (c.plan, c.time, c.memory.total) for c in full.candidates
    ]
    assert len(full.candidates) == 10
    assert pruned.evaluated < full.evaluated


@pytest.mark.parametrize(
    ("name", "tp", "pp", "dp", "mbs", "batch", "recompute"),
    [
        ("llama2-7b", 1, 4, 2, 1, 16, "none"),
        ("llama2-7b", 2, 2, 2, 2, 64, "selective"),
        ("llama3-8b", 1, 8, 1, 1, 32, "full"),
        ("llama2-70b", 4, 4, 2, 1, 64, "none"),
    ],
)
@pytest.mark.parametrize("stack", ["llmscale", "torchtitan"])
def test_gpipe_is_no_faster_nor_lighter_than_1f1b(
    name: str, tp: int, pp: int, dp: int, mbs: int, batch: int, recompute: str, stack: str
) -> None:
    # search.DOMINATED_BY: with the same knobs GPipe takes 1F1B's step time and holds no less
    # on any rank (1F1B needs m >= pp), so the search tries it only where 1F1B cannot run.
    from llmscale.plan import memory as mem
    from llmscale.plan import search as sr
    from llmscale.plan import time as tm
    from llmscale.plan.cluster import Cluster
    from llmscale.plan.time import time_params
    from llmscale.stack import get_stack

    st = get_stack(stack)
    if "gpipe" not in st.schedules or recompute not in st.recompute:
        pytest.skip(f"{stack} runs no gpipe or {recompute}")
    cluster, opt, tparams = Cluster.of("h100"), mem.memory_options(st), time_params(st)
    one = Plan(
        model=get_preset(name), seq_len=4096, micro_batch_size=mbs, global_batch_size=batch,
        tp=tp, pp=pp, dp_shard=dp, recompute=recompute, pp_schedule="1f1b",  # type: ignore[arg-type]
    )  # fmt: skip
    assert one.n_microbatches >= pp
    g = dataclasses.replace(one, pp_schedule="gpipe")
    a, b = mem.estimate_memory(one, opt), mem.estimate_memory(g, opt)
    for ra, rb in zip(a.per_rank, b.per_rank, strict=True):
        assert rb.total >= ra.total
    assert b.total > a.total  # all m micro-batches in flight
    for simulate in (False, True):
        ta = tm.estimate_step_time(one, cluster, tparams, simulate=simulate).seconds
        tb = tm.estimate_step_time(g, cluster, tparams, simulate=simulate).seconds
        assert tb == pytest.approx(ta, rel=1e-9)
    # the search shows 1F1B's plan where it runs, GPipe only where it cannot (m < pp)
    space = sr.SearchSpace(tp=tp, pp=pp, dp_shard=dp, micro_batch_sizes=(mbs,))
    res = sr.search(one.model, tp * pp * dp, cluster, 4096, batch, space=space,
                    memory_options=opt, time_params=tparams)  # fmt: skip
    assert res.shown and all(c.plan.pp_schedule != "gpipe" for c in res.shown)
    few = sr.search(one.model, tp * pp * dp, cluster, 4096, dp * mbs * (pp - 1), space=space,
                    memory_options=opt, time_params=tparams)  # fmt: skip
    assert few.shown and all(c.plan.pp_schedule == "gpipe" for c in few.shown)
