"""`llmscale claims`: every claim of the article has a row, a figure and a verdict."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llmscale.cli import main
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import default_catalog
from llmscale.plan.cluster import Cluster
from llmscale.plan.network import design
from llmscale.validation import claims

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "results.json"

# One phrase from each claim the issue lists (issue 16), in its order.
EXPECTED = [
    "H200: 141 GB",
    "1.9x faster",
    "compute-bound rather than memory-bound",
    "MI325X",
    "up to 8x",
    "5 exponent and 10 fraction",
    "31% of gradient values",
    "8 to 32K",
    "4 micro-batches of 64",
    "cuts training time by 31%",
    "33% more compute",
    "4x reduction",
    "LSP-Offload",
    "interleaved pipeline",
    "NVLink 5",
    "576 GPUs",
    "Infinity Fabric",
    "6x bandwidth density",
    "64 channels at 32 Gb/s",
    "rail-only",
]


def test_every_claim_has_a_row_with_a_verdict_fast() -> None:
    t0 = time.perf_counter()
    rows = claims.check_claims(RESULTS)
    assert time.perf_counter() - t0 < 5
    assert len(rows) == len(EXPECTED)
    for phrase, row in zip(EXPECTED, rows, strict=True):
        assert phrase in row.claim, (phrase, row.claim)
        assert row.verdict in claims.VERDICTS
        assert row.source and row.command and row.figure and row.why


def test_disagreements_are_said_plainly() -> None:
    by = {r.claim: r for r in claims.check_claims(RESULTS)}
    underflow = next(r for c, r in by.items() if "31% of gradient" in c)
    assert underflow.verdict == "does not hold here"
    assert "1.53%" in underflow.figure  # results.json's median at loss scale 2^0
    faster = next(r for c, r in by.items() if "cuts training time" in c)
    assert faster.verdict == "does not hold here"


def test_rail_only_figures_come_from_the_network_model() -> None:
    cat = default_catalog()
    base = Cluster.of("h100", catalog=cat)
    sw = cat.switch_for_link(base.fabric.inter.name)
    saved = [
        1
        - design("rail-only", n, base, sw, cat).cost_usd
        / design("fat-tree", n, base, sw, cat).cost_usd
        for n in (256, 32768)
    ]
    row = next(r for r in claims.check_claims(RESULTS) if "rail-only" in r.claim)
    assert f"{100 * saved[0]:.1f}% of network cost at 256" in row.figure
    assert f"{100 * saved[1]:.1f}% at 32,768" in row.figure
    assert saved[0] > 0.4 and saved[1] == pytest.approx(0.0)


def test_h200_row_reports_the_predicted_ratio_next_to_nvidias() -> None:
    row = next(r for r in claims.check_claims(RESULTS) if "1.9x faster" in r.claim)
    assert "vs NVIDIA's 1.9x" in row.figure


def test_without_results_measured_rows_say_so(tmp_path: Path) -> None:
    rows = claims.check_claims(tmp_path / "missing.json")
    measured = [r for r in rows if claims.NOT_MEASURED in r.figure]
    assert len(measured) >= 4  # underflow, scaling, accumulation (2), offload overlap
    assert all(r.verdict in claims.VERDICTS for r in rows)


def test_measured_at_is_quoted(tmp_path: Path) -> None:
    data = json.loads(RESULTS.read_text())
    data["precision"]["measured_at"] = "2026-12-03T15:00:00+00:00"
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    row = next(r for r in claims.check_claims(path) if "31% of gradient" in r.claim)
    assert "measured 2026-12-03T15:00:00+00:00" in row.figure


def test_a_broken_results_file_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "results.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError):
        claims.check_claims(bad)
    assert main(["claims", "--results", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmscale claims: error: results")


def test_cli_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "claims.md"
    assert main(["claims", "--json", "--results", str(RESULTS), "--markdown", str(md)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["claims"]) == len(EXPECTED)
    assert all(
        set(c) == {"claim", "source", "command", "figure", "verdict", "why"} for c in d["claims"]
    )
    text = md.read_text()
    assert text.count("\n| ") == len(EXPECTED) + 1  # header + one row per claim


def test_docs_claims_md_is_current() -> None:
    """docs/claims.md is generated: `llmscale claims --markdown docs/claims.md` (make claims)."""
    rows = claims.check_claims(RESULTS)
    want = claims.to_markdown(rows, Path("docs/results/results.json"))
    assert (ROOT / "docs" / "claims.md").read_text() == want


def test_make_results_json_carries_measured_at(tmp_path: Path) -> None:
    from llmscale.bench.report import SuiteResult, write_json

    table = json.loads(RESULTS.read_text())["precision"]["tables"]
    res = SuiteResult("precision", "Precision")
    res.tables = {k: (v["header"], v["rows"]) for k, v in table.items()}
    path = tmp_path / "results.json"
    write_json([res], path)
    at = json.loads(path.read_text())["precision"]["measured_at"]
    assert at.endswith("+00:00") and at[:4].isdigit()
    row = next(r for r in claims.check_claims(path) if "31% of gradient" in r.claim)
    assert f"measured {at}" in row.figure
