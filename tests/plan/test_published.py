"""Published validation: Narayanan et al. 2021, Table 1, predicted within 0.85-1.15."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmscale.errors import ConfigError
from llmscale.plan.published import (
    DATA,
    MEGATRON_2021_RUNTIME,
    gpt_model,
    load_rows,
    narayanan_2021,
)
from llmscale.plan.time import DEFAULT_TIME

SRC = Path(__file__).resolve().parents[2] / "src"


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


def test_the_rows_ship_with_the_package() -> None:
    # Package data (pyproject's package-data), not test data: found beside plan/published.py.
    assert DATA.is_file() and DATA.parent == SRC / "llmscale" / "plan" / "data"
    assert load_rows() == load_rows(DATA)


@pytest.mark.parametrize("source", [None, "", "   "])
def test_a_row_without_a_source_is_refused(tmp_path, source) -> None:
    row = "[[narayanan2021]]\nparams_billion = 1.7\ntflops_per_gpu = 137\n"
    if source is not None:
        row += f"source = {source!r}\n"
    good = '[[narayanan2021]]\nparams_billion = 1.7\nsource = "Table 1, row 1"\n'
    path = tmp_path / "rows.toml"
    path.write_text(good + row)
    with pytest.raises(ConfigError, match=r"narayanan2021\[1\]\.source"):
        load_rows(path)


def test_no_product_code_reads_test_data() -> None:
    # Neither a "tests/..." path nor one built as `... / "tests" / ...`.
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if "tests/data" in (text := p.read_text()) or '"tests"' in text
    ]
    assert not offenders, offenders
