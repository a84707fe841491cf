"""bench --what cp: context parallelism's step time, measured on 2 CPU ranks and predicted."""

from __future__ import annotations

import json

import pytest

from llmscale.bench import cp
from llmscale.bench.runner import BenchOptions
from llmscale.train import calibration


@pytest.mark.slow
def test_cp_suite_reports_measured_and_predicted_steps_with_the_ring_priced(tmp_path) -> None:
    """One repetition on the tiny model: both layouts trained on 2 gloo ranks, each row with a
    measured and a predicted step; the cp row's prediction prices the runtime's ring (its
    blocks at their measured rate, its passes on the measured link), the baseline's has none."""
    opts = BenchOptions(model="tiny", seq_len=32, steps=1, warmup=0, device="cpu",
                        data_files=8, work_dir=tmp_path)  # fmt: skip
    res = cp.run(opts, repetitions=1, min_steps=2, effort=calibration.QUICK)
    rows = {r.config: r for r in res.rows if r.quantity == "step time"}
    assert list(rows) == [x.label for x in cp.LAYOUTS]
    for r in res.rows:
        assert r.measured > 0 and r.predicted and r.predicted > 0
    (ratio,) = [r for r in res.rows if r.quantity == "step time ratio"]
    assert ratio.predicted == pytest.approx(
        rows[cp.LAYOUTS[1].label].predicted / rows[cp.LAYOUTS[0].label].predicted
    )  # one repetition: the ratio of its two predictions
    base, ring = rows[cp.LAYOUTS[0].label], rows[cp.LAYOUTS[1].label]
    assert "cp_comm" in ring.note and "cp_comm" not in base.note
    figures = json.loads((tmp_path / "cp" / "calibration-0.json").read_text())
    assert figures["ring_attention_flops"] > 0 and figures["p2p_bytes_per_s"] > 0
    assert figures["p2p_latency_s"] > 0
    # The two layouts ran the same samples: the same global batch of whole sequences.
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").open()
         if '"train"' in line]
        for run in ("dp2-0", "cp2-0")
    ]  # fmt: skip
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    (table,) = res.tables.values()
    assert len(table[1]) == 1 and "Load average" in res.notes[1]


def test_ring_calibration_counts_the_blocks_as_the_planner_prices_them(tmp_path) -> None:
    """The ring micro-benchmark (one rank alone: 3 blocks at cp = 2's chunk size) gives a rate
    at which the planner's ring for cp = 2 (5 blocks a call, forward and backward) takes 5/3 of
    the benchmark's own seconds: both count the same FLOPs per block."""
    import torch
    import torch.distributed as dist

    from llmscale.model.config import get_preset
    from llmscale.plan.cluster import Cluster
    from llmscale.plan.plan import Plan
    from llmscale.plan.time import (
        RING_BWD_MATMULS,
        RING_FWD_MATMULS,
        ring_attention_compute_seconds,
        ring_block_flops,
    )

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        m = get_preset("tiny")
        cpu = torch.device("cpu")
        rate = calibration.ring_attention_flops_per_s(
            m, 4, 32, 2, cpu, calibration.QUICK, dist.group.WORLD
        )
    finally:
        dist.destroy_process_group()
    plan = Plan(model=m, seq_len=32, micro_batch_size=4, global_batch_size=4, cp=2)
    bench_seconds = 3 * (RING_FWD_MATMULS + RING_BWD_MATMULS) * ring_block_flops(plan) / rate
    cluster = calibration.with_ring_attention(Cluster.of("h100"), rate)
    eff = cluster.gpu.calibration.ring_attention_efficiency
    assert eff is not None and eff.value == pytest.approx(rate / cluster.gpu.peak_flops("fp32"))
    priced = ring_attention_compute_seconds(plan, cluster)
    assert priced is not None
    assert sum(priced) == pytest.approx(5 / 3 * bench_seconds, rel=1e-9)
    assert priced[1] / priced[0] == pytest.approx(RING_BWD_MATMULS / RING_FWD_MATMULS)


def test_measured_link_replaces_the_nodes_links() -> None:
    """`with_link`: a pass of n bytes between two ranks costs latency + n / bandwidth, and the
    gradient all-reduce runs on the same link."""
    from llmscale.instrument.calibrate import with_link
    from llmscale.plan.cluster import Cluster
    from llmscale.plan.collectives import collective

    figures = {"p2p_latency_s": 2e-4, "p2p_bytes_per_s": 5e8}
    c = with_link(Cluster.of("h100"), figures, "test link")
    n = 2**20
    assert collective("p2p", n, 2, 2, c.fabric).seconds == pytest.approx(2e-4 + n / 5e8)
    ar = collective("all_reduce", n, 2, 2, c.fabric).seconds
    assert ar >= n / 5e8  # a 2-rank ring all-reduce moves n bytes each way at least
