"""`python -m llmscale.bench.timed NAME -- CMD`: a command's wall time, recorded on success."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from llmscale.bench import timed


def test_a_command_is_timed_and_its_row_replaced(tmp_path: Path) -> None:
    out = tmp_path / "timings.json"
    sleep = [sys.executable, "-c", "import time; time.sleep(0.3)"]
    assert timed.main(["make x", "--out", str(out), "--", *sleep]) == 0
    assert timed.main(["other", "--out", str(out), "--", sys.executable, "-c", "pass"]) == 0
    assert timed.main(["make x", "--out", str(out), "--", *sleep]) == 0
    rows = json.loads(out.read_text())["timings"]["rows"]
    assert [r["config"] for r in rows] == ["other", "make x"]  # one row per name, the newest
    x = rows[1]
    assert 0.3 <= x["measured"] < 30 and x["quantity"] == "wall time" and x["unit"] == "s"
    assert x["predicted"] is None and "load average" in x["note"] and x["measured_at"]


def test_a_failing_command_passes_its_status_on_and_is_not_recorded(tmp_path: Path) -> None:
    out = tmp_path / "timings.json"
    fail = [sys.executable, "-c", "raise SystemExit(3)"]
    assert timed.main(["make x", "--out", str(out), "--", *fail]) == 3
    assert timed.main(["make x", "--out", str(out), "--", "/no/such/command"]) == 2
    assert not out.exists()
