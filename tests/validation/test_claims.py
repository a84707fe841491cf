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
    # Rows that rest on measurements alone say so; the others keep their computed checks.
    only_measured = {6, 7, 8, 9, 12}  # 0-based: underflow, scaling, accumulation (2), overlap
    for i, r in enumerate(rows):
        if i in only_measured:
            assert r.verdict == "not measured", (r.claim, r.verdict)
        else:
            assert r.verdict != "not measured", (r.claim, r.verdict)


def _doctor(data: dict) -> dict:
    """results.json with every measured figure a claim reads pushed the other way."""
    d = json.loads(json.dumps(data))
    tok = {r["config"]: r for r in d["precision"]["rows"] if r["quantity"] == "tokens/s"}
    tok["bf16"]["measured"] = 10 * tok["fp32"]["measured"]  # bf16 10x faster end to end
    for t in d["precision"]["tables"].values():
        for row in t["rows"]:
            if row[0] == "2^0":
                row[1] = row[3] = "35.00%"  # underflow 35% unscaled
            if row[0] == "2^15":
                row[5] = "50.000%"  # overflow at 2^15: 50%
    for t in d["accum"]["tables"].values():
        for row in t["rows"]:
            row[1] = "5.00e-01"  # accumulated gradients differ by 50%
    step = {r["config"]: r for r in d["accum"]["rows"] if r["quantity"] == "step time"}
    step["b=8 k=4"]["measured"] = 0.61 * step["b=32 k=1"]["measured"]  # 39% faster
    for r in d["recompute"]["rows"]:
        if r["config"] == "recompute=full":
            r["measured"] = 3.0  # recompute costs 3x
    bubble = {r["config"]: r for r in d["pipeline"]["rows"] if "simulator" in r["quantity"]}
    bubble["pp=4 interleaved v=2 m=8"]["measured"] = 1.2 * bubble["pp=4 1f1b m=8"]["measured"]
    for r in d["finetune"]["rows"]:  # lsp's transfers at 0.1 GB/s show up in full
        if r["config"] == "lsp @ 0.1 GB/s" and r["quantity"] == "step time (median)":
            r["measured"] += 0.08
    return d


def test_doctored_measurements_change_every_measured_verdict(tmp_path: Path) -> None:
    """No measured row's verdict is a constant: doctored figures change each of them."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_doctor(json.loads(RESULTS.read_text()))))
    real = claims.check_claims(RESULTS)
    fake = claims.check_claims(path)
    measured = [
        i for i, r in enumerate(claims.check_claims(tmp_path / "none.json"))
        if claims.NOT_MEASURED in r.figure
    ]  # fmt: skip
    assert len(measured) == 8
    changed = {i for i in measured if real[i].verdict != fake[i].verdict}
    assert changed == set(measured), [(real[i].claim, real[i].verdict) for i in measured]
    by = {r.claim[:20]: r.verdict for r in fake}
    assert by["31% of gradient valu"] == "holds"  # 35% is within 30% of 31%
    assert by["accumulation cuts tr"] == "holds"  # 39% is within 30% of 31%
    assert by["accumulating 4 micro"] == "does not hold here"
    assert by["activation checkpoin"] == "does not hold here"
    assert by["interleaved pipeline"] == "does not hold here"
    assert by["loss-scale factors o"] == "holds with a caveat"
    # The why is the checks written out, from the figures.
    row = next(r for r in fake if r.claim.startswith("activation checkpointing"))
    assert "extra step time measured: 200.0% is not within 30% of 33.0%" in row.why


def test_rule_verdicts() -> None:
    ok, bad = claims.Check("a", 1.0, 1.0), claims.Check("b", 2.0, 1.0, tolerance=0.5)
    unmeasured = claims.Check("c", None, 1.0)
    assert claims.Rule((ok,)).verdict() == "holds"
    assert bad.passes() is False and claims.Rule((ok, bad)).verdict() == "does not hold here"
    assert claims.Rule((unmeasured,)).verdict() == "not measured"
    assert claims.Rule((ok, unmeasured)).verdict() == "holds with a caveat"
    assert claims.Rule((ok,), (bad,)).verdict() == "holds with a caveat"
    assert claims.Rule((ok,), restates=True).verdict() == "restates its source"
    assert claims.Rule((bad,), restates=True).verdict() == "does not hold here"
    assert claims.Check("d", 1.5, 1.0, "at least").passes() is True
    assert claims.Check("d", 0.5, 1.0, "at least").passes() is False
    assert "caveat: b: 2 is not within 50% of 1" in claims.Rule((ok,), (bad,)).why()


def test_a_figure_within_its_spread_of_the_bar_is_a_caveat_either_side() -> None:
    """A measurement that another run could put on the other side of the bar neither holds
    nor fails: it is a caveat, whichever side this run fell on."""
    over = claims.Check("m", 1.02, 1.0, "at most", fmt="x{:.2f}", spread=0.05)
    under = claims.Check("m", 0.98, 1.0, "at most", fmt="x{:.2f}", spread=0.05)
    clear = claims.Check("m", 1.2, 1.0, "at most", fmt="x{:.2f}", spread=0.05)
    assert over.passes() is False and over.in_noise()
    assert under.passes() is True and under.in_noise()
    assert not clear.in_noise()
    assert claims.Rule((over,)).verdict() == "holds with a caveat"
    assert claims.Rule((under,)).verdict() == "holds with a caveat"
    assert claims.Rule((clear,)).verdict() == "does not hold here"
    assert claims.Rule((claims.Check("m", 1.02, 1.0, "at most"),)).verdict() == (
        "does not hold here"
    )  # no spread recorded: as before
    assert "x1.02 is not at most x1.00, within its run-to-run spread (+/- 0.05)" in over.text()
    # A condition within its spread of its bar is a caveat too, passing or not.
    assert claims.Rule((claims.Check("ok", 1.0, 1.0),), (under,)).verdict() == (
        "holds with a caveat"
    )
    assert claims.Rule((claims.Check("ok", 1.0, 1.0),), (under,)).why().startswith("caveat: m")
    # "within": either end of the tolerance is a bar.
    edge = claims.Check("w", 1.29, 1.0, tolerance=0.3, spread=0.02)
    assert edge.bars() == pytest.approx((0.7, 1.3)) and edge.in_noise()
    assert claims.Check("w", 1.0, 1.0, tolerance=0.3, spread=0.02).in_noise() is False


def _with_bubbles(ratio: float, spread: float) -> dict:
    """results.json with the pp 4 interleaved bubble at `ratio` x 1F1B's, both quoted with a
    relative spread of `spread` / 2 (so the ratio's is about `spread`)."""
    d = json.loads(RESULTS.read_text())
    bubble = {r["config"]: r for r in d["pipeline"]["rows"] if "simulator" in r["quantity"]}
    f1b, intl = bubble["pp=4 1f1b m=8"], bubble["pp=4 interleaved v=2 m=8"]
    intl["measured"] = ratio * f1b["measured"]
    for r in (f1b, intl):
        r["spread"] = r["measured"] * spread / 2
    return d


@pytest.mark.parametrize(
    "ratio, spread, verdict",
    [
        (1.02, 0.05, "holds with a caveat"),  # over the bar, within the spread: a caveat
        (0.98, 0.05, "holds with a caveat"),  # under the bar, within the spread: the same
        (1.02, 0.01, "does not hold here"),  # over it by more than the spread
        (0.70, 0.05, "holds"),  # clear of both bars (1.0, and 0.8 for "significantly")
    ],
)
def test_interleaved_verdict_weighs_the_measured_spread(
    tmp_path: Path, ratio: float, spread: float, verdict: str
) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_with_bubbles(ratio, spread)))
    row = next(r for r in claims.check_claims(path) if "interleaved pipeline" in r.claim)
    assert row.verdict == verdict, row.why
    assert ("run-to-run spread" in row.why) == (verdict == "holds with a caveat")


def test_offload_overlap_verdict_weighs_the_step_times_spread(tmp_path: Path) -> None:
    """The hidden share is a difference of two medians: their spreads add, over the transfer
    time; near the 80% bar that makes the verdict a caveat instead of a coin toss."""
    d = json.loads(RESULTS.read_text())
    moved = next(
        r for r in d["finetune"]["rows"]
        if r["config"] == "lsp" and r["quantity"] == "bytes moved per step"
    )  # fmt: skip
    transfer = moved["measured"] / 0.1e9
    rows = {
        r["config"]: r for r in d["finetune"]["rows"]
        if r.get("suite") == "finetune-time" and r["quantity"] == "step time (median)"
    }  # fmt: skip
    native = rows["lsp @ native"]
    rows["lsp @ 0.1 GB/s"]["measured"] = native["measured"] + 0.21 * transfer  # 79% hidden
    path = tmp_path / "results.json"
    path.write_text(json.dumps(d))
    by_spread = {}
    for spread in (None, 0.01 * transfer):
        for r in rows.values():
            r["spread"] = spread
        path.write_text(json.dumps(d))
        row = next(r for r in claims.check_claims(path) if "LSP-Offload" in r.claim)
        by_spread[spread] = row
    assert by_spread[None].verdict == "does not hold here"
    assert by_spread[0.01 * transfer].verdict == "holds with a caveat"
    assert "79.0% is not at least 80.0%, within its run-to-run spread (+/- 2.0%)" in (
        by_spread[0.01 * transfer].why
    )


def test_same_verdicts_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CL04: the results are found from the package, never from the working directory (from
    /tmp the two "does not hold here" verdicts became "holds with a caveat")."""
    monkeypatch.chdir(ROOT)
    assert main(["claims", "--json"]) == 0
    here = json.loads(capsys.readouterr().out)
    monkeypatch.chdir(tmp_path)
    assert main(["claims", "--json"]) == 0
    there = json.loads(capsys.readouterr().out)
    assert [c["verdict"] for c in here["claims"]] == [c["verdict"] for c in there["claims"]]
    assert here == there
    assert claims.DEFAULT_RESULTS == RESULTS


@pytest.mark.parametrize("case", ["CL01", "CL06"])
def test_a_given_results_path_that_is_missing_or_a_folder_is_one_line_exit_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CL01, CL06: an explicit --results that is no file was read as "not measured" (exit 0)."""
    path = tmp_path / "missing.json" if case == "CL01" else tmp_path
    assert main(["claims", "--json", "--results", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    why = "missing" if case == "CL01" else "a folder"
    assert err == (
        f"llmscale claims: error: --results: got '{path}'; allowed: a results JSON file, "
        f"as make results writes ({why})\n"
    )


def test_a_missing_default_results_file_is_a_notice_on_stderr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --results, a checkout (or wheel) with no results file still checks the claims."""
    monkeypatch.setattr(claims, "DEFAULT_RESULTS", tmp_path / "missing.json")
    assert main(["claims", "--json"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)["claims"]  # stdout stays pure JSON
    assert err.startswith("llmscale claims: note: no results at") and err.count("\n") == 1
    assert sum(r["verdict"] == "not measured" for r in rows) >= 1


def test_stale_results_are_a_notice_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(RESULTS.read_text())
    for s in data.values():
        s["measured_at"] = "2000-01-01T00:00:00+00:00"
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert main(["claims", "--json", "--results", str(old)]) == 0
    out, err = capsys.readouterr()
    stale = json.loads(out)
    if (ROOT / ".git").exists():
        assert "older than the code that produced it" in err
    for s in data.values():
        s["measured_at"] = "2999-01-01T00:00:00+00:00"
    new = tmp_path / "new.json"
    new.write_text(json.dumps(data))
    assert main(["claims", "--json", "--results", str(new)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    fresh = json.loads(out)
    # Staleness never changes a verdict.
    assert [c["verdict"] for c in stale["claims"]] == [c["verdict"] for c in fresh["claims"]]


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
        set(c) == {"claim", "source", "command", "figure", "verdict", "why", "rule"}
        for c in d["claims"]
    )
    assert all(c["rule"]["claim"] for c in d["claims"])
    text = md.read_text()
    assert text.count("\n| ") == len(EXPECTED) + 1  # header + one row per claim


def test_docs_claims_md_is_current() -> None:
    """docs/claims.md is generated: `llmscale claims --markdown docs/claims.md` (make claims)."""
    rows = claims.check_claims(RESULTS)
    want = claims.to_markdown(rows, "docs/results/results.json")
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
