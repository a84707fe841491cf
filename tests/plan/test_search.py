"""Search: every returned plan obeys the divisibility rules, fits, and is ranked by time."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GiB
from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import estimate_memory
from llmscale.plan.search import SearchSpace, search
from llmscale.plan.time import estimate_step_time

L70 = get_preset("llama2-70b")
H200 = Cluster.of("h200")


@pytest.fixture(scope="module")
def result():
    return search(L70, 64, H200, 4096, 1024, top=10)


def test_constraints_hold_for_every_plan(result) -> None:
    assert len(result.candidates) == 10 and result.feasible >= 10
    for c in result.candidates:
        p = c.plan
        assert p.world_size == 64
        assert p.tp <= 8 and L70.n_heads % p.tp == 0 and L70.n_kv_heads % p.tp == 0
        assert p.pp * p.chunks <= L70.n_layers  # uneven splits allowed (stage_layer_counts)
        assert p.global_batch_size % (p.micro_batch_size * p.dp) == 0
        p.validate()  # the runtime's own rules
        # Fits, with the allocator overhead and the device reserve, on every stage.
        assert estimate_memory(p).total + 1.5 * GiB <= 141 * GiB
        assert c.memory.total == estimate_memory(p).total


def test_ranked_by_step_time_and_times_are_the_public_estimate(result) -> None:
    times = [c.time.seconds for c in result.candidates]
    assert times == sorted(times)
    for c in result.candidates[:3]:
        again = estimate_step_time(c.plan, H200, simulate=c.plan.pp > 1)
        assert again.seconds == pytest.approx(c.time.seconds)


def test_a_tight_cluster_needs_memory_savers() -> None:
    # 70B on 8 x H100 80GB: only sharded, recomputing or offloading plans fit.
    r = search(L70, 8, Cluster.of("h100"), 4096, 64, top=5)
    assert r.candidates
    for c in r.candidates:
        p = c.plan
        assert p.dp_shard > 1 or p.pp > 1 or p.offload != "none"
        assert c.memory.total + 1.5 * GiB <= 80 * GiB


def test_nothing_fits_gives_an_empty_result() -> None:
    r = search(get_preset("llama3-405b"), 8, Cluster.of("a100-40g"), 8192, 8)
    assert r.candidates == () and r.feasible == 0


def test_space_restricts_options() -> None:
    space = SearchSpace(recompute=("full",), offload=("none",), schedules=("1f1b",))
    r = search(L70, 64, H200, 4096, 1024, top=5, space=space)
    assert {c.plan.recompute for c in r.candidates} == {"full"}
    assert {c.plan.offload for c in r.candidates} == {"none"}


def test_interleaved_plans_split_every_layer() -> None:
    space = SearchSpace(schedules=("interleaved_1f1b",), micro_batch_sizes=(1, 2))
    # top=20: since issue 12 FSDP2 under a pipeline holds each stage's unsharded gradients
    # (as the runtime does), so tp=1 interleaved FSDP plans no longer fit and rank lower.
    r = search(L70, 64, H200, 4096, 1024, top=20, space=space)
    inter = [c.plan for c in r.candidates if c.plan.pp_schedule == "interleaved_1f1b"]
    assert inter
    for p in inter:
        # Uneven chunks are searched too; every stage holds at least one layer.
        assert p.n_microbatches % p.pp == 0 and p.pp * p.pp_chunks <= L70.n_layers


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"gpus": 0}, "gpus"),
        ({"seq_len": 8192}, "seq_len"),
        ({"precision": "int8"}, "precision"),
        ({"global_batch_size": -1}, "global_batch_size"),
    ],
)
def test_bad_input(kwargs, field: str) -> None:
    args = {"model": L70, "gpus": 64, "cluster": H200, "seq_len": 4096, "global_batch_size": 1024}
    args.update(kwargs)
    with pytest.raises(ConfigError) as e:
        search(**args)
    assert e.value.field == field


def test_divisors_are_all_and_sorted() -> None:
    from llmscale.plan.search import _divisors

    for n in (1, 2, 7, 36, 64, 4096, 1000):
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_fixed_degrees_hold_and_the_rest_is_searched() -> None:
    r = search(L70, 64, H200, 4096, 1024, top=10, space=SearchSpace(tp=4, dp_shard=8))
    assert r.candidates
    assert {(c.plan.tp, c.plan.dp_shard, c.plan.pp * c.plan.dp_replicate) for c in r.candidates} == {(4, 8, 2)}  # fmt: skip
    assert all(c.fits and c.why is None for c in r.candidates) and r.why_none() is None


def test_nothing_fits_keeps_the_closest_with_why() -> None:
    r = search(get_preset("llama3-405b"), 8, Cluster.of("a100-40g"), 8192, 8, top=3)
    assert r.candidates == () and len(r.unfit) == 3 and r.shown == r.unfit
    totals = [c.memory.total for c in r.unfit]
    assert all(not c.fits and "GiB" in (c.why or "") for c in r.unfit)
    assert totals[0] > 40 * GiB and "no plan fits in memory" in (r.why_none() or "")


def test_indivisible_gpus_name_the_rule() -> None:
    # 83 is prime and above n_layers: tp and pp can only be 1, and 1024 is no multiple of 83.
    # (7 GPUs now run: pp 7 splits the 80 layers unevenly.)
    r = search(L70, 83, H200, 4096, 1024)
    assert r.candidates == () and r.unfit == () and r.evaluated == 0
    why = r.why_none() or ""
    assert "no valid layout of 83 GPUs" in why and "tp 2 does not divide 83 GPUs" in why
    assert "not a multiple of dp 83" in why and "pp 83 > n_layers 80" in r.rejected


def test_a_126_layer_model_interleaves_over_pp_16_without_pp_layers() -> None:
    """126 layers over 16 ranks x 2 chunks: 32 stages of 4 and 3 layers (stage_layer_counts),
    no --pp-layers needed; the interleaved plan beats 1F1B's bubble."""
    from llmscale.report.search_report import fixed_space

    model = get_preset("llama3-405b")
    cluster = Cluster.of("h100")
    space, _ = fixed_space(8192, {"tp": 8, "pp": 16, "schedule": "interleaved_1f1b"})
    res = search(model, 8192, cluster, 8192, 2048, top=3, space=space)
    assert res.candidates, res.rejected
    best = res.candidates[0].plan
    assert best.pp_schedule == "interleaved_1f1b" and best.chunks >= 2 and not best.pp_layers
    space1, _ = fixed_space(8192, {"tp": 8, "pp": 16, "schedule": "1f1b"})
    one = search(model, 8192, cluster, 8192, 2048, top=1, space=space1).candidates[0]
    assert res.candidates[0].time.seconds < one.time.seconds


def test_a_pp_layers_split_of_several_stages_is_never_tried_on_one_stage() -> None:
    """--pp-layers 40,40 --chunks 2 on 128 GPUs: pp 1 passed the divisibility check (1 divides
    2) and reached the memory model, which raised; now pp 1 is rejected with its reason and
    pp 2 (40 and 40 layers, one chunk) is what a free pp finds."""
    from llmscale.report.search_report import fixed_space

    model, cluster = get_preset("llama3-70b"), Cluster.of("a100-80g")
    space, _ = fixed_space(128, {"pp_layers": "40,40", "chunks": 2})
    res = search(model, 128, cluster, 4096, 1024, top=1, space=space)
    assert res.candidates == () and "pp 1 runs one stage" in (res.why_none() or "")
    space, _ = fixed_space(128, {"pp_layers": "40,40"})
    res = search(model, 128, cluster, 4096, 1024, top=1, space=space)
    assert res.candidates and res.candidates[0].plan.pp == 2, res.why_none()


def test_405b_over_pp_16_x_8_chunks_puts_the_embedding_and_the_head_alone() -> None:
    """Megatron-Bridge's Llama 3.1 405B on 256 GB200 (26.02, MXFP8: tp 4, pp 16, vp 8) runs 128
    stages for 126 layers: its recipe counts the embedding and the loss as a layer each
    (account_for_embedding/loss_in_pipeline_split), so the first stage holds the embedding
    alone and the last the head alone. The search costs that layout with no --pp-layers (it
    refused it: 128 stages > 126 layers), the first and last rank one block lighter."""
    from llmscale.plan.memory import memory_options
    from llmscale.plan.time import time_params
    from llmscale.report.search_report import fixed_space
    from llmscale.stack import STACKS

    model, mcore = get_preset("llama3-405b"), STACKS["megatron-core"]
    fixed = {"tp": 4, "pp": 16, "chunks": 8, "schedule": "interleaved_1f1b", "mbs": 1}
    space, _ = fixed_space(256, fixed)
    res = search(
        model, 256, Cluster.of("gb200"), 8192, 1536, "fp8", top=3, space=space,
        memory_options=memory_options(mcore), time_params=time_params(mcore),
    )  # fmt: skip
    assert res.candidates, res.why_none()
    plan = res.candidates[0].plan
    assert plan.chunks == 8 and not plan.pp_layers
    assert [len(plan.rank_layers(r)) for r in range(16)] == [7, *[8] * 14, 7]
    assert plan.rank_layers(0) == list(range(15, 126, 16))  # stage 0 holds no block


def test_the_search_refuses_what_the_runtime_refuses() -> None:
    """cp > 1 with optimizer offload: `train`, `train --dry-run` and the search read one rule
    (config.offload_layout_problem); the search says why it dropped those plans."""
    from llmscale.config import offload_layout_problem

    space = SearchSpace(cp=2, offload=("optimizer",))
    res = search(L70, 64, H200, 4096, 1024, top=3, space=space)
    assert not res.candidates
    assert any("offload with cp 2" in r for r in res.rejected)
    assert offload_layout_problem("optimizer", 2, 1, False)
    assert not offload_layout_problem("none", 2, 1, False)


def test_a_tied_pipeline_is_searched_without_optimizer_offload() -> None:
    """The runtime refuses optimizer offload with a tied model under pp > 1 (the last stage's
    copy is summed on the device): the search keeps offload for pp 1 and says why it dropped it
    for pp 2."""
    gpt2 = get_preset("gpt2-124m")
    h100 = Cluster.of("h100")
    space = SearchSpace(pp=2, offload=("none", "optimizer"), micro_batch_sizes=(1,))
    res = search(gpt2, 8, h100, 1024, 64, top=50, space=space)
    assert res.candidates and all(c.plan.offload == "none" for c in res.candidates)
    assert any("offload optimizer with pp 2" in r for r in res.rejected)
    flat = search(gpt2, 8, h100, 1024, 64, top=200, space=SearchSpace(pp=1, offload=("optimizer",)))
    assert flat.candidates and all(c.plan.offload == "optimizer" for c in flat.candidates)


def test_zero_2_is_searched_where_it_differs_from_1() -> None:
    """Without a pipeline the llmscale stack's zero 2 keeps sharded gradient accumulators
    (zero 1 holds unsharded fp32 ones across micro-batches): a third setting, tried only where
    it is not the same layout; under a pipeline 1 and 2 gather and reduce alike and 2 is not
    costed twice."""
    from llmscale.plan.search import _zero_stages
    from llmscale.stack import LLMSCALE, MEGATRON_CORE, TORCHTITAN

    space = SearchSpace()
    assert _zero_stages(8, space, 1, LLMSCALE) == [1, 2, 3]
    assert _zero_stages(8, space, 4, LLMSCALE) == [1, 3]
    assert _zero_stages(8, space, 1, TORCHTITAN) == [1, 3]  # FSDP2's "never" for both
    assert _zero_stages(8, space, 4, MEGATRON_CORE) == [1, 2, 3]
    assert _zero_stages(1, space, 1, LLMSCALE) == [3]
    # Zero 2 is proposed where zero 1's unsharded gradients do not fit and its accumulators do.
    res = search(L70, 64, H200, 4096, 1024, top=200,
                 space=SearchSpace(pp=1, tp=8, zero_stages=(1, 2), recompute=("full",)))  # fmt: skip
    twos = [c.plan for c in res.candidates if c.plan.zero_stage == 2]
    assert twos
    budget = H200.gpu.memory_bytes - 1.5 * GiB
    for plan in twos:
        assert estimate_memory(replace(plan, zero_stage=1)).total > budget
        assert estimate_memory(plan).total <= budget


def test_activation_offload_is_searched_with_the_fewest_blocks_that_fit() -> None:
    # Megatron-Bridge's Llama 3 70B on 64 GB200 (26.02, FP8): Megatron-FSDP, no recompute, the
    # first 40 blocks' activations offloaded. The search finds that kind of plan, each with the
    # fewest offloaded blocks that fit: one fewer does not.
    from llmscale.plan import memory as mem
    from llmscale.report.search_report import fixed_space, plan_report
    from llmscale.stack import get_stack

    res = plan_report("llama3-70b", 64, "gb200", 8192, 256, "fp8", stack="megatron-core").result
    offloaded_best = res.candidates[0].time.seconds
    offloaded = [c.plan for c in res.candidates if c.plan.offload_activations]
    assert offloaded and res.candidates[0].plan.offload_activations
    opt = mem.memory_options(get_stack("megatron-core"))
    budget = Cluster.of("gb200").gpu.memory_bytes - opt.device_reserve_GiB * GiB
    for p in offloaded:
        assert p.pp == 1 and p.recompute == "none"
        p.validate()
        one_fewer = replace(p, offload_activations=p.offload_activations - 1)
        assert mem.worst_total(one_fewer, opt, (0,)) > budget >= mem.worst_total(p, opt, (0,))
    # --offload-activations 0 turns it off; a stack that cannot offload activations
    # (torchtitan) is never offered it.
    space, fixed = fixed_space(64, {"offload_activations": 0})
    off = plan_report(
        "llama3-70b", 64, "gb200", 8192, 256, "fp8", space=space, fixed=fixed,
        stack="megatron-core",
    ).result  # fmt: skip
    tt = plan_report("llama3-70b", 64, "gb200", 8192, 256, "fp8", stack="torchtitan").result
    for res in (off, tt):
        assert res.candidates and not any(c.plan.offload_activations for c in res.candidates)
    assert off.candidates[0].time.seconds > offloaded_best


def _with_memory(cluster: Cluster, gib: float) -> Cluster:
    """`cluster` with its GPU's memory replaced (a part between two of the catalog's)."""
    from llmscale.hardware.spec import Sourced

    return replace(cluster, gpu=replace(cluster.gpu, memory_GiB=Sourced(gib, "test")))


def test_the_allocated_peak_decides_the_fit_and_the_allocators_share_tightness() -> None:
    # One fixed layout on a GPU sized halfway between its allocated peak and its total with
    # the caching allocator's 5%: it fits (the allocator flushes its cache before it fails),
    # tightly; a GPU just below the allocated peak does not fit it.
    fixed = SearchSpace(tp=2, pp=1, dp_shard=32, micro_batch_sizes=(1,), recompute=("full",),
                        zero_stages=(3,), offload=("none",), sequence_parallel=(True,))  # fmt: skip
    first = search(L70, 64, H200, 4096, 1024, space=fixed, top=1).candidates[0]
    w = first.memory.worst
    assert w.total == pytest.approx(1.05 * w.allocated) and not first.tight
    between = (w.allocated + 0.5 * w.allocator) / GiB + 1.5
    r = search(L70, 64, _with_memory(H200, between), 4096, 1024, space=fixed, top=1)
    (c,) = r.candidates
    assert c.fits and c.tight and c.why is None and r.feasible == 1
    assert c.memory.fits(r.cluster.gpu) and c.memory.tight(r.cluster.gpu)
    from llmscale.plan.search import tight_note

    note = tight_note(c.memory, r.cluster) or ""
    assert note.startswith(f"tight: {w.allocated / GiB:.1f} GiB allocated on pipeline rank 0")
    assert "num_alloc_retries" in note and f"{w.total / GiB:.1f} with" in note
    short = (w.allocated - 0.01 * GiB) / GiB + 1.5
    r = search(L70, 64, _with_memory(H200, short), 4096, 1024, space=fixed, top=1)
    assert r.candidates == () and r.unfit and not r.unfit[0].fits
    assert (r.unfit[0].why or "").startswith(f"needs {w.allocated / GiB:.1f} GiB allocated")


def test_plans_that_fit_with_room_rank_before_tight_ones() -> None:
    # On a GPU sized so that the unfixed search's fastest plan only fits tightly, plans that
    # fit with the allocator's share come first, and the tight ones do not prune them.
    best = search(L70, 64, H200, 4096, 1024, top=1).candidates[0].memory.worst
    gib = (best.allocated + 0.5 * best.allocator) / GiB + 1.5
    r = search(L70, 64, _with_memory(H200, gib), 4096, 1024, top=10)
    tight = [c.tight for c in r.candidates]
    assert len(r.candidates) == 10 and tight == sorted(tight) and not tight[0]
    roomy = [c.time.seconds for c in r.candidates if not c.tight]
    assert roomy == sorted(roomy)
    assert all(c.memory.total + 1.5 * GiB <= gib * GiB for c in r.candidates if not c.tight)


def test_context_degrees_keep_4096_tokens_per_rank() -> None:
    """Without --cp the search tries 1 and each power of two that divides the GPUs, splits the
    sequence into 2 cp chunks and keeps >= 4,096 tokens per rank."""
    from llmscale.plan.search import context_degrees

    assert context_degrees(64, 4096) == (1,)
    assert context_degrees(4096, 8192) == (1, 2)
    assert context_degrees(256, 262144) == (1, 2, 4, 8, 16, 32, 64)
    assert context_degrees(24, 131072) == (1, 2, 4, 8)  # 16 does not divide 24 GPUs
    assert context_degrees(64, 12288) == (1, 2)  # 12,288 / 4 = 3,072 tokens: too few


@pytest.mark.parametrize("stack", ["llmscale", "megatron-core", "torchtitan"])
@pytest.mark.parametrize(
    ("cp", "mbs", "layout"),
    [
        (2, 2, dict(tp=1, pp=1, zero_stage=3, recompute="none", precision="bf16")),
        (4, 2, dict(tp=2, pp=2, zero_stage=1, recompute="selective", precision="bf16")),
        (4, 4, dict(tp=4, pp=1, zero_stage=1, recompute="full", precision="fp8")),
    ],
)
def test_a_cp_sharing_a_factor_with_the_micro_batch_is_dominated(
    stack: str, cp: int, mbs: int, layout: dict[str, Any]
) -> None:
    """`search.cp_dominated`'s claim, on the planner's own costs: cp c at micro-batch size b,
    g = gcd(c, b) > 1, is no faster and no lighter than cp c/g at b/g with dp x g (the same
    tokens per rank per micro-batch, the same micro-batches; fewer ring steps)."""
    from llmscale.plan.memory import memory_options
    from llmscale.plan.plan import Plan
    from llmscale.plan.search import cp_dominated
    from llmscale.plan.time import time_params
    from llmscale.stack import STACKS

    g = math.gcd(cp, mbs)
    assert cp_dominated(cp, mbs, (1, 2, 4), (1, 2, 4, 8))
    assert not cp_dominated(cp, 1, (1, 2, 4), (1, 2, 4, 8))
    assert not cp_dominated(cp, mbs, (cp,), (1, 2, 4, 8))  # a --cp given: nothing to compare
    h100 = Cluster.of("h100")
    st = STACKS[stack]
    common = dict(
        model=get_preset("llama3-8b"), seq_len=8192, global_batch_size=256, dp_replicate=1,
        sequence_parallel=layout["tp"] > 1, **layout,
    )  # fmt: skip
    shards = 16 // (layout["tp"] * layout["pp"] * cp)
    wide = Plan(**common, cp=cp, micro_batch_size=mbs, dp_shard=shards)
    narrow = Plan(**common, cp=cp // g, micro_batch_size=mbs // g, dp_shard=shards * g)
    assert wide.n_microbatches == narrow.n_microbatches
    tp_, mo = time_params(st, compiled=False), memory_options(st, compiled=False)
    assert (
        estimate_step_time(wide, h100, tp_).seconds >= estimate_step_time(narrow, h100, tp_).seconds
    )
    # the same to the rounding of shard sizes (a few bytes), or more
    assert estimate_memory(wide, mo).total >= estimate_memory(narrow, mo).total * (1 - 1e-9)


def test_the_search_tries_context_parallelism_for_long_sequences() -> None:
    """Without --cp, 128K tokens of Llama 3.1 8B on 16 H100 (4 sequences: dp x cp = 16 needs
    cp >= 4) plan with cp > 1 at micro-batch size 1; a given --cp is kept."""
    l8 = get_preset("llama3.1-8b")
    h100 = Cluster.of("h100")
    res = search(l8, 16, h100, 131072, 4, top=5)
    assert res.candidates
    assert all(c.plan.cp > 1 and c.plan.micro_batch_size == 1 for c in res.candidates)
    fixed = search(l8, 16, h100, 131072, 4, top=3, space=SearchSpace(cp=4))
    assert fixed.candidates and {c.plan.cp for c in fixed.candidates} == {4}
    short = search(get_preset("llama3-8b"), 8, h100, 4096, 64, top=3)
    assert {c.plan.cp for c in short.candidates} == {1}  # 4,096 tokens: no cp > 1 tried
