"""Profiles: which training stack's kernels and memory behaviour the planner models."""

from __future__ import annotations

import pytest

from llmscale.errors import ConfigError
from llmscale.model.config import get_preset, op_sac_saves_matmul
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.profiles import (
    PROFILE_NAMES,
    PROFILES,
    get_profile,
    kernels_for,
    op_sac_block_bytes,
    time_params,
)
from llmscale.plan.time import DEFAULT_TIME, eager_block_bytes, estimate_step_time

L8 = get_preset("llama3-8b")
H100 = Cluster.of("h100")


def test_the_three_profiles() -> None:
    assert tuple(PROFILES) == PROFILE_NAMES == ("llmscale", "megatron", "torchtitan")
    assert time_params("llmscale") is DEFAULT_TIME  # the runtime's own declarations
    assert get_profile("megatron").kernels == act.MEGATRON_2021
    assert get_profile("megatron").state_bytes_per_param == 18.0
    with pytest.raises(ConfigError, match="llmscale | megatron | torchtitan"):
        get_profile("deepspeed")


def test_llmscale_profile_is_the_runtime() -> None:
    assert kernels_for("llmscale", L8, 8) == act.Kernels.for_runtime(L8, 8)
    assert kernels_for("llmscale", L8, 1, "cpu").device == "cpu"


def test_op_sac_saves_every_other_matmul() -> None:
    # wq, wk, wv, wo, w1, w3, w2: torchtitan saves the 1st, 3rd, 5th and 7th mm outputs.
    saved = tuple(op_sac_saves_matmul(i) for i in range(len(L8.block_matmuls())))
    assert saved == (True, False, True, False, True, False, True)
    d, kv, f = 4096, 1024, 14336
    per_token = 2 * d + 2 * (d + kv + f + d) + 2 * d + 4 * 32
    assert op_sac_block_bytes(L8, 2, 8192, "bf16") == per_token * 2 * 8192


def test_op_sac_recomputes_more_than_the_attention_core() -> None:
    plan = Plan(model=L8, seq_len=8192, micro_batch_size=1, global_batch_size=1,
                recompute="selective")  # fmt: skip
    core = estimate_step_time(plan, H100)
    op = estimate_step_time(plan, H100, time_params("torchtitan"))
    assert op.breakdown["matmul"] > core.breakdown["matmul"]


def test_eager_elementwise_traffic() -> None:
    plan = Plan(model=L8, seq_len=2048, micro_batch_size=1, global_batch_size=1)
    d, kv, f = 4096, 1024, 14336
    per_token = 2 * 36 * d + 2 * 6 * d + 20 * (d + kv) + 4 * (d + kv) + 10 * f
    assert eager_block_bytes(plan) == per_token * 2048
