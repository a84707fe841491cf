"""Stacks: what each training stack does, stated once and read by memory and time alike."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import Calibration
from llmscale.hardware.spec import Sourced
from llmscale.model.config import get_preset, op_sac_saves_matmul
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.collectives import collective
from llmscale.plan.memory import (
    DEFAULT_OPTIONS,
    block_bytes,
    estimate_memory,
    memory_options,
    rank_activity,
)
from llmscale.plan.plan import Plan
from llmscale.plan.time import DEFAULT_TIME, eager_block_bytes, estimate_step_time, time_params
from llmscale.stack import (
    LLMSCALE,
    MEGATRON_2021,
    MEGATRON_CORE,
    STACK_NAMES,
    STACKS,
    TORCHTITAN,
    DeviceCosts,
    Stack,
    get_stack,
    param_residency,
    recompute_problem,
    stacks_help,
    tied_pipeline_problem,
)
from llmscale.stack.options import with_options

L8 = get_preset("llama3-8b")
L70 = get_preset("llama2-70b")
H100 = Cluster.of("h100")


def test_the_four_stacks() -> None:
    assert STACK_NAMES == ("llmscale", "megatron-2021", "megatron-core", "torchtitan")
    assert time_params(LLMSCALE) == DEFAULT_TIME  # the runtime's own declarations
    assert memory_options(LLMSCALE) == DEFAULT_OPTIONS
    assert MEGATRON_2021.kernels == act.MEGATRON_2021
    with pytest.raises(ConfigError, match="llmscale | megatron-2021 | megatron-core | torchtitan"):
        get_stack("deepspeed")
    for name in STACK_NAMES:
        assert name in stacks_help() and get_stack(name).source


def test_selective_means_the_attention_core_everywhere() -> None:
    assert recompute_problem(LLMSCALE, "selective") is None
    assert recompute_problem(MEGATRON_CORE, "selective") is None
    why = recompute_problem(TORCHTITAN, "selective")
    assert why is not None and "selective_op" in why
    assert "selective" in (recompute_problem(MEGATRON_CORE, "selective_op") or "")


@pytest.mark.parametrize(
    ("stack", "zero", "pp", "m", "want"),
    [
        # The llmscale runtime (issue table in docs/parallel.md; PipelineStage under pp).
        (LLMSCALE, 1, 1, 4, (0, True, True, True)),
        (LLMSCALE, 1, 1, 1, (0, True, True, False)),
        (LLMSCALE, 2, 1, 4, (0, False, True, False)),
        (LLMSCALE, 3, 1, 4, (2, False, False, False)),
        (LLMSCALE, 1, 2, 4, (0, True, True, True)),
        (LLMSCALE, 3, 2, 4, (1, True, True, True)),
        # torchtitan: reshard after forward unless pipelined.
        (TORCHTITAN, 3, 1, 4, (2, False, False, False)),
        (TORCHTITAN, 3, 4, 4, (0, True, True, True)),
        # Megatron-Core's distributed optimizer: one gather and one reduce per step.
        (MEGATRON_CORE, 1, 1, 8, (0, True, True, True)),
        (MEGATRON_CORE, 1, 8, 8, (0, True, True, True)),
    ],
)
def test_param_residency(stack, zero, pp, m, want) -> None:  # type: ignore[no-untyped-def]
    r = param_residency(stack, zero_stage=zero, pp=pp, n_microbatches=m)
    assert (
        r.gathers_per_microbatch,
        r.grads_per_step,
        r.stage_unsharded,
        r.grads_unsharded,
    ) == want


def test_gathered_once_per_step_costs_one_gather_per_step() -> None:
    """Megatron-Core's distributed optimizer gathers a stage once per step, FSDP2 resharding
    after forward (torchtitan without a pipeline) in every micro-batch's forward and backward:
    with 16 micro-batches the first pays its gathers 16 times, the other once, and the memory
    model keeps the whole stage unsharded under the first rule only."""
    plan = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=16 * 8,
                dp_shard=8, tp=8, zero_stage=1, recompute="full", sequence_parallel=True)  # fmt: skip
    once = estimate_step_time(plan, H100, time_params(MEGATRON_CORE), validate=False)
    every = estimate_step_time(
        replace(plan, zero_stage=3), H100, time_params(TORCHTITAN), validate=False
    )
    assert every.breakdown["fsdp_comm"] > 10 * once.breakdown.get("fsdp_comm", 0.0)
    whole = estimate_memory(plan, memory_options(MEGATRON_CORE), validate=False).worst
    window = estimate_memory(
        replace(plan, zero_stage=3), memory_options(TORCHTITAN), validate=False
    ).worst
    assert whole.working_params > 10 * window.working_params


def test_distributed_optimizer_states_are_megatrons_6_plus_12_over_d() -> None:
    """bf16 parameters and fp32 main gradients unsharded (2 + 4 B), the fp32 master and both
    moments sharded over dp (12 B / d): Megatron-Core's distributed optimizer; 4 + 12 / d with
    the gradients reduced in bf16 (the stack's default, as NVIDIA's performance scripts run)."""
    plan = Plan(model=L8, seq_len=4096, micro_batch_size=1, global_batch_size=64, dp_shard=8,
                zero_stage=1)  # fmt: skip
    n = L8.num_params()
    fp32 = with_options(MEGATRON_CORE, {"grad-reduce-in-bf16": False})
    for stack, unsharded in ((fp32, 6), (MEGATRON_CORE, 4)):
        mem = estimate_memory(plan, memory_options(stack), validate=False).worst
        states = mem.params + mem.grads + mem.optimizer + mem.working_params
        assert states == pytest.approx((unsharded + 12 / 8) * n, rel=0.01)


def test_megatron_frees_pipeline_buffers() -> None:
    plan = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=64, tp=8, pp=4,
                pp_schedule="1f1b")  # fmt: skip
    torch_ = estimate_memory(plan, memory_options(LLMSCALE.on(kernels=MEGATRON_CORE.kernels)),
                             validate=False).per_rank[1]  # fmt: skip
    freed = estimate_memory(plan, memory_options(MEGATRON_CORE), validate=False).per_rank[1]
    assert torch_.pipeline_buffers > 0 and freed.pipeline_buffers == 0


def test_tp_comm_overlap_hides_tensor_parallel_traffic() -> None:
    plan = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=1, tp=8,
                sequence_parallel=True, recompute="full")  # fmt: skip
    exposed = estimate_step_time(plan, H100, replace(time_params(MEGATRON_CORE),
                                 tp_overlap_gemm=False), validate=False)  # fmt: skip
    hidden = estimate_step_time(plan, H100, time_params(MEGATRON_CORE), validate=False)
    assert hidden.breakdown["tp_comm"] < 0.5 * exposed.breakdown["tp_comm"]


def test_each_tp_collective_hides_behind_the_gemms_beside_it() -> None:
    """With TP overlap (async TP, Megatron's tp_comm_overlap) an all-gather hides behind the
    column-parallel GEMMs reading it and a reduce-scatter behind the row-parallel GEMM writing
    its input, region by region: for Llama 3 8B at tp 8 the attention region's small GEMMs (wq,
    wk, wv; wo) leave part of its traffic exposed, the MLP's hide theirs."""
    from llmscale.plan.collectives import collective
    from llmscale.plan.time import _overlapped, tp_region_gemm_seconds

    plan = Plan(model=L8, seq_len=8192, micro_batch_size=12, global_batch_size=96, tp=8,
                dp_shard=8, sequence_parallel=True)  # fmt: skip
    tp_ = time_params(TORCHTITAN.on(tp_overlap_gemm=True))
    h100 = H100.run_by(tp_.stack)  # the GEMMs at the rates torchtitan reaches on Hopper
    peak = h100.gpu.peak_flops("bf16")
    (a_cols, a_rows), (m_cols, m_rows) = tp_region_gemm_seconds(plan, h100, peak, None)
    assert a_cols < m_cols and a_rows < m_rows
    nbytes = 12 * 8192 * L8.dim * 2
    ag = collective("all_gather", nbytes, 8, 8, H100.fabric).seconds
    rs = collective("reduce_scatter", nbytes, 8, 8, H100.fabric).seconds
    assert ag > a_cols and rs > a_rows  # the attention region cannot hide its traffic
    eta = tp_.dp_overlap
    per_block = sum(_overlapped(c, g, eta) for c, g in ((ag, a_cols), (rs, a_rows), (ag, m_cols),
                                                         (rs, m_rows)))  # fmt: skip
    step = estimate_step_time(plan, H100, tp_, validate=False)
    # forward, backward (mirrors beside the same GEMMs), and op-free: no recompute here
    assert step.breakdown["tp_comm"] == pytest.approx(2 * L8.n_layers * per_block, rel=1e-9)


def test_micro_pipelined_tp_runs_its_gemms_in_tp_row_chunks() -> None:
    """torch's async TP multiplies each peer's shard of the tokens as it arrives: every linear
    of a block is tp GEMMs of M / tp rows, in forward, in the backward's input gradients and in
    a full recompute (weight gradients stay whole). A hand sum over the block's linears on the
    GPU's GEMM size curve; nothing without the chunks, without SP, or with Megatron's overlap."""
    from llmscale.plan.time import block_gemms, tp_chunked_gemm_seconds

    plan = Plan(model=L8, seq_len=8192, micro_batch_size=1, global_batch_size=8, tp=8,
                dp_shard=8, sequence_parallel=True, recompute="full")  # fmt: skip
    async_tp = TORCHTITAN.on(tp_overlap_gemm=True, tp_overlap_chunks=True)
    h100 = H100.run_by(TORCHTITAN)  # the rates torchtitan reaches on Hopper
    cal, peak = h100.gpu.calibration, h100.gpu.peak_flops("bf16")

    def seconds(m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / (peak * cal.gemm_efficiency_at(m, n, k))

    by_hand = sum(8 * seconds(m // 8, n, k) - seconds(m, n, k) for m, n, k in block_gemms(plan))
    split = tp_chunked_gemm_seconds(plan, h100, time_params(async_tp), peak, None)
    assert split == pytest.approx(by_hand, rel=1e-12) and split > 0
    whole = estimate_step_time(plan, H100, time_params(TORCHTITAN.on(tp_overlap_gemm=True)),
                               validate=False)  # fmt: skip
    chunked = estimate_step_time(plan, H100, time_params(async_tp), validate=False)
    n_micro = plan.n_microbatches
    # forward + input gradients + the full recompute's forward, per block and micro-batch
    assert chunked.breakdown["matmul"] - whole.breakdown["matmul"] == pytest.approx(
        3 * L8.n_layers * n_micro * split, rel=1e-9
    )
    no_sp = replace(plan, sequence_parallel=False)
    assert tp_chunked_gemm_seconds(no_sp, H100, time_params(async_tp), peak, None) == 0.0
    assert tp_chunked_gemm_seconds(plan, H100, time_params(MEGATRON_CORE), peak, None) == 0.0


def test_micro_pipelined_tp_fuses_a_reduce_scatter_only_with_the_matmul_producing_it() -> None:
    """torch's async TP (micro_pipeline_tp.py `_find_producer_matmul`) fuses a reduce-scatter
    with the one matmul producing its input: the forward's row-parallel outputs, each then
    reduced by a kernel reading the tp partial shards (`_fused_matmul_reduce_scatter_impl`);
    the backward's reduce-scatter of a region with several column-parallel linears (wq, wk, wv;
    w1, w3) reads the sum of their input gradients and runs unfused, exposed in full. A GELU
    MLP has one column-parallel linear (w1): its backward reduce-scatter is fused."""
    from llmscale.plan.collectives import collective
    from llmscale.plan.time import _overlapped, _tp_block_seconds, tp_region_gemm_seconds

    async_tp = time_params(TORCHTITAN.on(tp_overlap_gemm=True, tp_overlap_chunks=True))
    peak = H100.gpu.peak_flops("bf16")
    hbm = H100.gpu.hbm_bandwidth * H100.gpu.calibration.hbm_efficiency.value
    eta = async_tp.dp_overlap
    gpt = get_preset("gpt2-124m")
    for model, unfused in ((L8, [True, True]), (gpt, [True, False])):
        plan = Plan(model=model, seq_len=1024 if model is gpt else 8192, micro_batch_size=4,
                    global_batch_size=32, tp=4, dp_shard=2, sequence_parallel=True)  # fmt: skip
        nbytes = 4 * plan.seq_len * model.dim * 2
        ag = collective("all_gather", nbytes, 4, 4, H100.fabric).seconds
        rs = collective("reduce_scatter", nbytes, 4, 4, H100.fabric).seconds
        reduction = (nbytes + nbytes / 4) / hbm
        regions = tp_region_gemm_seconds(plan, H100, peak, None)
        fwd = sum(_overlapped(ag, c, eta) + _overlapped(rs, r, eta) + reduction
                  for c, r in regions)  # fmt: skip
        bwd = sum(
            (rs if several else _overlapped(rs, c, eta) + reduction) + _overlapped(ag, r, eta)
            for (c, r), several in zip(regions, unfused, strict=True)
        )
        got = _tp_block_seconds(plan, H100, async_tp, peak, None)
        assert got[0] == pytest.approx(fwd, rel=1e-12)
        assert got[1] == pytest.approx(bwd, rel=1e-12)
        # op-level SAC keeps the reduce-scatters' outputs: its redo is the all-gathers alone
        assert got[2] == pytest.approx(sum(_overlapped(ag, c, eta) for c, _ in regions), rel=1e-12)
    # Megatron's TP overlap (TransformerEngine's userbuffers) is not torch's: no such terms
    plan = Plan(model=L8, seq_len=8192, micro_batch_size=1, global_batch_size=8, tp=8,
                dp_shard=1, sequence_parallel=True)  # fmt: skip
    mc = _tp_block_seconds(plan, H100, time_params(MEGATRON_CORE), peak, None)
    ag = collective("all_gather", 8192 * L8.dim * 2, 8, 8, H100.fabric).seconds
    rs = collective("reduce_scatter", 8192 * L8.dim * 2, 8, 8, H100.fabric).seconds
    regions = tp_region_gemm_seconds(plan, H100, peak, None)
    eta = time_params(MEGATRON_CORE).dp_overlap
    assert mc[1] == pytest.approx(
        sum(_overlapped(rs, c, eta) + _overlapped(ag, r, eta) for c, r in regions), rel=1e-12
    )


def test_torchtitan_gathers_float8_inputs_under_tp() -> None:
    """torchtitan's Float8 TP styles all-gather the float8 cast of a region's input: the
    forward all-gathers move half the bytes of bf16 ones; backward's stay bf16."""
    from llmscale.plan.collectives import collective

    plan = Plan(model=L70, seq_len=8192, micro_batch_size=1, global_batch_size=32, tp=8,
                dp_shard=4, sequence_parallel=True, precision="fp8")  # fmt: skip
    tt = estimate_step_time(plan, H100, time_params(TORCHTITAN), validate=False)
    bf = estimate_step_time(plan, H100, time_params(TORCHTITAN.on(
        kernels=replace(TORCHTITAN.kernels, fp8_all_gathers=False))), validate=False)  # fmt: skip
    nbytes = 8192 * L70.dim * 2
    saved = (collective("all_gather", nbytes, 8, 8, H100.fabric).seconds
             - collective("all_gather", nbytes / 2, 8, 8, H100.fabric).seconds)  # fmt: skip
    assert bf.breakdown["tp_comm"] - tt.breakdown["tp_comm"] == pytest.approx(
        8 * 2 * L70.n_layers * saved, rel=1e-9
    )  # 8 micro-batches, two regions' forward all-gathers per block


def test_compiled_float8_casts_each_shared_input_once() -> None:
    """Compiled, the linears reading one tensor (wq, wk, wv; w1, w3) cast it to float8 once
    (AOTAutograd's CSE merges the identical casts): 2 + 1 fewer input casts per block."""
    from llmscale.plan.time import fp8_cast_bytes

    plan = Plan(model=L8, seq_len=8192, micro_batch_size=2, global_batch_size=16,
                dp_shard=8, precision="fp8")  # fmt: skip
    eager_f, eager_b = fp8_cast_bytes(plan)
    fused_f, fused_b = fp8_cast_bytes(plan, compiled=True)
    x = 2 * 8192 * L8.dim  # the attention and MLP inputs have the same shape
    assert eager_f - fused_f == 5.0 * 3 * x
    assert eager_b - fused_b == 2.0 * 3 * x


def test_torch_context_parallel_gathers_k_and_v_once_per_call() -> None:
    """torchtitan runs torch's context_parallel, whose default rotation all-gathers every rank's
    K and V beside the first step only, and passes fp32 K/V gradients around the ring: across
    nodes (tp 8 fills one) more of it is exposed than a step-by-step p2p ring's; K and V
    repeated to the query heads first (the 2024-25 torchtitan's repeat_kv) move 16x more for
    Llama 3 405B (128 heads, 8 KV heads)."""
    L405 = get_preset("llama3-405b")
    plan = Plan(model=L405, seq_len=262144, micro_batch_size=1, global_batch_size=8, tp=8,
                cp=8, dp_shard=1, sequence_parallel=True, recompute="full",
                precision="bf16")  # fmt: skip
    assert TORCHTITAN.cp_rotate == "allgather" and MEGATRON_CORE.cp_rotate == "ring"

    def cp_comm(stack: Stack) -> float:
        tp_ = time_params(stack.on(tp_overlap_gemm=False, fsdp_over_cp=False))
        return estimate_step_time(plan, H100, tp_, validate=False).breakdown["cp_comm"]

    ring = cp_comm(TORCHTITAN.on(cp_rotate="ring"))
    gathered = cp_comm(TORCHTITAN)
    repeated = cp_comm(TORCHTITAN.on(kernels=replace(TORCHTITAN.kernels, repeat_kv=True)))
    assert ring < gathered < repeated


def test_compiled_context_parallel_waits_for_each_transfer() -> None:
    """Traced into compiled blocks, torch's ring waits for each functional collective where it
    issues it (`_maybe_wrap_tensor` under tracing), so none of its traffic hides behind the
    attention: per micro-batch, every block's all-gather of K and V in each forward, recompute
    and backward call, and its cp fp32 gradient passes; eager, most of it hides. A
    step-by-step p2p ring (Megatron-Core's) is not torch's and does not change."""
    plan = Plan(model=L8, seq_len=131072, micro_batch_size=1, global_batch_size=2, cp=4,
                dp_shard=2, recompute="full", precision="bf16")  # fmt: skip
    stack = TORCHTITAN.on(fitted=())

    def cp_comm(s: Stack, compiled: bool) -> float:
        tp_ = time_params(s, compiled=compiled)
        return estimate_step_time(plan, H100, tp_, validate=False).breakdown["cp_comm"]

    local = 2.0 * (131072 // 4) * L8.kv_dim * 2  # K and V, bf16 (not repeated to the heads)
    gather = collective("all_gather", 4 * local, 4, 4, H100.fabric).seconds
    grads = collective("p2p", 2 * local, 2, 2, H100.fabric).seconds  # fp32
    whole = L8.n_layers * (3 * gather + 4 * grads)
    assert cp_comm(stack, compiled=True) == pytest.approx(whole, rel=1e-9)
    assert cp_comm(stack, compiled=False) < whole / 2
    ring = MEGATRON_CORE.on(fitted=())
    assert cp_comm(ring, compiled=True) == cp_comm(ring, compiled=False)


def test_tied_pipelines() -> None:
    assert tied_pipeline_problem(TORCHTITAN, True, 2) is not None
    assert tied_pipeline_problem(MEGATRON_CORE, True, 2) is None
    assert tied_pipeline_problem(LLMSCALE, True, 2) is None  # parallel/tied_embeddings.py
    assert tied_pipeline_problem(TORCHTITAN, False, 2) is None


def test_megatron_2021_splits_no_sequence_over_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """megatron-2021 has no context parallelism: `plan --cp 2` and `train --dry-run` with
    parallel.cp 2 are refused in one line naming the stacks that have it, and its search tries
    cp 1 only (the others try cp > 1 for a long sequence)."""
    from llmscale.cli import main
    from llmscale.plan.search import search
    from llmscale.stack import MEGATRON_2021, layout_problem

    refused = layout_problem(MEGATRON_2021, recompute=None, schedule=None, pp=1, tied=False, cp=2)
    assert refused is not None and refused[0] == "parallel.cp"
    assert "--stack llmscale | megatron-core | torchtitan" in refused[2]
    for stack in (LLMSCALE, MEGATRON_CORE, TORCHTITAN):
        assert layout_problem(stack, recompute=None, schedule=None, pp=1, tied=False, cp=2) is None
    argv = ["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100", "--seq", "8192",
            "--global-batch", "64", "--stack", "megatron-2021", "--cp", "2"]  # fmt: skip
    assert main(argv) == 2
    assert "parallel.cp: got 2" in capsys.readouterr().err
    l8, h100 = get_preset("llama3.1-8b"), Cluster.of("h100")
    res = search(l8, 16, h100, 65536, 16, top=3, time_params=time_params(MEGATRON_2021))
    core = search(l8, 16, h100, 65536, 16, top=3, time_params=time_params(MEGATRON_CORE))
    assert all(c.plan.cp == 1 for c in res.candidates + res.unfit)
    assert any(c.plan.cp > 1 for c in core.candidates)


def test_op_sac_saves_every_other_matmul() -> None:
    # wq, wk, wv, wo, w1, w3, w2: torchtitan saves the 1st, 3rd, 5th and 7th mm outputs.
    saved = tuple(op_sac_saves_matmul(i) for i in range(len(L8.block_matmuls())))
    assert saved == (True, False, True, False, True, False, True)
    d, kv, f = 4096, 1024, 14336
    per_token = 2 * d + 2 * (d + kv + f + d) + 2 * d + 4 * 32
    plan = Plan(model=L8, seq_len=8192, micro_batch_size=2, global_batch_size=2)
    assert block_bytes(plan, "selective_op", TORCHTITAN.kernels) == per_token * 2 * 8192


def test_op_sac_recomputes_more_than_the_attention_core() -> None:
    plan = Plan(model=L8, seq_len=8192, micro_batch_size=1, global_batch_size=1,
                recompute="selective")  # fmt: skip
    core = estimate_step_time(plan, H100)
    op = estimate_step_time(replace(plan, recompute="selective_op"), H100, time_params(TORCHTITAN))
    assert op.breakdown["matmul"] > core.breakdown["matmul"]


def test_eager_elementwise_traffic() -> None:
    plan = Plan(model=L8, seq_len=2048, micro_batch_size=1, global_batch_size=1)
    d, kv, f = 4096, 1024, 14336
    per_token = 2 * 36 * d + 2 * 6 * d + 20 * (d + kv) + 4 * (d + kv) + 10 * f
    assert eager_block_bytes(plan) == per_token * 2048


def test_fitted_values_are_the_stacks_and_name_a_calibration_row() -> None:
    """A factor fitted on a published run lives on the stack that ran it, applied on that GPU
    only (Cluster.run_by): torchtitan's H100 96GB share scales the bare GPU's GEMM, FP8 and
    attention rates alike (one clock), not another stack's. Each fit names its row, and a
    runs.toml row it names is `calibration`."""
    import re

    from llmscale.validation.runs import load_runs

    roles = {r["id"]: r["role"] for r in load_runs()}
    fits = [f for s in STACKS.values() for f in s.fitted]
    assert {f.gpu for f in fits} == {"a100-80g", "h100-96g", "h100", "h200", "gb200", "gb300"}
    # torchtitan's Hopper share: one value, on the three parts of the one die
    hopper = {f.gpu: f.scale for f in TORCHTITAN.fitted}
    assert set(hopper) == {"h100-96g", "h100", "h200"} and len(set(hopper.values())) == 1
    for fit in fits:
        named = [
            m for m in re.findall(r"row ([a-z0-9][a-z0-9.-]+)", fit.scale.source) if m in roles
        ]
        assert named or "Narayanan et al. 2021 Table 1, row 10" in fit.scale.source, fit
        assert all(roles[m] == "calibration" for m in named), fit
    h100 = Cluster.of("h100-96g")
    bare = h100.gpu.calibration
    tt = h100.run_by(TORCHTITAN).gpu.calibration
    (scale,) = [f.scale.value for f in TORCHTITAN.fitted if f.gpu == "h100-96g"]
    for name in ("gemm_efficiency", "fp8_gemm_efficiency", "attention_efficiency"):
        assert getattr(tt, name).value == pytest.approx(getattr(bare, name).value * scale)
    assert tt.hbm_efficiency == bare.hbm_efficiency  # the part's own HBM figure
    assert h100.run_by(LLMSCALE) is h100 and h100.run_by(MEGATRON_2021) is h100
    assert h100.run_by(TORCHTITAN) is h100.run_by(TORCHTITAN)  # cached: the search's keys
    a100 = Cluster.of("a100-80g")
    meg = a100.run_by(MEGATRON_2021).gpu.calibration.gemm_efficiency.value
    assert meg == pytest.approx(0.7 * 1.03) and a100.run_by(TORCHTITAN) is a100
    # Megatron-Core's factors on the two NVL72 parts of equal datasheet peaks, on them only
    nvl72 = {f.gpu: f.scale.value for f in MEGATRON_CORE.fitted}
    assert set(nvl72) == {"gb200", "gb300"} and nvl72["gb300"] > 1 > nvl72["gb200"]
    for gpu, scale in nvl72.items():
        nvl = Cluster.of(gpu)
        assert nvl.gpu.calibration.fp8_gemm_efficiency is not None
        got = nvl.run_by(MEGATRON_CORE).gpu.calibration.fp8_gemm_efficiency
        assert got is not None
        assert got.value == pytest.approx(nvl.gpu.calibration.fp8_gemm_efficiency.value * scale)
        assert nvl.run_by(TORCHTITAN) is nvl
    b200 = Cluster.of("b200")
    assert b200.run_by(MEGATRON_CORE) is b200


def test_a_catalog_gpu_takes_the_stacks_step_overhead() -> None:
    plan = Plan(model=get_preset("llama2-7b"), seq_len=2048, micro_batch_size=1,
                global_batch_size=8, dp_shard=8)  # fmt: skip
    cluster = Cluster.of("h100")
    slow = LLMSCALE.on(step_overhead_ms=Sourced(250.0, "test"))
    base = estimate_step_time(plan, cluster, time_params(LLMSCALE))
    more = estimate_step_time(plan, cluster, time_params(slow))
    assert base.breakdown["fixed"] == pytest.approx(LLMSCALE.step_overhead_ms.value / 1000)
    assert more.seconds - base.seconds == pytest.approx(0.24)


def test_a_measured_devices_overheads_are_its_stacks() -> None:
    """Issue 25's split: a device's calibration holds its rates only; the costs of the stack on
    it (measured with the runtime on this CPU) reach the time model through the stack alone,
    each by exactly its difference from a catalog GPU's (10 ms a step, no dispatch, the
    optimizer at the streaming bandwidth)."""
    assert not {f.name for f in fields(Calibration)} & {
        "step_overhead_ms", "microbatch_overhead_ms", "optimizer_efficiency"
    }  # fmt: skip
    plan = Plan(model=get_preset("tiny"), seq_len=64, micro_batch_size=2, global_batch_size=6)
    costs = DeviceCosts(
        device="a test CPU",
        step_overhead_ms=Sourced(3.0, "test"),
        microbatch_overhead_ms=Sourced(12.0, "test"),
        optimizer_efficiency=Sourced(0.25, "test"),
    )
    measured = LLMSCALE.on_device(costs)
    assert measured.microbatch_overhead_ms is costs.microbatch_overhead_ms
    base = estimate_step_time(plan, H100, time_params(LLMSCALE))
    on = estimate_step_time(plan, H100, time_params(measured))
    b, o = base.breakdown, on.breakdown
    assert (b["fixed"], o["fixed"]) == (pytest.approx(0.010), pytest.approx(0.003))
    assert (b["dispatch"], o["dispatch"]) == (0.0, pytest.approx(3 * 0.012))  # 3 micro-batches
    hbm = H100.gpu.calibration.hbm_efficiency.value
    assert o["optimizer"] == pytest.approx(b["optimizer"] * hbm / 0.25)
    extra = (o["fixed"] - b["fixed"]) + o["dispatch"] + (o["optimizer"] - b["optimizer"])
    assert on.seconds - base.seconds == pytest.approx(extra, rel=1e-9)
    for key in ("matmul", "elementwise", "tp_comm", "dp_comm", "bubble"):
        assert o[key] == b[key], key  # the device's rates: untouched


def test_torch_context_parallel_backward_holds_the_gathered_kv_and_fp32_gradients() -> None:
    """Under torchtitan (torch's context_parallel, `allgather` rotation) the peak transient of a
    cp rank is the ring backward's working set beside the attention half of the recomputed
    block: every rank's K and V gathered (bf16), fp32 dQ and dK/dV accumulators, the fp32 dK/dV
    sent on and received, the incoming output gradient; by hand for Llama 3 405B at tp 8, cp 8,
    K and V repeated to the 16 query heads of a tp rank. A p2p ring stack has none of it."""
    L405 = get_preset("llama3-405b")
    plan = Plan(model=L405, seq_len=262144, micro_batch_size=1, global_batch_size=8, tp=8,
                pp=8, cp=8, dp_shard=1, sequence_parallel=True, recompute="full",
                precision="bf16")  # fmt: skip
    kernels = replace(TORCHTITAN.kernels, repeat_kv=True)
    t, width = 262144 // 8, 16384 // 8  # tokens and K/V (= Q) width on one rank
    by_hand = (8 * t * 2 * width * 2  # gathered K and V
               + 4 * t * width + 4 * t * 2 * width  # fp32 dQ, dK, dV
               + 2 * 4 * t * 2 * width  # fp32 dK/dV sent and received
               + 2 * t * width)  # fmt: skip
    ring = act.torch_ring_backward_bytes(L405, 1, 262144, "bf16", 8, 8, kernels)
    assert ring == by_hand  # 3.75 GiB
    args = (L405, 1, 262144, "bf16", 8, True, kernels)
    live = act.attention_live_bytes(*args)
    # the attention half: what precedes the MLP's norm among the block's saved tensors
    names = [s.name for s in act.block_tensors(*args)]
    half = act.block_tensors(*args)[: names.index("ffn_norm input")]
    assert live == sum(s.nbytes for s in half) and 0 < live < act.block_bytes(*args)
    # K and V kept for the attention's backward as the kernel got them: repeated
    assert {s.name: s.nbytes for s in half}["k"] == {s.name: s.nbytes for s in half}["q"]

    def transient(stack: Stack) -> float:  # of a middle pipeline rank (no loss)
        return rank_activity(plan, 1, replace(memory_options(stack), kernels=kernels)).transient

    assert transient(TORCHTITAN) == pytest.approx(live / 8 + ring)
    assert transient(TORCHTITAN.on(cp_rotate="ring")) < live / 8 + ring


def test_pipeline_outputs_kept_until_the_step_ends() -> None:
    """torch's `PipelineStage.output_chunks`: with the stack's `pipeline_outputs_kept` "all"
    (torch before pytorch#153383) every stage keeps each micro-batch's output, one residual
    stream each, and the last its logits; "last" only the logits; "none" (step with
    return_outputs=False, as the llmscale runtime) neither. By hand for a 4-stage 1F1B."""
    plan = Plan(model=L8, seq_len=4096, micro_batch_size=2, global_batch_size=16, pp=4,
                precision="bf16", recompute="full")  # fmt: skip
    m, tokens = plan.n_microbatches, 2 * 4096
    boundary, logits = 2 * tokens * L8.dim, 2 * tokens * L8.vocab_size

    def buffers(kept: str, rank: int) -> float:
        opts = memory_options(TORCHTITAN.on(pipeline_outputs_kept=kept))
        return estimate_memory(plan, opts, validate=False).per_rank[rank].pipeline_buffers

    for rank in range(4):
        none = buffers("none", rank)
        assert none == m * boundary * ((rank != 0) + (rank != 3))  # the receive buffers
        last = m * logits if rank == 3 else 0.0
        assert buffers("last", rank) == none + last
        assert buffers("all", rank) == none + (last or m * boundary)
    assert LLMSCALE.pipeline_outputs_kept == TORCHTITAN.pipeline_outputs_kept == "none"


def test_activation_offload_takes_the_first_blocks_off_the_device() -> None:
    """`train.offload_activations` N: the first N blocks' saved bytes leave the device's
    activations for the host's, under every stack that runs it (memory and time read the one
    `RankWork.host_saved`), and a stack without it refuses it."""
    from llmscale.plan.work import rank_work
    from llmscale.stack import layout_problem

    base = Plan(
        model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=64, precision="bf16",
        dp_shard=64, zero_stage=3,
    )  # fmt: skip
    off = replace(base, offload_activations=20)
    for stack in (LLMSCALE, MEGATRON_CORE):
        opt = memory_options(stack)
        a, b = (estimate_memory(p, opt, validate=False).worst for p in (base, off))
        moved = 20 * rank_work(off, 0, opt.kernels).block_saved["none"]
        assert rank_work(off, 0, opt.kernels).host_saved == moved > 0
        assert a.activations - b.activations == pytest.approx(moved)
        assert b.host - a.host == pytest.approx(moved)
    for stack in (TORCHTITAN, MEGATRON_2021):
        refused = layout_problem(stack, recompute="none", schedule=None, pp=1, tied=False,
                                 offload_activations=20)  # fmt: skip
        assert refused is not None and refused[0] == "train.offload_activations"
    assert layout_problem(MEGATRON_CORE, recompute="none", schedule=None, pp=1, tied=False,
                          offload_activations=20) is None  # fmt: skip


def test_activation_offload_copies_block_the_llmscale_runtime_and_hide_under_megatron() -> None:
    """torch's save_on_cpu copies on the compute stream: both directions whole, every
    micro-batch. TransformerEngine's offload (Megatron-Core) runs beside the compute of the
    blocks kept on the device: only what does not fit there shows."""
    from llmscale.plan.work import rank_work

    base = Plan(
        model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=64, precision="bf16",
        dp_shard=64, zero_stage=3,
    )  # fmt: skip
    t_off = estimate_step_time(
        replace(base, offload_activations=20), H100, time_params(LLMSCALE), validate=False
    )
    moved = 20 * rank_work(base, 0, LLMSCALE.kernels).block_saved["none"]
    one_way = moved / H100.host_link.bandwidth
    assert t_off.breakdown["activation_offload"] == pytest.approx(2 * one_way * base.n_microbatches)
    mc = time_params(MEGATRON_CORE)
    t0 = estimate_step_time(base, H100, mc, validate=False)
    f0, b0 = t0.stage_fwd[0], t0.stage_bwd[0]
    kernels = MEGATRON_CORE.kernels
    for n in (20, 70):  # behind 60 blocks' compute; behind 10, not all of it
        t = estimate_step_time(replace(base, offload_activations=n), H100, mc, validate=False)
        x = n * rank_work(base, 0, kernels).block_saved["none"] / H100.host_link.bandwidth
        window = (80 - n) / 80
        want_f, want_b = max(0.0, x - window * f0), max(0.0, x - window * b0)
        assert t.stage_fwd[0] - f0 == pytest.approx(want_f, abs=1e-12)
        assert t.stage_bwd[0] - b0 == pytest.approx(want_b, abs=1e-12)
        assert (want_f + want_b == 0) == (n == 20)


def test_precision_help_says_which_stacks_run_each() -> None:
    # `plan --precision`'s help, generated from the stacks: nvfp4 under megatron-core only
    from llmscale.config import PRECISIONS
    from llmscale.stack import precision_help

    text = precision_help(PRECISIONS)
    assert text.startswith(" | ".join(PRECISIONS) + " (default bf16;")
    assert "nvfp4: TransformerEngine's NVFP4 recipe" in text
    assert text.endswith("under --stack megatron-core)")
    for stack in STACKS.values():
        assert ("fp8" in stack.precisions) == (stack.name in text.split("nvfp4:")[0])


def test_selective_recompute_under_fp8_keeps_no_bf16_attention_output() -> None:
    """Megatron-Core's selective recompute checkpoints the attention core (TransformerEngine's
    DotProductAttention under checkpoint): it keeps q, k and v, and recomputes the kernel's
    output and log-sum-exp in backward. Under FP8 the output projection saves its own float8
    cast, so the bf16 output is kept by nothing; in bf16 it is the projection's saved input."""
    kern = MEGATRON_CORE.kernels
    args = (L70, 1, 4096, "fp8", 8, True, kern)
    none = {s.name: s.nbytes for s in act.block_tensors(*args, "none")}
    sel = {s.name: s.nbytes for s in act.block_tensors(*args, "selective")}
    assert set(none) - set(sel) == {"attention output (= wo input)", "log-sum-exp (fp32)"}
    assert sel["wo input (float8 cast)"] == none["wo input (float8 cast)"] > 0
    assert {"q", "k", "v"} <= set(sel)
    bf16 = {s.name for s in act.block_tensors(L70, 1, 4096, "bf16", 8, True, kern, "selective")}
    assert "attention output (= wo input)" in bf16
