"""torchao's float8 recipes under fp8 (plan/time.py `FLOAT8_RECIPES`, `block_gemm_seconds`):
what each adds to the per-tensor-scaled GEMM, by hand; which stacks run them."""

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
from llmscale.stack import LLMSCALE, MEGATRON_CORE, TORCHTITAN, layout_problem

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
    input 3, weight 3 + 3, output gradient 3 (its weight gradient takes the bf16 tensors)."""
    x, w, go, _, _ = _sums(_plan())
    assert fp8_cast_bytes(_plan()) == (5 * x + 5 * w, 7 * go + 2 * x + 2 * w)
    assert fp8_cast_bytes(_plan("rowwise")) == (5 * x + 3 * w, 8 * go + 3 * x + 7 * w)
    assert fp8_cast_bytes(_plan("rowwise_with_gw_hp")) == (3 * x + 3 * w, 3 * go + 3 * w)
    assert set(FLOAT8_RECIPES) == {"tensorwise", "rowwise", "rowwise_with_gw_hp"}


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
        "tensorwise under --stack megatron-core",
    )


def test_search_refuses_a_recipe_without_fp8() -> None:
    with pytest.raises(ConfigError, match="float8_recipe: got 'rowwise'; allowed: tensorwise"):
        search(L8, 8, H100, 8192, 8, precision="bf16", float8_recipe="rowwise")
    with pytest.raises(ConfigError, match="float8_recipe: got 'columnwise'"):
        search(L8, 8, H100, 8192, 8, precision="fp8", float8_recipe="columnwise")  # type: ignore[arg-type]
