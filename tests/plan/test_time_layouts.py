"""Layouts the step-time model prices beyond plain tp x pp x dp (issue 12): context parallelism
(ring attention), fp8 linears, the vocabulary-parallel loss, uneven pipeline stages in the search,
and FSDP2 + PP gradients as the runtime measures them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmscale.errors import ConfigError
from llmscale.hardware.spec import Sourced
from llmscale.model.config import get_preset, stage_layer_counts
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.collectives import collective
from llmscale.plan.memory import estimate_memory, plan_rank_params
from llmscale.plan.plan import Plan
from llmscale.plan.predict import expected_runtime_metrics
from llmscale.plan.search import RECOMPUTE_LEVEL, RECOMPUTE_ORDER, SearchSpace, search
from llmscale.plan.time import (
    DEFAULT_TIME,
    estimate_step_time,
    peak_flops,
    ring_attention_compute_seconds,
    ring_block_flops,
    ring_blocks,
)

L8 = get_preset("llama3-8b")
L70 = get_preset("llama2-70b")
L405 = get_preset("llama3-405b")
H100 = Cluster.of("h100")


def _ov(comm: float, compute: float, eta: float) -> float:
    hidden = min(comm, compute)
    return comm - hidden + (1 - eta) * hidden


def test_cp_halves_attention_per_rank_and_adds_the_ring_traffic() -> None:
    """Flat efficiency 0.5 (GEMMs and attention linear in their FLOPs): cp 2 runs exactly half
    of each micro-batch's matmul and attention time per rank; the ring's exposed traffic is
    (cp - 1) steps per layer of K and V (forward) and K, V and their gradients (backward), each
    beside 1/cp of that layer's attention, computed here by hand."""
    flat = replace(DEFAULT_TIME, matmul_efficiency=0.5)
    s, b = 8192, 1
    one = Plan(model=L8, seq_len=s, micro_batch_size=b, global_batch_size=8, dp_replicate=8)
    two = replace(one, dp_replicate=4, cp=2)
    assert two.world_size == 8 and two.n_microbatches == 2 * one.n_microbatches
    t1, t2 = estimate_step_time(one, H100, flat), estimate_step_time(two, H100, flat)
    per_mb = lambda t, p: t.breakdown["matmul"] / p.n_microbatches  # noqa: E731
    assert per_mb(t2, two) == pytest.approx(per_mb(t1, one) / 2, rel=1e-12)
    assert "cp_comm" not in t1.breakdown
    # By hand: one layer's flash attention forward on a cp rank, causal (half the products).
    peak = peak_flops(H100, "bf16")
    core = 2.0 * 2 * s * L8.dim * b * s / 2  # QK^T and AV per layer, this rank's s / 2 queries
    attn_f = 0.5 * core / (peak * 0.5)
    attn_b = 2.5 * attn_f
    kv = 2.0 * (b * s // 2) * L8.kv_dim * 2  # this rank's K and V chunk, bf16
    link = H100.fabric.intra
    pair = min(link.pair_bandwidth, link.bus_bandwidth)  # what NCCL reaches (achieved_GBps)
    step_f = link.latency + kv / pair  # cp x tp = 2 <= 8: inside the node
    step_b = link.latency + 2 * kv / pair
    eta = DEFAULT_TIME.dp_overlap
    per_layer = _ov(step_f, attn_f / 2, eta) + _ov(step_b, attn_b / 2, eta)
    want = two.n_microbatches * L8.n_layers * per_layer
    assert t2.breakdown["cp_comm"] == pytest.approx(want, rel=1e-9)
    assert t2.breakdown["cp_comm"] > 0


def test_ring_blocks_of_the_load_balanced_split() -> None:
    """A cp rank holds chunks r and 2cp - 1 - r of 2cp and attends to every chunk at or before
    them: counted pair by pair, 2cp + 1 blocks on every rank (the runtime's `_pairs`)."""
    for cp in (1, 2, 3, 4, 8):
        for r in range(cp):
            mine = (r, 2 * cp - 1 - r)
            pairs = [(q, k) for q in mine for k in range(2 * cp) if k <= q]
            assert len(pairs) == ring_blocks(cp)
            assert sum(q == k for q, k in pairs) == 2  # the causal diagonal, computed whole


@pytest.mark.parametrize(
    ("elementwise", "compiled"),
    [("llmscale", False), ("llmscale", True), ("torchtitan", False), ("saved", False)],
)
def test_cp_rank_moves_the_element_wise_bytes_of_its_own_tokens(
    elementwise: str, compiled: bool
) -> None:
    """A cp = 2 rank of 2 sequences holds 2 x s / 2 tokens: its element-wise time per
    micro-batch is that of a data-parallel rank of 1 sequence (counted once per cp rank, not
    divided by cp twice)."""
    params = replace(DEFAULT_TIME, elementwise=elementwise, compiled=compiled)
    m = get_preset("small")
    one = Plan(model=m, seq_len=256, micro_batch_size=1, global_batch_size=2, precision="bf16",
               dp_replicate=2)  # fmt: skip
    two = replace(one, micro_batch_size=2, dp_replicate=1, cp=2)
    t1, t2 = estimate_step_time(one, H100, params), estimate_step_time(two, H100, params)
    assert t2.breakdown["elementwise"] == pytest.approx(t1.breakdown["elementwise"], rel=1e-6)


def _ring_device(eff: float, latency_us: float, gbps: float) -> Cluster:
    """H100's shape with a measured ring efficiency and a slow link in place of NVLink."""
    cal = replace(H100.gpu.calibration, ring_attention_efficiency=Sourced(eff, "test"))
    gpu = replace(H100.gpu, calibration=cal)
    link = replace(H100.fabric.intra, bandwidth_GBps=Sourced(gbps, "test"),
                   latency_us=Sourced(latency_us, "test"), pair_GBps=None)  # fmt: skip
    return replace(H100, gpu=gpu, fabric=replace(H100.fabric, intra=link))


def test_runtime_ring_priced_from_its_measured_blocks_and_fp32_passes() -> None:
    """With the runtime's ring measured (`ring_attention_efficiency`): per layer and micro-batch,
    2cp + 1 blocks of 2 forward and 5 backward fp32 matmuls at that share of the fp32 peak, in
    place of the flash model; passes of K and V in fp32 (cp - 1 forward; backward cp - 1 of K, V
    and their gradients beside the blocks, and the last gradients' exposed), computed here by
    hand for cp = 4 on the small model."""
    m = get_preset("small")
    eff, lat, gbps = 0.01, 100.0, 0.5
    dev = _ring_device(eff, lat, gbps)
    plan = Plan(model=m, seq_len=256, micro_batch_size=2, global_batch_size=2, cp=4)
    t = estimate_step_time(plan, dev)
    flash = estimate_step_time(plan, H100)  # not measured: flash blocks, as before
    c = 256 // 8
    block = 2.0 * 2 * m.n_heads * c * c * m.head_dim  # one matmul of one (c x c) block
    assert ring_block_flops(plan) == block
    unit = block / (dev.gpu.peak_flops("fp32") * eff)  # one matmul of one block, seconds
    attn_f, attn_b = 9 * 2 * unit, 9 * 5 * unit
    assert ring_attention_compute_seconds(plan, dev) == pytest.approx((attn_f, attn_b))
    assert ring_attention_compute_seconds(plan, H100) is None
    kv = 2.0 * 2 * (256 // 4) * m.kv_dim * 4  # K and V of this rank's tokens, fp32
    step = lat * 1e-6 + kv / (gbps * 1e9)
    eta = DEFAULT_TIME.dp_overlap
    blocks = (3, 2, 2)  # beside the passes of steps 0, 1, 2
    fwd = sum(_ov(step, n * attn_f / 9, eta) for n in blocks)
    bwd = sum(_ov(2 * step, n * attn_b / 9, eta) for n in blocks) + step
    assert t.breakdown["cp_comm"] == pytest.approx(m.n_layers * (fwd + bwd), rel=1e-9)
    assert t.breakdown["matmul"] - flash.breakdown["matmul"] == pytest.approx(
        m.n_layers * (attn_f + attn_b - _flash_attention(plan, H100)), rel=1e-9
    )


def _flash_attention(plan: Plan, cluster: Cluster) -> float:
    """One layer's flash attention core on a cp rank, forward + backward (3.5x the forward)."""
    m, s, b = plan.model, plan.seq_len, plan.micro_batch_size
    core = m.attention_core_flops_per_token(s) / m.n_layers * b * s / plan.cp
    eff = cluster.gpu.calibration.attention_efficiency.value
    return 3.5 * 0.5 * core / (peak_flops(cluster, plan.precision) * eff)


def test_cp_shards_fsdp_over_dp_shard_times_cp_and_sends_s_over_cp_between_stages() -> None:
    plan = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=64, tp=8, pp=2,
                dp_shard=2, cp=2)  # fmt: skip
    assert plan.fsdp_shards == 4 and plan.world_size == 64
    base = replace(plan, cp=1, dp_shard=4)
    # The same FSDP group size: each parameter's shard, hence its gathers, are the same.
    assert (
        plan_rank_params(plan, 0, act.RUNTIME).shard_numel
        == plan_rank_params(base, 0, act.RUNTIME).shard_numel
    )
    t, t0 = estimate_step_time(plan, H100), estimate_step_time(base, H100)
    assert t.breakdown["cp_comm"] > 0
    # Each pipeline send carries s / cp tokens: the fill/drain path's sends halve.
    n = 2 * (plan.pp - 1)
    assert t.breakdown["pp_p2p"] / n < t0.breakdown["pp_p2p"] / n
    est = estimate_memory(plan)
    assert (
        est.worst.activations < estimate_memory(replace(plan, cp=1, dp_shard=4)).worst.activations
    )


def test_fp8_is_faster_than_bf16_on_h100_by_about_torchaos_published_ratio() -> None:
    """torchao's float8 training docs: 'up to 1.25x at 8 GPU / 8B parameter' (with compile):
    Llama 3 8B, FSDP over 8 H100s, seq 8192. The planner's ratio lands within 1.1-1.4x, and the
    casts are priced (a bare 2x GEMM peak would overshoot)."""
    bf16 = Plan(model=L8, seq_len=8192, micro_batch_size=1, global_batch_size=8, dp_shard=8)
    fp8 = replace(bf16, precision="fp8")
    tb, tf = estimate_step_time(bf16, H100), estimate_step_time(fp8, H100)
    ratio = tb.seconds / tf.seconds
    assert 1.1 < ratio < 1.4, ratio
    assert tf.breakdown["fp8_casts"] > 0 and "fp8_casts" not in tb.breakdown
    assert tf.breakdown["matmul"] < 0.8 * tb.breakdown["matmul"]
    # MFU against the bf16 peak (as torchtitan reports it), so it rises by the same ratio.
    assert tf.mfu / tb.mfu == pytest.approx(ratio, rel=1e-9)


def test_fp8_is_refused_on_a_gpu_without_fp8() -> None:
    plan = Plan(model=L8, seq_len=4096, micro_batch_size=1, global_batch_size=8, dp_shard=8,
                precision="fp8")  # fmt: skip
    with pytest.raises(ConfigError, match="a100-80g.*no FP8"):
        estimate_step_time(plan, Cluster.of("a100-80g"))
    with pytest.raises(ConfigError, match="no FP8"):
        search(L8, 8, Cluster.of("a100-80g"), 4096, 8, precision="fp8")


def test_the_vocabulary_parallel_loss_gathers_no_logits() -> None:
    """tp 8 on one rank: three all-reduces of 4 B per token over tp (max, sum of exp, target
    logit) per micro-batch; forcing the gathered loss prices an all-gather of the logits."""
    plan = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=8, tp=8,
                dp_replicate=1)  # fmt: skip
    t = estimate_step_time(plan, H100)
    tokens = 4096
    small = collective("all_reduce", 4.0 * tokens, 8, 8, H100.fabric).seconds
    assert t.breakdown["loss_comm"] == pytest.approx(plan.n_microbatches * 3 * small, rel=1e-12)
    gathered = replace(DEFAULT_TIME, kernels=act.Kernels(vocab_parallel=True, loss_parallel=False))
    tg = estimate_step_time(plan, H100, gathered)
    logits = collective("all_gather", tokens * L70.vocab_size * 2.0, 8, 8, H100.fabric).seconds
    assert tg.breakdown["loss_comm"] == pytest.approx(plan.n_microbatches * logits, rel=1e-12)
    assert tg.breakdown["loss_comm"] > 5 * t.breakdown["loss_comm"]  # small ones: latency
    assert (
        "loss_comm" not in estimate_step_time(replace(plan, tp=1, dp_replicate=8), H100).breakdown
    )


def test_search_splits_126_layers_unevenly_over_pp_8() -> None:
    r = search(L405, 512, Cluster.of("h200"), 4096, 512, top=3,
               space=SearchSpace(tp=8, pp=8, schedules=("1f1b",)))  # fmt: skip
    assert r.candidates, r.why_none()
    plan = r.candidates[0].plan
    assert plan.pp == 8 and plan.pp_layers == ()
    counts = [len(plan.rank_layers(k)) for k in range(8)]
    assert counts == stage_layer_counts(126, 8) and sorted(set(counts)) == [15, 16]
    assert counts[0] == counts[-1] == 15  # the embedding's and the head's ranks are lighter
    # The pace is a 16-layer rank: the step's per-stage times say so.
    st = r.candidates[0].time
    assert max(st.stage_fwd) == pytest.approx(st.stage_fwd[1])


def test_default_search_of_405b_tries_pp_that_does_not_divide_126() -> None:
    r = search(L405, 4096, Cluster.of("h200"), 4096, 1024, top=10)
    pps = {c.plan.pp for c in r.candidates}
    assert any(126 % p for p in pps), pps


def test_selective_op_and_every_k_are_not_ordered_under_tp() -> None:
    """op-level SAC keeps less than every_k; it is faster with sequence parallelism, but runs
    every block's TP all-reduces again without it (the runtime keeps only the reduce-scatter:
    OP_SAC_SAVED_COLLECTIVES), which makes it slower there: the search costs both."""
    assert RECOMPUTE_ORDER == ("none", "selective", "selective_op", "every_k", "full")
    assert RECOMPUTE_LEVEL["selective_op"] == RECOMPUTE_LEVEL["every_k"]
    base = Plan(model=L70, seq_len=4096, micro_batch_size=2, global_batch_size=64, tp=8, pp=4,
                dp_shard=2)  # fmt: skip
    for sp, op_faster in ((True, True), (False, False)):
        op = replace(base, recompute="selective_op", sequence_parallel=sp)
        k = replace(base, recompute="every_k", sequence_parallel=sp)
        t_op, t_k = estimate_step_time(op, H100), estimate_step_time(k, H100)
        assert (t_op.seconds < t_k.seconds) == op_faster
        assert estimate_memory(op).worst.activations < estimate_memory(k).worst.activations


def test_op_sac_runs_the_collectives_it_does_not_keep_again() -> None:
    """Under selective_op a block's backward re-runs the forward's all-gathers (SP) or
    all-reduces (no SP), never the reduce-scatters: the TP traffic grows by exactly that."""
    from llmscale.model.config import OP_SAC_SAVED_COLLECTIVES
    from llmscale.plan.collectives import collective

    assert frozenset({"reduce_scatter"}) == OP_SAC_SAVED_COLLECTIVES
    base = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=8, tp=8,
                dp_shard=1, dp_replicate=8)  # fmt: skip
    tokens_bytes = 4096 * L70.dim * 2
    for sp, kind in ((True, "all_gather"), (False, "all_reduce")):
        none = estimate_step_time(replace(base, sequence_parallel=sp), H100)
        op = estimate_step_time(replace(base, sequence_parallel=sp, recompute="selective_op"), H100)
        again = collective(kind, tokens_bytes, 8, 8, H100.fabric).seconds
        extra = op.breakdown["tp_comm"] - none.breakdown["tp_comm"]
        assert extra == pytest.approx(2 * L70.n_layers * again, rel=1e-9)


def test_fsdp_under_pp_reports_grad_bytes_as_the_runtime_measures_them() -> None:
    """The memory peak holds the unsharded fp32 gradients until the step's reduce-scatter; the
    runtime's grad_bytes is read after it: the fp32 shards."""
    plan = Plan(model=get_preset("tiny"), seq_len=64, micro_batch_size=1, global_batch_size=8,
                pp=2, dp_shard=2, precision="bf16")  # fmt: skip
    for rank in (0, 1):
        rp = plan_rank_params(plan, rank, act.RUNTIME)
        held = estimate_memory(plan).per_rank[rank].grads
        assert held == 4.0 * rp.numel
        got = expected_runtime_metrics(plan, rank)["grad_bytes"]
        assert got == 4.0 * rp.shard_numel and got < held
    no_pp = replace(plan, pp=1)
    rp = plan_rank_params(no_pp, 0, act.RUNTIME)
    assert expected_runtime_metrics(no_pp, 0)["grad_bytes"] == 4.0 * rp.shard_numel
