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
