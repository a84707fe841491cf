"""The stamp every bench recorder writes around its figures."""

import json
from pathlib import Path

from llmscale.bench.records import suite_record, write_record


def test_a_record_is_stamped_and_written(tmp_path: Path, capsys) -> None:
    rec = suite_record("demo", "A title", "llmscale.bench.x", ["--a", "1"], (0.5, 1.25), n=3)
    body = rec["demo"]
    assert body["title"] == "A title" and body["n"] == 3
    assert body["command"] == "python -m llmscale.bench.x --a 1"
    assert body["load_average"] == [0.5, 1.25] and body["cores"] >= 1 and body["threads"] >= 1
    assert body["measured_at"].endswith("+00:00")
    out = tmp_path / "sub" / "demo.json"
    write_record(out, rec)
    assert json.loads(out.read_text()) == rec and out.read_text().endswith("\n")
    assert capsys.readouterr().out == f"wrote {out}\n"
