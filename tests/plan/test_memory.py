"""Memory model: three configurations computed by hand, ZeRO's textbook numbers, FSDP padding,
offload, pipeline in-flight micro-batches against the schedule simulator, Korthikanti."""

from __future__ import annotations

import math

import pytest

from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig, get_preset
from llmscale.plan import activations as act
from llmscale.plan.memory import (
    MemoryOptions,
    estimate_memory,
    head_inflight,
    inflight_units,
    plan_rank_params,
    zero_textbook_bytes,
)
from llmscale.plan.plan import Plan
from llmscale.plan.schedule import schedule_ops, simulate

L7 = get_preset("llama2-7b")
L70 = get_preset("llama2-70b")
PSI_7B = 6_738_415_616
TENSORS_7B = 1 + 32 * 9 + 2  # embedding; 2 norms + 7 linears per block; final norm + output


def test_config_a_llama2_7b_fp32_one_gpu() -> None:
    """fp32, no parallelism: 4 + 4 + 8 bytes per parameter, no working copies."""
    m = estimate_memory(
        Plan(model=L7, seq_len=4096, micro_batch_size=1, global_batch_size=1, precision="fp32")
    ).worst
    assert m.params == 4 * PSI_7B == 26_953_662_464
    assert m.grads == 4 * PSI_7B
    assert m.optimizer == 8 * PSI_7B + 4 * TENSORS_7B == 53_907_326_092
    assert m.working_params == 0
    d, f, h, tokens = 4096, 11008, 32, 4096
    # Per token per block (fp32, CUDA, n_kv = n_heads so the memory-efficient SDPA kernel):
    # two RMSNorms (input + rstd), two shared linear inputs, q k v out, log-sum-exp, SwiGLU x4.
    per_token_block = 2 * (4 * d + 4) + 2 * 4 * d + 4 * 4 * d + 4 * h + 4 * 4 * f
    assert per_token_block == 307_336
    head = (4 * d + 4 + 4 * d) * tokens + 4 * tokens * 32000 + 8 * tokens + 4
    token_ids = 8 * (tokens + 1)
    assert m.activations == 32 * per_token_block * tokens + head + token_ids == 40_941_731_852
    assert m.transient == 8 * tokens * 32000  # the loss's fp32 logit gradients
    assert m.allocator == pytest.approx(0.05 * m.allocated)


def test_config_b_llama2_7b_bf16_fsdp8_zero3_full_recompute() -> None:
    m = estimate_memory(
        Plan(
            model=L7,
            seq_len=4096,
            micro_batch_size=2,
            global_batch_size=16,
            precision="bf16",
            dp_shard=8,
            recompute="full",
            zero_stage=3,
        )
    ).worst
    shard = PSI_7B // 8  # every dim 0 (4096, 11008, 32000) divides by 8: no padding
    assert m.params == m.grads == 4 * shard == 3_369_207_808
    assert m.optimizer == 8 * shard + 4 * TENSORS_7B
    layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    root = 32000 * 4096 + 4096 + 32000 * 4096
    assert m.working_params == 2 * (2 * layer + root) == 1_333_829_632  # current + prefetched
    tokens = 2 * 4096
    # FSDP2 computes on bf16 weights: the residual stream is bf16, so each block keeps only its
    # bf16 input; the final RMSNorm (fused on CUDA) keeps its bf16 input and fp32 rstd.
    blocks = 32 * 2 * 4096 * tokens
    head = (2 * 4096 + 4 + 2 * 4096) * tokens + 4 * tokens * 32000 + 8 * tokens + 4
    assert m.activations == blocks + head + 8 * 2 * 4097
    assert m.transient == 8 * tokens * 32000  # larger than reduce-scatter's 6 B x one block


def test_config_c_llama2_70b_tp8_pp4_selective() -> None:
    plan = Plan(
        model=L70,
        seq_len=4096,
        micro_batch_size=1,
        global_batch_size=64,
        recompute="selective",
        tp=8,
        pp=4,
        pp_schedule="1f1b",
    )
    est = estimate_memory(plan)
    first, last = est.per_rank[0], est.per_rank[3]
    d, kv, f = 8192, 1024, 28672
    block_local = (2 * d * d + 2 * d * kv + 3 * d * f) // 8 + 2 * d  # norms are replicated
    assert block_local == 106_971_136
    # The runtime splits the untied embedding and head over tp along the vocabulary
    # (parallel/tensor_parallel.py; model.config.vocab_parallel): 32000 / 8 = 4000 rows per rank.
    # numel0 = 20 x 106_971_136 + 4000 x 8192 = 2_139_422_720 + 32_768_000 = 2_172_190_720.
    # (Before the planner derived this fact it counted the embedding whole: 32000 x 8192.)
    numel0 = 20 * block_local + (32000 // 8) * d
    assert numel0 == 2_172_190_720
    assert first.params == 4 * numel0 and first.grads == 4 * numel0
    assert first.optimizer == 8 * numel0 + 4 * (20 * 9 + 1)
    assert first.working_params == 2 * 20 * (2 * d * d + 2 * d * kv + 3 * d * f) // 8
    # Selective: everything but the log-sum-exp; norms and linear inputs whole on every tp rank.
    per_token = 2 * (4 * d + 4) + 5 * 2 * d + (2 * d + 2 * kv + 2 * kv + 2 * d) / 8 + 4 * 2 * f / 8
    assert first.inflight == 4  # 1F1B, stage 0 of 4
    # and the token ids of the step's 64 micro-batches: torch's pipelining splits the batch
    # into views, which the embeddings of the micro-batches in flight keep whole.
    assert first.activations == 4 * 20 * per_token * 4096 + 64 * 8 * 4097
    assert first.transient == 2 * 4096 * f // 8 * 2  # a block's backward: SwiGLU's gradients
    # Last rank: 20 blocks, the final norm (replicated) and 4000 vocabulary rows of the head.
    # numel3 = 2_139_422_720 + 8192 + 4000 x 8192 = 2_172_198_912.
    numel3 = 20 * block_local + d + (32000 // 8) * d
    assert numel3 == 2_172_198_912
    assert last.params == 4 * numel3
    # Autocast's bf16 casts: the blocks' linears and the head's 4000 x 8192 slice.
    assert last.working_params == 2 * (20 * (2 * d * d + 2 * d * kv + 3 * d * f) // 8 + 4000 * d)
    # The loss's fp32 temporaries, 12 B per logit: the runtime's loss runs on vocabulary shards
    # (torch's loss_parallel, model.config.loss_parallel), so 4000 columns per tp rank, and
    # loss_parallel's composite backward holds three (tests/parallel/test_loss_memory.py).
    # (Before issue 12 it gathered the logits first: all 32000 columns on every rank.)
    assert last.inflight == 1 and last.transient == 12 * 4096 * 32000 / 8
    assert est.worst is first


def test_fsdp_pads_each_tensor_to_the_shard_count() -> None:
    tiny = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=264)
    m = estimate_memory(
        Plan(
            model=tiny,
            seq_len=32,
            micro_batch_size=1,
            global_batch_size=5,
            dp_shard=5,
            precision="fp32",
        )
    ).worst
    rows = lambda n: math.ceil(n / 5)  # noqa: E731
    block = (
        2 * rows(64) * 1  # norms (64,)
        + rows(64) * 64
        + 2 * rows(32) * 64
        + rows(64) * 64  # wq, wk, wv, wo
        + 2 * rows(192) * 64
        + rows(64) * 192
    )  # w1, w3, w2
    emb, head = rows(264) * 64, rows(64) + rows(264) * 64
    shard = 2 * block + emb + head
    assert m.params == 4 * shard and m.grads == 4 * shard
    assert shard > tiny.num_params() / 5


def test_zero_textbook_matches_the_zero_paper_figure_1() -> None:
    """Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64-way data parallel."""
    psi = 7_500_000_000
    got = [zero_textbook_bytes(psi, s, 64) / 1e9 for s in range(4)]
    assert got == [120.0, 31.40625, 16.640625, 1.875]  # the figure: 120, 31.4, 16.6, 1.88 GB
    with pytest.raises(ConfigError):
        zero_textbook_bytes(psi, 4, 64)


def test_zero_stages_1_and_2_keep_every_block_unsharded() -> None:
    base = dict(model=L7, seq_len=2048, micro_batch_size=1, global_batch_size=8, dp_shard=8)
    z3 = estimate_memory(Plan(**base, zero_stage=3)).worst
    z1 = estimate_memory(Plan(**base, zero_stage=1)).worst
    layer = L7.layer_params()
    assert z1.working_params - z3.working_params == 2 * 30 * layer
    assert z1.states == z3.states


def test_offload_moves_optimizer_and_master_to_the_host() -> None:
    base = dict(model=L7, seq_len=2048, micro_batch_size=1, global_batch_size=1, precision="bf16")
    none = estimate_memory(Plan(**base)).worst
    opt = estimate_memory(Plan(**base, offload="optimizer")).worst
    both = estimate_memory(Plan(**base, offload="optimizer+params")).worst
    assert none.host == 0
    assert opt.host == 12 * PSI_7B + 4 * TENSORS_7B
    assert opt.params == 2 * PSI_7B and opt.optimizer == 0
    # Gradients go to the host as backward produces them: one block's at a time on the device.
    assert opt.grads == 0 and opt.transient >= 2 * L7.layer_params()
    assert both.params == 0 and both.host == opt.host + 2 * PSI_7B
    assert both.total < opt.total < none.total
    # On the device only two consecutive units at a time (two blocks: each is larger than the
    # embedding or the head), and one block's gradients in flight.
    assert both.grads == 0 and both.working_params == 2 * 2 * L7.layer_params()
    assert both.transient >= 2 * L7.layer_params()
    # fp32: the master itself is uploaded; no second host copy.
    fp32 = dict(base, precision="fp32")
    opt32 = estimate_memory(Plan(**fp32, offload="optimizer")).worst
    assert estimate_memory(Plan(**fp32, offload="optimizer+params")).worst.host == opt32.host


def test_optimizer_and_params_under_fsdp2_is_its_cpu_offload_policy() -> None:
    """fp32 shards (master), their gradients and the moments on the host: 16 B per parameter of
    the shard; on the device only the unsharded units in use, as without offload."""
    base = dict(model=L7, seq_len=2048, micro_batch_size=1, global_batch_size=8, dp_shard=8)
    base.update(precision="bf16")
    none = estimate_memory(Plan(**base)).worst
    both = estimate_memory(Plan(**base, offload="optimizer+params")).worst
    shard = none.params / 4  # the rank's fp32 shard, in elements
    assert both.params == both.grads == both.optimizer == 0
    assert both.host == 16 * shard + 4 * TENSORS_7B
    assert both.working_params == none.working_params
    # replicate: every unit from its forward to its backward, the whole model's 16 B on the host
    rep = dict(base, dp_shard=1, dp_replicate=8)
    r = estimate_memory(Plan(**rep, offload="optimizer+params")).worst
    assert r.host == 16 * PSI_7B + 4 * TENSORS_7B and r.working_params == 2 * PSI_7B


def test_replicate_holds_param_dtype_copies_not_autocast_casts() -> None:
    """The runtime's replicate is FSDP2's, with its param_dtype: every parameter's bf16 copy is
    held from its unit's forward to its backward (autocast casts nothing), and the gradients
    are all-reduced in fp32 (one block's bf16 and fp32 gradients, a transient). One process
    runs autocast: the linears' 2 B casts (tests/parallel/test_fsdp_pipeline_memory.py measures
    both under a pipeline). The torchtitan stack's DDP runs autocast."""
    from llmscale.stack import TORCHTITAN

    base = dict(model=L7, seq_len=2048, micro_batch_size=1, global_batch_size=8)
    rep = estimate_memory(Plan(**base, dp_replicate=8, precision="bf16")).worst
    one = estimate_memory(Plan(**base, precision="bf16")).worst
    rp = plan_rank_params(Plan(**base), 0, act.RUNTIME)
    assert rp.numel == PSI_7B and rp.autocast_numel == PSI_7B - 32 * 2 * 4096 - 4096 - 32000 * 4096
    assert rep.working_params == 2 * PSI_7B and one.working_params == 2 * rp.autocast_numel
    assert rep.transient >= 6 * rp.block.numel  # (bf16 + fp32) x one block
    assert rep.params == one.params == 4 * PSI_7B
    fp32 = estimate_memory(Plan(**base, dp_replicate=8, precision="fp32")).worst
    assert fp32.working_params == 4 * PSI_7B
    titan_plan = Plan(**base, dp_replicate=8, precision="bf16")
    titan = estimate_memory(titan_plan, MemoryOptions(stack=TORCHTITAN)).worst
    assert titan.working_params == 2 * rp.autocast_numel


_CASES = [
    (schedule, pp, mult, chunks)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    for pp in (2, 3, 4, 6)
    for mult in (1, 2, 3)
    for chunks in ((1, 2, 3) if schedule == "interleaved_1f1b" else (1,))
]


@pytest.mark.parametrize(("schedule", "pp", "mult", "chunks"), _CASES)
def test_inflight_closed_form_equals_the_simulator(
    schedule: str, pp: int, mult: int, chunks: int
) -> None:
    m = pp * mult
    sim = simulate(schedule, pp, m, chunks)
    assert [inflight_units(schedule, pp, m, chunks, r) for r in range(pp)] == list(
        sim.peak_inflight
    )


@pytest.mark.parametrize(
    ("schedule", "chunks"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]
)
def test_last_stage_holds_one_micro_batch_of_logits_except_gpipe(
    schedule: str, chunks: int
) -> None:
    pp, m = 4, 8
    order = schedule_ops(schedule, pp, m, chunks)[pp - 1]
    last = chunks * pp - 1
    held = peak = 0
    for op in order:
        if op.stage == last:
            held += 1 if op.kind == "F" else -1
            peak = max(peak, held)
    plan = Plan(
        model=L70,
        seq_len=4096,
        micro_batch_size=1,
        global_batch_size=m,
        tp=8,
        pp=pp,
        pp_schedule=schedule,
        pp_chunks=chunks,
    )
    assert head_inflight(plan) == peak


def test_korthikanti_gpt3_layer_within_one_percent() -> None:
    """Their eq. 1 for a GPT-3 175B layer (s = 2048, b = 1): sbh(34 + 5as/h) bytes."""
    g = get_preset("gpt3-175b")
    s, h, a = 2048, 12288, 96
    assert act.korthikanti_bytes(g, 1, s) == s * h * (34 + 5 * a * s / h) == 2_868_903_936
    for tp, sp in ((1, False), (8, False), (8, True)):
        for mode in ("none", "selective", "full"):
            ours = act.block_bytes(g, 1, s, "fp16", tp, sp, act.MEGATRON_2021, mode)
            ref = act.korthikanti_bytes(g, 1, s, tp, sp, mode)
            assert ours == pytest.approx(ref, rel=0.01), (tp, sp, mode)
    # Their sequence-parallel + selective figure: 34 sbh / t.
    assert act.korthikanti_bytes(g, 1, s, 8, True, "selective") == 34 * s * h / 8


def test_sdpa_is_much_smaller_than_the_materialised_softmax() -> None:
    ours = act.block_bytes(L70, 1, 4096, "bf16")
    math_kernel = act.block_bytes(L70, 1, 4096, "bf16", kernels=act.Kernels(attention="math"))
    assert math_kernel > 2 * ours  # the s x s matrices dominate at s = 4096


def test_sequence_parallel_divides_norm_tensors_only() -> None:
    full = act.block_tensors(L70, 1, 4096, "bf16", 8, False)
    sp = act.block_tensors(L70, 1, 4096, "bf16", 8, True)
    for a, b in zip(full, sp, strict=True):
        assert b.nbytes == (a.nbytes / 8 if a.region == "norm" else a.nbytes)
    megatron = act.Kernels(sp_saves_gathered_input=False)
    sp_m = act.block_tensors(L70, 1, 4096, "bf16", 8, True, megatron)
    for a, b in zip(full, sp_m, strict=True):
        assert b.nbytes == (a.nbytes / 8 if a.region in ("norm", "linear_in") else a.nbytes)


def test_bad_plans_name_the_field() -> None:
    with pytest.raises(ConfigError) as e:
        estimate_memory(
            Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=64, tp=3)
        )
    assert e.value.field == "parallel.tp"
    with pytest.raises(ConfigError) as e:
        estimate_memory(
            Plan(model=L70, seq_len=4096, micro_batch_size=3, global_batch_size=64, dp_shard=2)
        )
    assert e.value.field == "train.global_batch_size"
    with pytest.raises(ConfigError) as e:
        estimate_memory(
            Plan(
                model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=64, recompute="some"
            )
        )
    assert e.value.field == "train.recompute"
    # More pipeline stages than layers: the runtime refuses it, and so does the planner. (An
    # uneven split such as pp=3 over 80 layers runs, and is costed: see the test below.)
    with pytest.raises(ConfigError) as e:
        estimate_memory(
            Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=128, pp=81)
        )
    assert e.value.field == "parallel.pp"


def test_uneven_pipeline_split_is_the_runtimes() -> None:
    """80 layers over pp=3: 27, 27, 26 blocks (extra layers to the earliest ranks), as
    parallel/pipeline.py splits them; the planner used to refuse this layout."""
    plan = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=64, pp=3)
    assert [len(plan.rank_layers(r)) for r in range(3)] == [27, 27, 26]
    est = estimate_memory(plan)
    d, kv, f = 8192, 1024, 28672
    block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    assert est.per_rank[0].params == 4 * (27 * block + 32000 * d)
    assert est.per_rank[1].params == 4 * (27 * block)
    assert est.per_rank[2].params == 4 * (26 * block + d + 32000 * d)
    # 1F1B: ranks hold pp - rank micro-batches of their own blocks' activations; rank 0 also
    # the token ids of the step's 64 micro-batches (views of one batch: embedding_inflight).
    a0, a1 = est.per_rank[0].activations, est.per_rank[1].activations
    assert a1 == pytest.approx(2 * 27 * (a0 - 64 * 8 * 4097) / (3 * 27))


def test_options_change_the_overheads() -> None:
    plan = Plan(model=L7, seq_len=2048, micro_batch_size=1, global_batch_size=1)
    a = estimate_memory(plan).worst
    b = estimate_memory(plan, MemoryOptions(allocator_overhead=0.0)).worst
    assert b.allocator == 0 and a.allocated == b.allocated


# ---- issue 12: wider layouts ----------------------------------------------------------------

L405 = get_preset("llama3-405b")
GPT3 = get_preset("gpt3-175b")


def test_explicit_pp_layers_are_what_each_rank_holds() -> None:
    """Llama 3 405B (126 layers) over pp=4: automatic 31, 32, 32, 31 (the embedding's and the
    head's ranks lighter); explicit [30, 33, 33, 30] moves a block from each end inwards."""
    base = dict(model=L405, seq_len=8192, micro_batch_size=1, global_batch_size=16, pp=4, tp=8)
    auto = Plan(**base)
    assert [len(auto.rank_layers(r)) for r in range(4)] == [31, 32, 32, 31]
    plan = Plan(**base, pp_layers=(30, 33, 33, 30))
    assert [plan.rank_layers(r) for r in range(4)] == [
        list(range(0, 30)), list(range(30, 63)), list(range(63, 96)), list(range(96, 126)),
    ]  # fmt: skip
    a, b = estimate_memory(auto), estimate_memory(plan)
    block = (b.per_rank[1].params - a.per_rank[1].params) / 4  # one block's fp32 params per tp rank
    assert block > 0
    assert a.per_rank[0].params - b.per_rank[0].params == 4 * block
    assert a.per_rank[3].params - b.per_rank[3].params == 4 * block
    # The job and the plan convert both ways with the list (a tuple in the plan).
    job = plan.to_job()
    assert job.parallel.pp_layers == [30, 33, 33, 30] and Plan.from_job(job) == plan
    assert "--parallel.pp_layers [30,33,33,30]" in plan.overrides()


@pytest.mark.parametrize(
    ("pp_layers", "needle"),
    [
        ((60, 66), "4 entries"),
        ((42, 0, 42, 42), "every stage but the first and the last"),
        ((31, 31, 31, 31), "got 124"),
    ],
)
def test_bad_pp_layers_are_refused_by_the_planner(pp_layers, needle) -> None:
    plan = Plan(
        model=L405, seq_len=8192, micro_batch_size=1, global_batch_size=16, pp=4,
        pp_layers=pp_layers,
    )  # fmt: skip
    with pytest.raises(ConfigError) as e:
        estimate_memory(plan)
    assert e.value.field == "parallel.pp_layers" and needle in str(e.value)


def test_sequence_parallel_with_learned_positions_and_tied_embeddings_is_costed() -> None:
    """GPT-3 175B (learned positions, tied embeddings) with SP: the planner used to refuse it
    as the runtime did. The block's norm-region tensors split over tp; the tied head (replicated,
    its logits whole on every rank) is the same as without SP but for the final norm."""
    base = dict(model=GPT3, seq_len=2048, micro_batch_size=1, global_batch_size=8, tp=8)
    sp = estimate_memory(Plan(**base, sequence_parallel=True)).worst
    no = estimate_memory(Plan(**base)).worst
    assert sp.params == no.params  # SP moves no parameter
    assert sp.activations < no.activations
    blk = act.block_tensors(GPT3, 1, 2048, "bf16", 8, True)
    norm = [t for t in blk if t.region == "norm"]
    assert len(norm) == 6  # two LayerNorms: input, mean, rstd each
    whole = act.block_tensors(GPT3, 1, 2048, "bf16", 8, False)
    assert sum(t.nbytes for t in norm) * 8 == pytest.approx(
        sum(t.nbytes for t in whole if t.region == "norm")
    )


def test_loss_parallel_keeps_a_vocabulary_shard_of_the_logits() -> None:
    """Untied models under TP: the runtime's loss runs on vocabulary shards (torch's
    loss_parallel), so the saved log-softmax and the loss's transient are 1/tp of the logits;
    a tied model keeps them whole."""
    plan = Plan(model=L7, seq_len=4096, micro_batch_size=1, global_batch_size=8, tp=8)
    last = estimate_memory(plan).worst
    assert last.transient == 12 * 4096 * 32000 / 8
    head = act.head_tensors(L7, 1, 4096, "bf16", 8, False, act.RUNTIME)
    (logits,) = [t for t in head if t.name.startswith("log-softmax")]
    assert logits.nbytes == 4 * 4096 * 32000 / 8
    tied = act.head_tensors(GPT3, 1, 2048, "bf16", 8, False, act.RUNTIME)
    (whole,) = [t for t in tied if t.name.startswith("log-softmax")]
    assert whole.nbytes == 4 * 2048 * 50257


def test_each_cross_entropy_kernel_keeps_and_moves_what_its_code_does() -> None:
    """Per bf16 logit of a vocabulary shard (tp 8, Llama 2's 32,000 words): torch's
    `loss_parallel` moves 38 B forward (the fp32 copy, then amax, shift, exp, sum and result as
    separate kernels) and 38 backward; Megatron's vocab-parallel cross-entropy keeps its fp32
    softmax and moves 38 and 14 (in-place scaling, the cast); fused, 22 and 10;
    TransformerEngine's keeps the bf16 gradient it wrote over the logits and moves 6 and 4.
    Whole logits in fp32 (tp 1, the CPU runtime): torch's log_softmax and its backward, 16 and
    20, no copies. A compiled loss is priced by passes over what it keeps (None). An unknown
    kernel is refused naming the four."""
    import dataclasses

    args = (L7, 1, 4096, "bf16", 8, True)
    logits = 4096 * 32000 / 8
    expect = {
        "torch": (38, 38, 4, 12),
        "megatron": (38, 14, 4, 2),
        "megatron_fused": (22, 10, 4, 2),
        "te": (6, 4, 2, 0),
    }
    for kernel, (fwd, bwd, kept, held) in expect.items():
        kern = dataclasses.replace(act.RUNTIME, loss_kernel=kernel)
        assert act.loss_traffic(*args, kern) == (fwd * logits, bwd * logits)
        (saved,) = act.loss_tensors(*args, kern)
        assert saved.nbytes == kept * logits
        assert act.loss_transient_bytes(*args, kern) == held * logits
    whole = 4096 * 32000
    assert act.loss_traffic(L7, 1, 4096, "fp32") == (16 * whole, 20 * whole)
    compiled = dataclasses.replace(act.RUNTIME, compiled_loss=True)
    assert act.loss_traffic(*args, compiled) is None
    bad = dataclasses.replace(act.RUNTIME, loss_kernel="liger")
    with pytest.raises(
        ConfigError, match=r"loss_kernel.*torch \| megatron \| megatron_fused \| te"
    ):
        act.loss_traffic(*args, bad)


def test_context_parallelism_divides_activations_and_shards_states_further() -> None:
    base = dict(model=L7, seq_len=4096, micro_batch_size=1, global_batch_size=8, dp_shard=8)
    one, two = Plan(**base), Plan(**base, cp=2)
    assert two.world_size == 16 and two.fsdp_shards == 16 and one.fsdp_shards == 8
    a, b = estimate_memory(one).worst, estimate_memory(two).worst
    assert b.activations == pytest.approx(a.activations / 2)
    assert b.params < a.params and b.params == pytest.approx(a.params / 2, rel=1e-3)
    # Without FSDP the cp ranks hold the states whole. (fp32: in bf16 the cp ranks run on
    # replicate's bf16 weights and one process under autocast, which saves more.)
    solo = dict(base, dp_shard=1, global_batch_size=1, precision="fp32")
    c = estimate_memory(Plan(**solo, cp=2)).worst
    d = estimate_memory(Plan(**solo)).worst
    assert c.params == d.params and c.activations == pytest.approx(d.activations / 2)
    with pytest.raises(ConfigError) as e:
        estimate_memory(Plan(**dict(base, seq_len=4094), cp=2))
    assert e.value.field == "data.seq_len"


def test_fp8_memory_is_bf16_memory() -> None:
    """torchao's float8 linears save their bf16 input and weight and cast per matmul: the
    planner's bytes are bf16's; only the time model prices the float8 matmuls."""
    base = dict(model=L7, seq_len=4096, micro_batch_size=1, global_batch_size=8, dp_shard=8)
    fp8, bf16 = Plan(**base, precision="fp8"), Plan(**base, precision="bf16")
    assert fp8.fp8_matmuls and not bf16.fp8_matmuls
    assert estimate_memory(fp8).worst.breakdown() == estimate_memory(bf16).worst.breakdown()


def test_fsdp_under_a_pipeline_holds_unsharded_gradients_across_micro_batches() -> None:
    """torch's pipeline schedules turn FSDP2's gradient sync and reshard-after-backward off for
    every micro-batch and reduce-scatter once at the step's end: each stage holds its unsharded
    fp32 gradients and unsharded params (param_dtype) until then, whatever the zero_stage."""
    base = dict(model=L7, seq_len=4096, micro_batch_size=1, global_batch_size=16, dp_shard=4)
    plan = Plan(**base, pp=2)
    assert plan.fsdp_holds_grads_across_microbatches
    assert not Plan(**base).fsdp_holds_grads_across_microbatches
    st = estimate_memory(plan).per_rank[0]
    sp = plan_rank_params(plan, 0, act.RUNTIME)
    assert st.grads == 4 * sp.numel  # unsharded, fp32 (FSDP2's reduce_dtype)
    assert st.params == 4 * sp.shard_numel
    assert st.working_params == 2 * sp.numel  # every unit unsharded in bf16
    without_pp = estimate_memory(Plan(**base)).worst
    assert without_pp.grads == 4 * plan_rank_params(Plan(**base), 0, act.RUNTIME).shard_numel


def test_selective_op_block_by_hand_llama3_8b() -> None:
    """selective_op (torchtitan's op-level policy), Llama 3 8B, bf16, CUDA kernels: the block
    input (fp32 residual), wq, wv, w1 and w2 outputs, flash's output and log-sum-exp. Under
    tp 2 with sequence parallelism: column-parallel outputs and attention halve, w2's output is
    a partial sum (whole), the block input halves and the two reduce-scattered outputs join."""
    m = get_preset("llama3-8b")
    d, kv, f, h = m.dim, m.kv_dim, m.ffn_dim, m.n_heads
    b, s = 2, 8192
    per_token = 4 * d + 2 * d + 2 * kv + 2 * f + 2 * d + 2 * d + 4 * h
    assert act.block_bytes(m, b, s, "bf16", mode="selective_op") == per_token * b * s
    tp_sp = (4 * d + 2 * 2 * d) / 2 + (2 * d + 2 * kv + 2 * f + 2 * d + 4 * h) / 2 + 2 * d
    assert act.block_bytes(m, b, s, "bf16", 2, True, mode="selective_op") == tp_sp * b * s
    # between full and selective; the checkpoint's own input is what outlives the backward
    full = act.block_bytes(m, b, s, "bf16", mode="full")
    assert (
        full
        < act.block_bytes(m, b, s, "bf16", mode="selective_op")
        < act.block_bytes(m, b, s, "bf16", mode="selective")
    )
    kept = act.checkpoint_inputs(
        act.block_tensors(m, b, s, "bf16", mode="selective_op"), "selective_op"
    )
    assert sum(x.nbytes for x in kept) == full
    # a composite attention path (Megatron's materialised softmax) leaves nothing of attention
    mega = act.block_bytes(m, b, s, "bf16", kernels=act.MEGATRON_2021, mode="selective_op")
    assert mega == (2 * d + 2 * d + 2 * kv + 2 * f + 2 * d) * b * s  # fp16 residual


def test_selective_op_recomputes_the_unsaved_matmuls() -> None:
    """Its FLOP share: wk, wo and w3 (SwiGLU) or wk, wo and w2 (GELU) over the block forward."""
    m = get_preset("llama3-8b")
    d, kv, f, s = m.dim, m.kv_dim, m.ffn_dim, 8192
    block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * s * d
    assert m.recompute_fraction("selective_op", s) == pytest.approx(
        (d * kv + d * d + d * f) / block
    )
    g = get_preset("gpt3-175b")
    block = 4 * g.dim**2 + 2 * g.dim * g.ffn_dim + 2 * 2048 * g.dim
    want = (g.dim**2 + g.dim**2 + g.ffn_dim * g.dim) / block
    assert g.recompute_fraction("selective_op", 2048) == pytest.approx(want)
    plan = Plan(
        model=m, seq_len=s, micro_batch_size=1, global_batch_size=1, recompute="selective_op"
    )
    assert plan.block_modes(list(range(m.n_layers))) == {"selective_op": m.n_layers}
