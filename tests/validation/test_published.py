"""Published validation: Narayanan et al. 2021, Korthikanti et al. 2022, torchtitan 2024."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmscale.bench.published import COMMAND, markdown
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import default_catalog
from llmscale.plan.time import DEFAULT_TIME
from llmscale.validation.published import (
    DATA,
    MEGATRON_2021_RUNTIME,
    Row,
    all_rows,
    gpt_model,
    load_rows,
    narayanan_2021,
)

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
    # Package data (pyproject's package-data), not test data: found beside validation/published.py.
    assert DATA.is_file() and DATA.parent == SRC / "llmscale" / "validation" / "data"
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


# ---- every published row against its value (docs/planner-validation.md) -------------------

ALL = all_rows()


def _id(r: Row) -> str:
    return f"{r.case}|{r.quantity}"


@pytest.mark.parametrize("row", ALL, ids=_id)
def test_every_published_row_within_10_percent(row: Row) -> None:
    assert abs(row.ratio - 1) <= 0.10, (row.case, row.quantity, row.published, row.predicted)


def test_the_22b_activations_follow_from_64_heads() -> None:
    # Fig. 1's 59.25 GiB is eq. sbhL (10 + 24/t + 5as/(ht)) with a = 64 heads; 48 gave 0.88.
    (row,) = [
        r for r in ALL if (r.case, r.quantity) == ("GPT 22B", "GiB activations, no recompute")
    ]
    assert abs(row.ratio - 1) < 0.01


def test_the_rows_cover_the_issue() -> None:
    k = [r for r in ALL if r.source.startswith("Korthikanti")]
    t = [r for r in ALL if r.source.startswith("torchtitan")]
    assert len(k) == 4 * 5 and len(t) == 2 * 2
    assert len([r for r in ALL if r.source.startswith("Narayanan")]) == 10
    published = {(r.case, r.quantity): r.published for r in ALL}
    assert published[("GPT 175B", "iteration s, SP + selective")] == 13.75
    assert published[("Llama 3.1 8B, 128 GPUs", "tokens/s per GPU")] == 5605


def test_korthikanti_activations_follow_the_paper_formula() -> None:
    # 1T, t8 p64 (no interleaving): the first stage holds p micro-batches of L/p layers,
    # sbhL (10 + 24/t + 5as/(ht)) = sbhL * 21 bytes; with SP + selective sbhL * 34/t.
    acts = {r.quantity: r.predicted for r in ALL if r.case == "GPT 1000B"}
    sbhl = 2048 * 1 * 25600 * 128 / 2**30
    # (plus the first stage's int64 token ids: a few MiB)
    assert acts["GiB activations, no recompute"] == pytest.approx(21 * sbhl, rel=1e-4)
    assert acts["GiB activations, SP + selective"] == pytest.approx(34 / 8 * sbhl, rel=2e-4)


def test_the_fitted_rows_are_fits() -> None:
    # The two calibrated numbers reproduce the rows they were fitted on (their sources say so).
    by = {(r.case, r.quantity): r for r in ALL}
    assert by[("gpt-1008.0b", "TFLOP/s per GPU")].ratio == pytest.approx(1.0, abs=0.01)
    assert by[("Llama 3.1 8B, 8 GPUs", "tokens/s per GPU")].ratio == pytest.approx(1.0, abs=0.01)
    cat = default_catalog()
    assert "Narayanan" in cat.gpu("a100-80g").calibration.gemm_efficiency.source
    assert "torchtitan" in cat.gpu("h100-96g").calibration.gemm_efficiency.source


def test_the_fitted_run_rows_are_fits() -> None:
    """Each runs.toml row a stack's factor was fitted on reproduces its published throughput
    (to the rounding of the factor), and is marked `calibration`."""
    from llmscale.validation.runs import evaluate, load_runs

    rows = {r["id"]: r for r in load_runs()}
    for rid in ("mbridge-2511-gb200-llama3-8b-fp8", "mbridge-2511-gb300-llama3-8b-fp8",
                "tt2412-8b-8gpu-fsdp"):  # fmt: skip
        assert rows[rid]["role"] == "calibration"
        assert evaluate(rows[rid]).ratio == pytest.approx(1.0, abs=0.01), rid


def test_the_validation_page_is_regenerated() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "planner-validation.md"
    assert page.read_text() == markdown(ALL), f"stale: run {COMMAND}"


def test_bench_suite_lists_the_rows() -> None:
    from llmscale.bench.suites import SUITES

    assert SUITES["published"] == "llmscale.bench.published"
