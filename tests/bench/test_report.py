"""Bench rows: the spread a median is quoted with, in the row and in what renders it."""

from __future__ import annotations

import pytest

from llmscale.bench.report import Row, SuiteResult, half_iqr, markdown


def test_half_iqr_is_half_the_interquartile_range() -> None:
    assert half_iqr([]) is None and half_iqr([1.0]) is None
    assert half_iqr([1.0, 3.0]) == pytest.approx(0.5)  # quartiles 1.5 and 2.5
    assert half_iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(1.0)  # quartiles 2 and 4
    # One slow step in eight (a shared host's hiccup) barely moves it.
    steady = [0.20, 0.21, 0.20, 0.21, 0.20, 0.21, 0.20, 0.21]
    assert half_iqr([*steady[:-1], 2.0]) == pytest.approx(half_iqr(steady), abs=0.003)


def test_a_rows_spread_is_rendered_and_saved() -> None:
    row = Row("s", "c", "bubble", "%", 38.3, 34.5, "n", spread=0.4)
    assert row.measured_text() == "38.3% +/- 0.4%"
    assert row.to_dict()["spread"] == 0.4
    plain = Row("s", "c", "step time", "s", 0.2)
    assert plain.measured_text() == "200.0 ms" and plain.to_dict()["spread"] is None
    md = markdown([SuiteResult("s", "title", rows=[row, plain])])
    assert "| 38.3% +/- 0.4% |" in md and "| 200.0 ms |" in md
