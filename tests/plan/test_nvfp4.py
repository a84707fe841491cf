"""precision nvfp4: TransformerEngine's NVFP4 recipe as Megatron-Core runs it (plan/time.py
`nvfp4_cast_bytes`, `_linear_seconds`; plan/activations.py `SAVED_CAST_BYTES`), refused by the
stacks that do not run it, by GPUs without FP4 tensor cores and by the llmscale runtime."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmscale.config import NVFP4_MATMUL_BYTES, JobConfig
from llmscale.errors import ConfigError
from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import estimate_memory, memory_options
from llmscale.plan.plan import Plan
from llmscale.plan.search import search
from llmscale.plan.time import (
    NVFP4_ACTIVATION_CAST_BYTES,
    NVFP4_WEIGHT_CAST_BYTES,
    block_linears,
    estimate_step_time,
    nvfp4_cast_bytes,
    time_params,
)
from llmscale.stack import LLMSCALE, MEGATRON_CORE, TORCHTITAN, Stack, layout_problem

L70 = get_preset("llama3-70b")
GB300 = Cluster.of("gb300")


def _plan(**kw: object) -> Plan:
    base = Plan(model=L70, seq_len=8192, micro_batch_size=1, global_batch_size=256, tp=2,
                pp=4, pp_schedule="interleaved_1f1b", pp_chunks=5, dp_shard=8, zero_stage=1,
                sequence_parallel=True, recompute="none", precision="nvfp4")  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


def test_the_recipes_quantisations_by_hand() -> None:
    """Per element: an activation 2 (amax) + 2 (amax of its Hadamard transform) + 2 (read) +
    2 x 0.5625 (row-wise and column-wise E2M1 with an E4M3 scale per 16); a weight 2 + 2 +
    2 x 0.5625, once per step."""
    assert NVFP4_MATMUL_BYTES == 0.5625
    assert NVFP4_ACTIVATION_CAST_BYTES == 7.125
    assert NVFP4_WEIGHT_CAST_BYTES == 5.125
    plan = _plan()
    fwd, bwd = nvfp4_cast_bytes(plan)
    lins = block_linears(plan)
    regions = {lin.region for lin in lins if lin.colwise}
    # one quantisation per distinct input: the fused column-parallel module's and each row-wise
    x = sum(lin.mnk[0] * lin.mnk[2] for lin in lins if not lin.colwise)
    x += sum(next(lin.mnk[0] * lin.mnk[2] for lin in lins if lin.colwise and lin.region == r)
             for r in regions)  # fmt: skip
    w = sum(lin.mnk[1] * lin.mnk[2] for lin in lins)
    go = sum(lin.mnk[0] * lin.mnk[1] for lin in lins)
    assert fwd == pytest.approx(7.125 * x + 5.125 * w / plan.n_microbatches)
    assert bwd == pytest.approx(7.125 * go)
    assert nvfp4_cast_bytes(replace(plan, precision="fp8")) == (0.0, 0.0)


def test_linears_run_at_the_fp4_peak_and_the_rest_as_fp8() -> None:
    """On GB300 (FP4 15 PF dense, three times its FP8): the linears' time falls by about
    3 x 0.56 / 0.63, the attention and the head's do not (the element-wise passes, counted over
    the saved bytes, shrink with the 4-bit saved inputs); MFU stays against the bf16 peak."""
    tp_ = time_params(MEGATRON_CORE)
    fp4 = estimate_step_time(_plan(), GB300, tp_)
    fp8 = estimate_step_time(_plan(precision="fp8"), GB300, tp_)
    assert fp4.seconds < fp8.seconds
    assert fp4.breakdown["nvfp4_casts"] > 0 and "fp8_casts" not in fp4.breakdown
    assert 0.8 * fp8.breakdown["elementwise"] < fp4.breakdown["elementwise"]
    assert fp4.breakdown["elementwise"] < fp8.breakdown["elementwise"]
    ratio = fp4.breakdown["matmul"] / fp8.breakdown["matmul"]
    linears_only = (5000 * 0.63) / (15000 * 0.56)
    assert linears_only < ratio < 1  # attention and the head stay bf16
    assert fp4.mfu / fp8.mfu == pytest.approx(fp8.seconds / fp4.seconds, rel=1e-9)


def test_megatron_core_saves_the_columnwise_nvfp4_inputs() -> None:
    """TransformerEngine's linears save the cast they multiplied: 0.5625 B per element of the
    linears' inputs under nvfp4 against 1 B under fp8, so fewer activation bytes."""
    opts = memory_options(MEGATRON_CORE)
    fp4 = estimate_memory(_plan(), opts)
    fp8 = estimate_memory(_plan(precision="fp8"), opts)
    assert fp4.worst.activations < fp8.worst.activations


def test_megatron_core_runs_no_tp_overlap_under_nvfp4() -> None:
    """Megatron-Bridge's NVFP4 configurations turn TransformerEngine's TP overlap off: the same
    layout's TP collectives are more exposed than under fp8 (where they hide behind GEMMs)."""
    assert MEGATRON_CORE.tp_overlap_off_under == ("nvfp4",)
    tp_ = time_params(MEGATRON_CORE)
    fp4 = estimate_step_time(_plan(), GB300, tp_)
    fp8 = estimate_step_time(_plan(precision="fp8"), GB300, tp_)
    no_overlap = estimate_step_time(
        _plan(precision="fp8"), GB300, time_params(MEGATRON_CORE.on(tp_overlap_gemm=False))
    )
    assert fp4.breakdown["tp_comm"] == pytest.approx(no_overlap.breakdown["tp_comm"])
    assert fp4.breakdown["tp_comm"] > fp8.breakdown["tp_comm"]


@pytest.mark.parametrize("stack", [LLMSCALE, TORCHTITAN])
def test_stacks_without_nvfp4_refuse_it_naming_megatron_core(stack: Stack) -> None:
    refused = layout_problem(stack, recompute=None, schedule=None, pp=1, tied=False,
                             precision="nvfp4")  # fmt: skip
    assert refused is not None
    key, value, allowed = refused
    assert (key, value) == ("precision.mode", "nvfp4")
    assert "nvfp4: --stack megatron-core" in allowed and "fp8" in allowed
    assert layout_problem(MEGATRON_CORE, recompute=None, schedule=None, pp=1, tied=False,
                          precision="nvfp4") is None  # fmt: skip


def test_gpus_without_fp4_refuse_it() -> None:
    plan = _plan()
    with pytest.raises(ConfigError, match="h100.*no FP4"):
        estimate_step_time(plan, Cluster.of("h100"), time_params(MEGATRON_CORE))
    with pytest.raises(ConfigError, match="no FP4"):
        search(L70, 64, Cluster.of("h200"), 8192, 256, precision="nvfp4")


def test_the_runtime_refuses_nvfp4_in_one_line() -> None:
    import torch

    from llmscale.parallel.parallelize import check_runtime_support

    cfg = JobConfig()
    cfg.precision.mode = "nvfp4"
    cfg.validate()  # a valid job: the planner takes it
    with pytest.raises(ConfigError, match="no NVFP4 training.*--stack megatron-core"):
        check_runtime_support(cfg, torch.device("cpu"))


def test_megatron_core_keeps_the_steps_quantised_weights() -> None:
    """TransformerEngine quantises each block weight at a step's first micro-batch and keeps the
    row-wise and column-wise NVFP4 copies (0.5625 B per parameter each) until the step ends."""
    from llmscale.plan.memory import plan_rank_params, rank_states

    opts = memory_options(MEGATRON_CORE)
    plan = _plan()
    fp4 = rank_states(plan, 0, opts)
    # (against fp8 with bf16 weights: Megatron's default FP8 weights would hold one byte less)
    bf16_weights = memory_options(MEGATRON_CORE.on(fp8_params=False))
    fp8 = rank_states(replace(plan, precision="fp8"), 0, bf16_weights)
    rp = plan_rank_params(plan, 0, opts.kernels, opts.stack)
    cached = 2 * 0.5625 * rp.blocks * rp.block.numel
    assert fp4.working_params - fp8.working_params == pytest.approx(cached)
    assert fp4.params == fp8.params and fp4.optimizer == fp8.optimizer


def test_the_step_time_cache_knows_the_weights_are_cast_once_per_step() -> None:
    """Two plans that differ only in their micro-batches per step: the per-micro-batch share of
    the weights' quantisation differs, and so does the cached stage time."""
    tp_ = time_params(MEGATRON_CORE)
    few = estimate_step_time(_plan(global_batch_size=64), GB300, tp_)
    many = estimate_step_time(_plan(), GB300, tp_)
    assert few.stage_fwd[0] > many.stage_fwd[0]
