"""Published validation: Narayanan et al. 2021, Table 1, predicted within 0.85-1.15."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmscale.plan.published import MEGATRON_2021_RUNTIME, gpt_model, load_rows, narayanan_2021
from llmscale.plan.time import DEFAULT_TIME

DATA = Path(__file__).resolve().parents[1] / "data" / "published.toml"


@pytest.fixture(scope="module")
def comparisons():
    return narayanan_2021(DATA)


def test_every_row_has_a_source_and_its_published_shape() -> None:
    assume, rows = load_rows(DATA)
    assert len(rows) == 10 and assume["source"].startswith("assumption")
    for row in rows:
        assert row["source"].startswith("Narayanan et al. 2021, Table 1")
        m = gpt_model(row)
        # The paper's parameter count: 12 l h^2 (1 + 13/12h + (V + s)/12lh).
        l_, h = row["layers"], row["hidden"]
        paper = 12 * l_ * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * l_ * h))
        assert paper / 1e9 == pytest.approx(row["params_billion"], abs=0.06)
        untied_copy = 0 if m.tie_embeddings else 51200 * h  # the last stage's embedding copy
        assert m.num_params() - untied_copy == pytest.approx(paper, rel=0.002)
        assert row["gpus"] % (row["tp"] * row["pp"]) == 0


def test_predicted_over_published_within_15_percent(comparisons) -> None:
    ratios = {c.name: round(c.ratio, 3) for c in comparisons}
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


def test_one_parameter_set_for_every_row() -> None:
    # Only runtime facts differ from the planner's defaults, never an efficiency.
    assert MEGATRON_2021_RUNTIME.matmul_efficiency == DEFAULT_TIME.matmul_efficiency
    assert MEGATRON_2021_RUNTIME.fwd_passes == DEFAULT_TIME.fwd_passes
    assert MEGATRON_2021_RUNTIME.bwd_passes == DEFAULT_TIME.bwd_passes
    assert MEGATRON_2021_RUNTIME.tp_overlap == DEFAULT_TIME.tp_overlap
