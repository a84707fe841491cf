"""FP8 parameters (`Stack.fp8_params`: Megatron's --fp8-param-gather) and Megatron-FSDP's
buffers (plan/memory.py `model_weight_bytes`, `_states`; plan/time.py `fp8_cast_bytes`,
`_fsdp_exposed`), by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmscale.model.config import get_preset
from llmscale.plan import memory as mem
from llmscale.plan.cluster import Cluster
from llmscale.plan.params import RankParams
from llmscale.plan.plan import Plan
from llmscale.plan.time import (
    FP8_PARAM_TRANSPOSE_BYTES,
    block_linears,
    estimate_step_time,
    fp8_cast_bytes,
    time_params,
)
from llmscale.stack import LLMSCALE, MEGATRON_CORE
from llmscale.validation.runs import load_runs, run_plan

L70 = get_preset("llama3-70b")
FP8_PARAMS = MEGATRON_CORE.on(fp8_params=True)
# Megatron-Core keeps FP8 weights by default (Megatron-Bridge's FP8 recipes); without them:
BF16_WEIGHTS = MEGATRON_CORE.on(fp8_params=False)


def _plan(precision: str = "fp8", zero_stage: int = 3, **kw: object) -> Plan:
    return Plan(
        model=L70, seq_len=8192, micro_batch_size=1, global_batch_size=64, dp_shard=64,
        precision=precision, zero_stage=zero_stage, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _rp(plan: Plan) -> RankParams:
    return mem.plan_rank_params(plan, 0, MEGATRON_CORE.kernels, MEGATRON_CORE)


def test_model_weight_bytes_keeps_the_linears_weights_in_fp8() -> None:
    plan = _plan()
    rp = _rp(plan)
    bf16 = mem.model_weight_bytes(plan, rp, BF16_WEIGHTS, rp.blocks)
    fp8 = mem.model_weight_bytes(plan, rp, FP8_PARAMS, rp.blocks)
    assert bf16 == 2 * rp.numel
    # one byte less per block linear weight; norms, embedding and head stay bf16
    assert bf16 - fp8 == rp.blocks * rp.block.saved_cast_numel
    assert rp.block.saved_cast_numel < rp.block.numel
    # only under fp8: bf16 training keeps bf16 weights whatever the stack says
    b = _plan("bf16")
    assert mem.model_weight_bytes(b, _rp(b), FP8_PARAMS, 3) == mem.model_weight_bytes(
        b, _rp(b), BF16_WEIGHTS, 3
    )


@pytest.mark.parametrize("main_grad_bytes", [4, 2])
def test_megatron_fsdp_shards_its_model_weights_beside_the_main_ones(main_grad_bytes: int) -> None:
    # optim_grads_params: fp32 main shard + model-dtype shard; gradients sharded in the main
    # gradient dtype; two blocks and the root gathered (model dtype)
    for stack in (BF16_WEIGHTS, FP8_PARAMS):
        stack = stack.on(main_grad_bytes=main_grad_bytes)
        plan = _plan()
        rp = _rp(plan)
        st = mem.rank_states(plan, 0, mem.memory_options(stack))
        shard = rp.shard_numel
        weights = mem.model_weight_bytes(plan, rp, stack, rp.blocks) * shard / rp.numel
        assert st.params == pytest.approx(4 * shard + weights)
        assert st.grads == pytest.approx(main_grad_bytes * shard)
        assert st.working_params == pytest.approx(mem.model_weight_bytes(plan, rp, stack, 2))
    # optim_grads (zero 2): gradients sharded in the main-gradient dtype, weights replicated
    stack = BF16_WEIGHTS.on(main_grad_bytes=main_grad_bytes)
    plan = _plan(zero_stage=2)
    rp = _rp(plan)
    st = mem.rank_states(plan, 0, mem.memory_options(stack))
    assert (st.params, st.grads) == (4 * rp.shard_numel, main_grad_bytes * rp.shard_numel)
    assert st.working_params == 2 * rp.numel
    # FSDP2 (llmscale): the fp32 shard is the parameter; fp32 gradient shards
    plan = _plan()
    st = mem.rank_states(plan, 0, mem.memory_options(LLMSCALE))
    shard = mem.plan_rank_params(plan, 0, LLMSCALE.kernels, LLMSCALE).shard_numel
    assert (st.params, st.grads) == (4 * shard, 4 * shard)


def test_the_distributed_optimizer_keeps_fp8_weights() -> None:
    # ZeRO-1 (Megatron's distributed optimizer): the whole rank's model weights stay gathered
    plan = _plan(zero_stage=1)
    rp = _rp(plan)
    a = mem.rank_states(plan, 0, mem.memory_options(BF16_WEIGHTS))
    b = mem.rank_states(plan, 0, mem.memory_options(FP8_PARAMS))
    assert a.working_params == 2 * rp.numel
    assert a.working_params - b.working_params == rp.blocks * rp.block.saved_cast_numel
    assert (a.params, a.grads, a.optimizer) == (b.params, b.grads, b.optimizer)


def test_fp8_params_cast_no_weight_only_transpose_it() -> None:
    plan = _plan()
    lins = block_linears(plan)
    x = sum(lin.mnk[0] * lin.mnk[2] for lin in lins)
    w = sum(lin.mnk[1] * lin.mnk[2] for lin in lins)
    go = sum(lin.mnk[0] * lin.mnk[1] for lin in lins)
    assert fp8_cast_bytes(plan) == (5 * x + 5 * w, 7 * go + 2 * x + 2 * w)
    assert FP8_PARAM_TRANSPOSE_BYTES == 2
    assert fp8_cast_bytes(plan, fp8_params=True) == (5 * x, 7 * go + 2 * x + 2 * w)


def test_fp8_params_make_a_step_faster_and_its_gathers_smaller() -> None:
    h100 = Cluster.of("h100")
    plan = _plan()
    a = estimate_step_time(plan, h100, time_params(BF16_WEIGHTS))
    b = estimate_step_time(plan, h100, time_params(FP8_PARAMS))
    assert b.breakdown["fp8_casts"] < a.breakdown["fp8_casts"]
    assert b.breakdown["fsdp_comm"] < a.breakdown["fsdp_comm"]  # FP8 all-gathers
    assert b.seconds < a.seconds
    bf16 = replace(plan, precision="bf16")
    assert estimate_step_time(bf16, h100, time_params(FP8_PARAMS)).seconds == pytest.approx(
        estimate_step_time(bf16, h100, time_params(BF16_WEIGHTS)).seconds
    )


def test_every_megatron_bridge_fp8_row_runs_fp8_params() -> None:
    # Megatron-Bridge's fp8_cs and fp8_mx recipes set fp8_param_gather; nvfp4 does not, nor do
    # NeMo 1's FP8 runs (NeMo 24.07). NeMo 2's (25.04: bf16_with_fp8_current_scaling_mixed) set
    # it too, but under Megatron-FSDP (its performance scripts' utils.py at v2.3.0)
    for row in load_runs():
        if row["stack"] != "megatron-core":
            continue
        _, stack, _ = run_plan(row)
        nemo2 = row["id"].startswith("nemo2504-") and not row["fsdp"]
        bridge_fp8 = (row["id"].startswith("mbridge-") or nemo2) and row["precision"] == "fp8"
        # (the stack's default is on; it acts under fp8 only)
        assert (stack.fp8_params and row["precision"] == "fp8") == bridge_fp8, row["id"]
