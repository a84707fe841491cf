"""This machine as the planner's hardware: the measured calibration carries every quantity."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.time import DEFAULT_TIME, estimate_step_time, time_params
from llmscale.stack import LLMSCALE, STACKS
from llmscale.train import calibration
from llmscale.train.calibration import SOURCE, measured_cluster


def test_measured_cluster_has_a_calibration_and_the_model_uses_it() -> None:
    model = get_preset("tiny")
    cluster, costs, figures = measured_cluster(model, 2, 64, torch.device("cpu"), dtypes=("fp32",))
    cal = cluster.gpu.calibration
    assert figures["attention_flops"] > 0 and figures["fixed_s"] > 0
    assert cal.attention_efficiency.source == SOURCE and cal.attention_efficiency.value > 0
    # What the runtime's stack costs on the device is measured alongside, the stack's.
    assert costs.microbatch_overhead_ms.value == 1000 * figures["fixed_s"]
    assert costs.microbatch_overhead_ms.source == SOURCE
    assert figures["optimizer_s"] > 0 and 0 < costs.optimizer_efficiency.value <= 1
    # The measured GEMM rate is the peak: every shape runs at it.
    assert cal.gemm_efficiency_at(7, 11, 13) == 1.0 and cal.hbm_efficiency.value == 1.0
    plan = Plan(model=model, seq_len=64, micro_batch_size=2, global_batch_size=2,
                precision="fp32")  # fmt: skip
    params = dataclasses.replace(DEFAULT_TIME, stack=DEFAULT_TIME.stack.on_device(costs))
    t = estimate_step_time(plan, cluster, params)
    # Stored in ms and read back in s: equal up to the round trip's last bit.
    assert t.breakdown["dispatch"] == pytest.approx(figures["fixed_s"], rel=1e-12)
    # The optimizer at its measured share of the measured element-wise bandwidth.
    opt_bw = figures["bandwidth_bytes"] * costs.optimizer_efficiency.value
    assert t.breakdown["optimizer"] == pytest.approx(28 * model.num_params() / opt_bw)
    assert t.breakdown["fixed"] == 0.0  # not measured: none, as the stack's costs there say


def test_elementwise_bandwidth_is_net_of_the_ops_fixed_cost(monkeypatch) -> None:
    """Ops that take a fixed 1 ms plus their bytes at 10 GB/s measure 10 GB/s: the fixed part is
    the micro-batch's fixed cost (the one-token step), not a slower bandwidth."""
    model = get_preset("tiny")
    dev = torch.device("cpu")

    def fake_seconds(model, b, s, precision, device, effort) -> float:  # type: ignore[no-untyped-def]
        return 1e-3 + calibration._elementwise_bytes(model, b, s, precision, device) / 10e9

    monkeypatch.setattr(calibration, "_elementwise_seconds", fake_seconds)
    for b, s in ((2, 64), (8, 128)):
        bw = calibration.elementwise_bandwidth_bytes_per_s(
            model, b, s, "fp32", dev, calibration.QUICK
        )
        assert bw == pytest.approx(10e9)
    # The real ops: a positive, finite rate.
    monkeypatch.undo()
    bw = calibration.elementwise_bandwidth_bytes_per_s(model, 2, 64, "bf16", dev, calibration.QUICK)
    assert 0 < bw < float("inf")


def test_the_bench_device_is_measured_at_the_runs_shape(monkeypatch) -> None:
    """Attention's cost per token grows with the sequence: 16 sequences of 128 tokens are not 8
    of 256 (the token count alone once picked the model's longest sequence)."""
    seen = []

    def fake(model, micro_batch, seq_len, precision, device, dtypes=(), effort=None):
        seen.append((micro_batch, seq_len))
        rates = {f"gemm_{d}_flops": 1e9 for d in (precision, *dtypes)}
        return {**rates, "attention_flops": 1e8, "bandwidth_bytes": 1e9, "fixed_s": 1e-3,
                "optimizer_s": 1e-2}  # fmt: skip

    monkeypatch.setattr(calibration, "measure", fake)
    model = get_preset("small")
    assert model.max_seq_len == 256
    measured_cluster(model, 16, 128, torch.device("cpu"), dtypes=("fp32",))
    assert seen == [(16, 128)]


def test_the_stacks_costs_are_sourced_to_when_and_under_what_load_they_were_measured() -> None:
    figures = {"bandwidth_bytes": 1e10, "fixed_s": 2e-3, "optimizer_s": 4e-3}
    model = get_preset("tiny")
    when = calibration.Measured(measured_at=86400.0 + 61, other_load_cores=0.126)
    costs = calibration.device_costs(figures, model, "a CPU", when)
    stamp = "1970-01-02 00:01 UTC, other processes' load 0.13 cores"
    assert costs.microbatch_overhead_ms == calibration.Sourced(2.0, f"{SOURCE}, {stamp}")
    share = 28 * model.num_params() / 1e10 / 4e-3
    assert costs.optimizer_efficiency.value == pytest.approx(min(1.0, share))
    assert costs.step_overhead_ms.value == 0.0 and costs.device == "a CPU"
    unknown = calibration.Measured(float("nan"), float("nan"))
    assert unknown.describe() == "when and under what load unknown"
    assert calibration.device_costs(figures, model, "a CPU").optimizer_efficiency.source == SOURCE


def test_a_cpu_hides_no_communication_and_the_time_model_follows_the_stack() -> None:
    """A CPU rank copies its gloo traffic on the core it computes on: a CPU's measured costs
    carry no overlap (the ring passes and all-reduces of bench/cp.py and of a training run's
    prediction alike), a GPU's keep the stack's; and parameters moved onto a stack take every
    field the stack sets."""
    figures = {"fixed_s": 0.01, "bandwidth_bytes": 1e10, "optimizer_s": 0.1}
    tiny = get_preset("tiny")
    cpu = calibration.device_costs(figures, tiny, "a test CPU")
    gpu = calibration.device_costs(figures, tiny, "a test GPU", device_type="cuda")
    assert LLMSCALE.on_device(cpu).dp_overlap == 0.0 == calibration.CPU_COMM_OVERLAP.value
    assert LLMSCALE.on_device(gpu).dp_overlap == LLMSCALE.dp_overlap == 0.85
    params = DEFAULT_TIME.with_stack(LLMSCALE.on_device(cpu))
    assert params.dp_overlap == 0.0 and params.stack.dp_overlap == 0.0
    for stack in STACKS.values():
        moved, direct = DEFAULT_TIME.with_stack(stack), time_params(stack)
        assert moved == dataclasses.replace(direct, kernels=DEFAULT_TIME.kernels)
    plan = Plan(model=tiny, seq_len=64, micro_batch_size=2, global_batch_size=8, cp=2, dp_shard=1)
    ring = estimate_step_time(plan, Cluster.of("h100"), params, validate=False).breakdown["cp_comm"]
    hidden = estimate_step_time(plan, Cluster.of("h100"), DEFAULT_TIME, validate=False).breakdown[
        "cp_comm"
    ]
    assert ring > hidden > 0
