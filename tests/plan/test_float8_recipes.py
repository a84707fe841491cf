"""The float8 recipes under fp8 (plan/time.py `FLOAT8_RECIPES`, `block_gemm_seconds`): torchao's
and TransformerEngine's MXFP8, what each adds to the per-tensor-scaled GEMM, by hand; which
stacks and GPUs run them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmscale.errors import ConfigError
from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.search import search
from llmscale.plan.time import (
    FLOAT8_RECIPES,
    MXFP8_CAST_BYTES,
    RESCALE_BYTES,
    ROWWISE_GEMM_SHARE,
    block_gemm_seconds,
    block_linears,
    estimate_step_time,
    fp8_cast_bytes,
    gemm_seconds,
    peak_flops,
    time_params,
)
from llmscale.stack import (
    LLMSCALE,
    MEGATRON_CORE,
    MEGATRON_CORE_MXFP8,
    TORCHTITAN,
    layout_problem,
)

L8 = get_preset("llama3-8b")
H100 = Cluster.of("h100")


def _plan(recipe: str = "tensorwise") -> Plan:
    return Plan(model=L8, seq_len=8192, micro_batch_size=1, global_batch_size=8, dp_shard=8,
                precision="fp8", float8_recipe=recipe, recompute="selective_op")  # type: ignore[arg-type]  # fmt: skip


def _sums(plan: Plan) -> tuple[int, int, int, int, int]:
    lins = block_linears(plan)
    x = sum(lin.mnk[0] * lin.mnk[2] for lin in lins)
    w = sum(lin.mnk[1] * lin.mnk[2] for lin in lins)
    go = sum(lin.mnk[0] * lin.mnk[1] for lin in lins)
    return x, w, go, sum(m * k for m, _, k in (lin.mnk for lin in lins)), len(lins)


def test_the_casts_by_hand() -> None:
    """tensorwise: amax, then cast (2 + 2 + 1) of input and weight in forward, of the output
    gradient in backward, plus the three transposed float8 copies (1 + 1); rowwise, torchao's
    roofline accounting: input 5 + 3, weight 3 + 7, output gradient 8; rowwise_with_gw_hp:
    input 3, weight 3 + 3, output gradient 3 (its weight gradient takes the bf16 tensors);
    mxfp8: input, weight and output gradient each read once and written as both FP8 copies with
    a scale per 32 elements (2 + 2 x 33/32), nothing transposed in backward, an FP8 weight
    (`fp8_params`) no bytes at all."""
    x, w, go, _, _ = _sums(_plan())
    assert fp8_cast_bytes(_plan()) == (5 * x + 5 * w, 7 * go + 2 * x + 2 * w)
    assert fp8_cast_bytes(_plan("rowwise")) == (5 * x + 3 * w, 8 * go + 3 * x + 7 * w)
    assert fp8_cast_bytes(_plan("rowwise_with_gw_hp")) == (3 * x + 3 * w, 3 * go + 3 * w)
    assert MXFP8_CAST_BYTES == 2 + 2 * 33 / 32
    assert fp8_cast_bytes(_plan("mxfp8")) == pytest.approx(
        (MXFP8_CAST_BYTES * (x + w), MXFP8_CAST_BYTES * go)
    )
    assert fp8_cast_bytes(_plan("mxfp8"), fp8_params=True) == pytest.approx(
        (MXFP8_CAST_BYTES * x, MXFP8_CAST_BYTES * go)
    )
    assert fp8_cast_bytes(_plan(), fp8_params=True) == (5 * x, 7 * go + 2 * x + 2 * w)
    assert set(FLOAT8_RECIPES) == {"tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"}


def test_the_gemms_by_hand() -> None:
    """Forward, input-gradient and weight-gradient GEMMs of one block: tensorwise all three at
    the FP8 rate; rowwise the forward at ROWWISE_GEMM_SHARE of it and both backward outputs
    rescaled in a pass of their own (2 + 2 B per element); rowwise_with_gw_hp the input
    gradient rescaled and the weight gradient in bf16."""
    plan = _plan()
    shapes = [lin.mnk for lin in block_linears(plan)]
    peak = peak_flops(H100, "fp8")
    tw = block_gemm_seconds(plan, shapes, H100, peak, None)
    assert tw[0] == tw[1] == tw[2]
    hbm = H100.gpu.hbm_bandwidth * H100.gpu.calibration.hbm_efficiency.value
    dgrad_out = RESCALE_BYTES * sum(m * k for m, _, k in shapes) / hbm
    wgrad_out = RESCALE_BYTES * sum(n * k for _, n, k in shapes) / hbm
    rw = block_gemm_seconds(_plan("rowwise"), shapes, H100, peak, None)
    assert rw[0] == pytest.approx(tw[0] / ROWWISE_GEMM_SHARE)
    assert rw[1] == pytest.approx(tw[1] + dgrad_out)
    assert rw[2] == pytest.approx(tw[2] + wgrad_out)
    hp = block_gemm_seconds(_plan("rowwise_with_gw_hp"), shapes, H100, peak, None)
    assert hp[1] == pytest.approx(rw[1])
    assert hp[2] == pytest.approx(gemm_seconds(shapes, peak, H100.gpu.calibration, None))


def test_rowwise_is_slower_than_tensorwise_and_faster_than_bf16() -> None:
    """The torchao README's order on 8 H100 (Llama 3 8B, FSDP, compile, op SAC): bf16 <
    rowwise < tensorwise; the recipe is part of the step-time cache's key."""
    tp_ = time_params(TORCHTITAN, compiled=True)
    times = {
        r: estimate_step_time(_plan(r), H100, tp_).seconds
        for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    }
    bf16 = estimate_step_time(replace(_plan(), precision="bf16"), H100, tp_).seconds
    assert times["tensorwise"] < times["rowwise"] < times["rowwise_with_gw_hp"] < bf16


def test_te_stacks_refuse_torchaos_rowwise_recipes() -> None:
    for stack in (LLMSCALE, TORCHTITAN):
        assert layout_problem(stack, recompute=None, schedule=None, pp=1, tied=False,
                              float8_recipe="rowwise") is None  # fmt: skip
    refused = layout_problem(MEGATRON_CORE, recompute=None, schedule=None, pp=1, tied=False,
                             float8_recipe="rowwise")  # fmt: skip
    assert refused == (
        "precision.float8_recipe",
        "rowwise",
        "tensorwise | mxfp8 under --stack megatron-core (rowwise: --stack llmscale | torchtitan)",
    )


GB200 = Cluster.of("gb200")


def test_mxfp8_gemms_run_at_the_stacks_share() -> None:
    """Under mxfp8 all three GEMMs of a block run at the stack's share of the FP8 GEMM's rate
    (`Stack.float8_gemm_shares`, fitted for megatron-core), with no rescaling pass."""
    plan = _plan("mxfp8")
    shapes = [lin.mnk for lin in block_linears(plan)]
    peak = peak_flops(GB200, "fp8")
    tw = block_gemm_seconds(_plan(), shapes, GB200, peak, None)
    share = MEGATRON_CORE.float8_gemm_share("mxfp8")
    assert share == MEGATRON_CORE_MXFP8.value < 1.0
    assert "mbridge-2511-gb200-llama3-8b-mxfp8" in MEGATRON_CORE_MXFP8.source
    mx = block_gemm_seconds(plan, shapes, GB200, peak, None, share)
    assert mx == pytest.approx(tuple(t / share for t in tw))
    assert LLMSCALE.float8_gemm_share("mxfp8") == MEGATRON_CORE.float8_gemm_share("tensorwise") == 1


def test_mxfp8_is_te_s_and_blackwell_s() -> None:
    """Only megatron-core runs mxfp8 (TransformerEngine's MXFP8BlockScaling); the llmscale
    runtime and torchtitan refuse it naming theirs; a GPU without block-scaled tensor cores
    (no FP4 peak: Hopper) refuses it in one line; on GB200 the published 8B job's order holds:
    bf16 slower than mxfp8, slower than tensorwise (Megatron-Bridge 25.11: 31,508 FP8-CS,
    29,789 FP8-MX tokens/s/GPU)."""
    for stack in (LLMSCALE, TORCHTITAN):
        refused = layout_problem(stack, recompute=None, schedule=None, pp=1, tied=False,
                                 float8_recipe="mxfp8")  # fmt: skip
        assert refused is not None and refused[2].startswith("tensorwise | rowwise")
        assert refused[2].endswith("(mxfp8: --stack megatron-core)")
    assert layout_problem(MEGATRON_CORE, recompute=None, schedule=None, pp=1, tied=False,
                          float8_recipe="mxfp8") is None  # fmt: skip
    with pytest.raises(ConfigError, match="float8_recipe: got 'mxfp8'; allowed: a recipe "
                       "without block scales on h100"):  # fmt: skip
        estimate_step_time(_plan("mxfp8"), H100, time_params(MEGATRON_CORE))
    with pytest.raises(ConfigError, match="float8_recipe: got 'mxfp8'"):
        search(L8, 8, H100, 8192, 8, precision="fp8", float8_recipe="mxfp8")
    tp_ = time_params(MEGATRON_CORE)
    plan = replace(_plan(), recompute="none", micro_batch_size=2, global_batch_size=128)
    cs = estimate_step_time(plan, GB200, tp_).seconds
    mx = estimate_step_time(replace(plan, float8_recipe="mxfp8"), GB200, tp_).seconds
    bf16 = estimate_step_time(replace(plan, precision="bf16"), GB200, tp_).seconds
    assert cs < mx < bf16


def test_search_refuses_a_recipe_without_fp8() -> None:
    with pytest.raises(ConfigError, match="float8_recipe: got 'rowwise'; allowed: tensorwise"):
        search(L8, 8, H100, 8192, 8, precision="bf16", float8_recipe="rowwise")
    with pytest.raises(ConfigError, match="float8_recipe: got 'columnwise'"):
        search(L8, 8, H100, 8192, 8, precision="fp8", float8_recipe="columnwise")  # type: ignore[arg-type]


def test_the_runtime_refuses_mxfp8_in_one_line() -> None:
    import torch

    from llmscale.config import JobConfig
    from llmscale.parallel.parallelize import check_runtime_support

    cfg = JobConfig()
    cfg.precision.mode = "fp8"
    cfg.precision.float8_recipe = "mxfp8"
    cfg.validate()  # a valid job: the planner takes it
    with pytest.raises(ConfigError, match="no MXFP8 training.*--stack megatron-core"):
        check_runtime_support(cfg, torch.device("cpu"))
