"""Ranks sharing a CPU's cores (plan/shared_cores.py): the gloo link as the planner reads it, and
the step composed from the measured costs, both by hand."""

from __future__ import annotations

import dataclasses

import pytest

from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.collectives import collective
from llmscale.plan.plan import Plan
from llmscale.plan.shared_cores import (
    SharedCoreCosts,
    gloo_cluster,
    one_token,
    shared_cores_step,
)
from llmscale.plan.time import DEFAULT_TIME, estimate_step_time

COSTS = SharedCoreCosts(
    oversubscription=2.0,
    allreduce_latency_s=500e-6,
    allreduce_bytes_per_s=0.5e9,
    step_overhead_s=0.25,
    other_load_cores=0.1,
    measured_at=0.0,
)
# The demo: tiny, fp32, 8 sequences of 128 per micro-batch, dp_shard 2 x tp 2.
DEMO = Plan(model=get_preset("tiny"), seq_len=128, micro_batch_size=8, global_batch_size=16,
            dp_shard=2, tp=2, precision="fp32")  # fmt: skip


def test_the_planners_all_reduce_on_the_gloo_link_is_the_measured_alpha_beta() -> None:
    """t(S) = latency + S / rate over the tp group it was measured on (the demo's two ranks;
    over more, the planner may pick a tree, cheaper in latency than the ring measured)."""
    tp = 2
    plan = DEMO
    fabric = gloo_cluster(Cluster.of("h100"), plan, COSTS).fabric
    for nbytes in (4096, 262_144, 4 * 2**20):
        got = collective("all_reduce", nbytes, tp, tp, fabric).seconds
        assert got == pytest.approx(500e-6 + nbytes / 0.5e9, rel=1e-9)


def test_the_step_is_the_overhead_plus_the_tokens_compute_shared_and_their_all_reduces() -> None:
    cluster = gloo_cluster(Cluster.of("h100"), DEMO, COSTS)
    step = estimate_step_time(DEMO, cluster, DEFAULT_TIME)
    one = estimate_step_time(one_token(DEMO), cluster, DEFAULT_TIME, validate=False)
    seconds, parts = shared_cores_step(step, one, COSTS)
    # tp's all-reduces by hand: 2 per block forward and 2 backward (attention and MLP outputs;
    # their input gradients), 4 blocks, of 8 x 128 tokens x 64 x 4 bytes; net of 8 x 1 tokens
    big, small = 8 * 128 * 64 * 4, 8 * 1 * 64 * 4
    assert parts["tp_comm"] == pytest.approx(4 * 4 * (big - small) / 0.5e9, rel=1e-9)
    net = {k: step.breakdown[k] - one.breakdown[k] for k in ("matmul", "elementwise")}
    assert parts["matmul"] == pytest.approx(2.0 * net["matmul"], rel=1e-12)
    assert parts["elementwise"] == pytest.approx(2.0 * net["elementwise"], rel=1e-12)
    assert parts["step_overhead"] == 0.25
    assert seconds == pytest.approx(sum(parts.values()), rel=1e-12)
    assert set(parts) == {"step_overhead", "matmul", "elementwise", "tp_comm"}
    # the oversubscription scales the tokens' compute only
    double = dataclasses.replace(COSTS, oversubscription=4.0)
    seconds2, _ = shared_cores_step(step, one, double)
    assert seconds2 - seconds == pytest.approx(2.0 * (net["matmul"] + net["elementwise"]))
