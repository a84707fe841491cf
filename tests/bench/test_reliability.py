"""docs/reliability.md's renderer: the fault tests' JSON rows to one Markdown table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmscale.bench.reliability import COLUMNS, main

ROWS = [
    {
        "test": "tests/faults/test_x.py::test_a",
        "fault": "config file that is not UTF-8",
        "command": "llmscale train --config bad.toml",
        "expected": "exit 2, one line",
        "observed": "exit 2: --config: 'bad.toml' is not UTF-8 text | x",
        "data_lost": "none",
        "outcome": "passed",
    },
    {
        "test": "tests/faults/test_x.py::test_b",
        "fault": "rerun into a used run folder",
        "command": "llmscale train `twice`",
        "expected": "refused",
        "observed": "exit 0\nmetrics.jsonl replaced",
        "data_lost": "metrics.jsonl",
        "outcome": "failed",
    },
    {
        "test": "tests/faults/test_x.py::test_c",
        "fault": "kill -9 mid-checkpoint",
        "command": "llmscale train ...",
        "expected": "resume bit-exact",
        "observed": "bit-exact",
        "data_lost": "none",
        "outcome": "passed",
    },
]


def test_renders_the_table_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "rows.json", tmp_path / "docs" / "reliability.md"
    src.write_text(json.dumps(ROWS))
    assert main([str(src), str(out)]) == 0
    assert "3 cases, 2 passed, data lost in 1" in capsys.readouterr().out
    page = out.read_text()
    assert "**3 cases, 2 passed, data lost in 1.**" in page
    table = [line for line in page.splitlines() if line.startswith("|")]
    assert table[0] == "| " + " | ".join(COLUMNS) + " |"
    body = table[2:]
    assert len(body) == 3
    # One cell per column in every row: a | inside a cell is escaped, a newline folded.
    for line in body:
        cells = line.replace("\\|", "").strip("|").split("|")
        assert len(cells) == len(COLUMNS), line
    assert "is not UTF-8 text \\| x" in body[0] and body[0].endswith("| none | pass |")
    assert "`llmscale train 'twice'`" in body[1]
    assert "exit 0 metrics.jsonl replaced" in body[1]
    assert body[1].endswith("| **metrics.jsonl** | **failed** |")


def test_rows_without_an_outcome_count_as_passed(tmp_path: Path) -> None:
    src, out = tmp_path / "rows.json", tmp_path / "r.md"
    src.write_text(json.dumps([{k: v for k, v in ROWS[2].items() if k != "outcome"}]))
    assert main([str(src), str(out)]) == 0
    assert "**1 cases, 1 passed, data lost in 0.**" in out.read_text()


@pytest.mark.parametrize("text", ["{not json", '{"fault": 1}', '[{"fault": "x"}]'])
def test_bad_json_is_one_line_exit_2(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "rows.json"
    src.write_text(text)
    assert main([str(src), str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "rows.json" in err
    assert not (tmp_path / "r.md").exists()
