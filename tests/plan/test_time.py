"""Step-time model: terms computed by hand, bubble closed forms, recompute shares, MFU."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from llmscale.errors import ConfigError
from llmscale.model.config import get_preset
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.time import DEFAULT_TIME, estimate_step_time, recompute_fraction

L7, L70 = get_preset("llama2-7b"), get_preset("llama2-70b")
H200 = Cluster.of("h200")


def test_one_gpu_step_by_hand() -> None:
    plan = Plan(
        model=L7, seq_len=2048, micro_batch_size=2, global_batch_size=8, precision="bf16"
    )  # 4 micro-batches, no parallelism
    t = estimate_step_time(plan, H200)
    tokens = 2 * 2048
    matmul = 3 * L7.forward_flops_per_token(2048) * tokens / (989.5e12 * 0.7)
    saved = 32 * act.block_bytes(L7, 2, 2048, "bf16") + act.head_bytes(L7, 2, 2048, "bf16")
    memory_bound = (2 + 3) * saved / 4.8e12
    optimizer = 28 * L7.num_params() / 4.8e12
    assert t.breakdown["matmul"] == pytest.approx(4 * matmul)
    assert t.breakdown["elementwise"] == pytest.approx(4 * memory_bound)
    assert t.seconds == pytest.approx(4 * (matmul + memory_bound) + optimizer)
    model_flops = L7.train_flops_per_token(2048) * 8 * 2048
    assert t.mfu == pytest.approx(model_flops / (t.seconds * 989.5e12))
    assert t.tokens_per_s == pytest.approx(8 * 2048 / t.seconds)


@pytest.mark.parametrize(
    ("schedule", "chunks", "bubble"),
    [("1f1b", 1, 3 / 11), ("gpipe", 1, 3 / 11), ("interleaved_1f1b", 2, 3 / 19)],
)
def test_bubble_closed_forms(schedule: str, chunks: int, bubble: float) -> None:
    plan = Plan(
        model=L70,
        seq_len=4096,
        micro_batch_size=1,
        global_batch_size=8,
        tp=8,
        pp=4,
        pp_schedule=schedule,
        pp_chunks=chunks,
    )
    assert estimate_step_time(plan, H200).bubble_fraction == pytest.approx(bubble)


def test_simulator_agrees_with_the_closed_form() -> None:
    plan = Plan(
        model=L70,
        seq_len=4096,
        micro_batch_size=1,
        global_batch_size=16,
        tp=8,
        pp=4,
        recompute="full",
    )
    closed = estimate_step_time(plan, H200)
    sim = estimate_step_time(plan, H200, simulate=True)
    # The closed form runs every stage at the slowest (head) stage's pace. With the head split
    # over tp (vocab-parallel, as the runtime runs it) the stages are within 0.1% of each other,
    # so that is no longer slack enough to hide the p2p latencies the simulator puts on every
    # steady-state dependency: the closed form is an upper bound only to within 1% (it was
    # exact while the planner kept the head whole on every tp rank).
    assert sim.seconds <= 1.01 * closed.seconds
    assert sim.seconds == pytest.approx(closed.seconds, rel=0.03)


def test_recompute_shares() -> None:
    base = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=8, tp=8)
    assert recompute_fraction(base) == 0.0
    assert recompute_fraction(replace(base, recompute="full")) == 1.0
    assert recompute_fraction(replace(base, recompute="every_k", recompute_every_k=4)) == 0.25
    core = 4 * 4096 * 8192  # QK^T and AV per token per block
    block = 2 * (L70.attention_weights() + L70.mlp_weights()) + core
    assert recompute_fraction(replace(base, recompute="selective")) == pytest.approx(core / block)


def test_tensor_parallel_collectives_per_block() -> None:
    none = estimate_step_time(
        Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=8, tp=8, pp=8), H200
    )
    full = estimate_step_time(
        Plan(
            model=L70,
            seq_len=4096,
            micro_batch_size=1,
            global_batch_size=8,
            tp=8,
            pp=8,
            recompute="full",
        ),
        H200,
    )
    sp = estimate_step_time(
        Plan(
            model=L70,
            seq_len=4096,
            micro_batch_size=1,
            global_batch_size=8,
            tp=8,
            pp=8,
            sequence_parallel=True,
        ),
        H200,
    )
    # 2 all-reduces forward + 2 backward; full recompute repeats the forward 2.
    assert full.breakdown["tp_comm"] / none.breakdown["tp_comm"] == pytest.approx(6 / 4)
    # Sequence parallelism: all-gather + reduce-scatter moves the same bytes (ring).
    assert sp.breakdown["tp_comm"] == pytest.approx(none.breakdown["tp_comm"], rel=0.01)


def test_fsdp_traffic_is_exposed_only_beyond_compute() -> None:
    plan = Plan(model=L70, seq_len=4096, micro_batch_size=1, global_batch_size=64, dp_shard=64)
    hidden = estimate_step_time(plan, H200)
    exposed = estimate_step_time(plan, H200, replace(DEFAULT_TIME, dp_overlap=0.0))
    assert hidden.breakdown["fsdp_comm"] == 0.0
    assert exposed.breakdown["fsdp_comm"] > 0 and exposed.seconds > hidden.seconds


def test_tp_larger_than_a_node_is_rejected() -> None:
    with pytest.raises(ConfigError) as e:
        estimate_step_time(
            Plan(model=L7, seq_len=4096, micro_batch_size=1, global_batch_size=1, tp=16), H200
        )  # valid for the runtime, not a node
    assert e.value.field == "parallel.tp" and "GPUs per node" in e.value.allowed


def test_planner_packages_do_not_import_torch() -> None:
    code = (
        "import sys, llmscale.hardware.catalog, llmscale.plan.search, llmscale.plan.network, "
        "llmscale.plan.roofline, llmscale.plan.predict, llmscale.plan.report, "
        "llmscale.plan.published; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
