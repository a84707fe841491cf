"""`make demo`'s record (bench/demo.py): what the train command printed, as data, rendered again
line for line by the command's own renderers (README's demo block)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from llmscale import docs
from llmscale.bench import demo
from llmscale.bench.jobs import short_job
from llmscale.config import load_config
from llmscale.train import calibration
from llmscale.train.metrics import read_jsonl
from llmscale.train.progress import SUMMARY
from llmscale.train.trainer import run_training

FAKE = {  # the device's micro-benchmarks, replaced by round figures (no measuring in a test)
    "gemm_fp32_flops": 2e9,
    "attention_flops": 1e9,
    "bandwidth_bytes": 1e10,
    "fixed_s": 1e-3,
    "optimizer_s": 2e-3,
}
AT = "2026-12-05T00:00:00+00:00"


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """A 4-step single-process run printing every second step; (run folder, what it printed)."""
    monkeypatch.setenv("LLMSCALE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: dict(FAKE))
    folder = tmp_path / "run"
    overrides = short_job(
        job__run_dir=folder, train__steps=4, train__micro_batch_size=2,
        train__global_batch_size=2, metrics__log_every=2,
    )  # fmt: skip
    run_training(load_config(None, overrides))
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    return folder, printed


def test_the_record_renders_what_the_train_command_printed(run, tmp_path: Path) -> None:
    folder, printed = run
    rec = demo.record(folder, 12.34, (0.5, 0.75), ["cmd a", "cmd b"], AT)
    assert demo.transcript(rec) == printed  # every line: header, steps 2 and 4, table, folder
    assert sum(line.startswith("step ") for line in printed) == 2
    assert printed[-2].startswith("calibration: measured ")

    # The rows are results.json's: the step time's measured figure is the median after step 1.
    rows = {r["quantity"]: r for r in rec["demo"]["rows"]}
    metrics = [m for m in read_jsonl(folder / "metrics.jsonl") if m["kind"] == "train"]
    pred = json.loads((folder / "prediction.json").read_text())
    step = rows["step_time_s"]
    assert step["measured"] == statistics.median(m["step_time_s"] for m in metrics[1:])
    assert step["predicted"] == pred["step_time_s"]
    assert demo.step_ratio(rec) == pytest.approx(pred["step_time_s"] / step["measured"])
    assert rows["param_bytes"]["measured"] == metrics[-1]["param_bytes"]
    assert rows["param_bytes"]["ratio"] == 1.0  # byte-exact on the CPU
    assert rows[demo.WALL]["measured"] == 12.34 and rows[demo.WALL]["predicted"] is None
    assert "load average 0.50 at the start, 0.75 at the end" in rows[demo.WALL]["note"]
    assert [s["step"] for s in rec["demo"]["run"]["steps"]] == [2, 4]

    # Written and read back (as make docs reads it), it renders the same lines.
    out = tmp_path / "demo.json"
    demo.write(rec, out)
    assert demo.transcript(json.loads(out.read_text())) == printed


def test_the_record_says_the_load_while_training_next_to_the_calibrations(
    run, tmp_path: Path
) -> None:
    """A step time measured under other users' load next to a prediction from figures measured
    under another: the record keeps both loads, and the demo prints them in one line."""
    folder, _ = run
    assert demo.load_line(demo.record(folder, None, None, [], AT)) == ""  # not measured
    rec = demo.record(folder, 12.3, (1.0, 2.0), [], AT, train_load=2.345)
    assert rec["demo"]["run"]["training_other_load_cores"] == 2.345
    rec["demo"]["run"]["hardware"]["calibration"]["other_load_cores"] = 0.5
    assert demo.load_line(rec) == (
        "other processes used 2.35 cores while the run trained; "
        "0.50 on the cores the device's figures were measured on"
    )
    rec["demo"]["run"]["hardware"]["calibration"]["other_load_cores"] = math.nan  # unknown
    assert demo.load_line(rec) == "other processes used 2.35 cores while the run trained"
    # README's summary of the record says it too
    demo.write(rec, tmp_path / "results" / "demo.json")
    fit = docs.demo_fit(docs.Context(tmp_path / "results" / "results.json", measure=False))
    assert fit.endswith(
        f"step time predicted/measured {demo.step_ratio(rec):.2f} "
        "(other processes used 2.35 cores while the run trained)"
    )


def test_a_run_without_its_summary_is_not_recorded(run) -> None:
    folder, _ = run
    (folder / SUMMARY).unlink()
    with pytest.raises(FileNotFoundError, match="no summary of a finished run"):
        demo.record(folder, None, None, [], AT)


def test_the_demo_commands_are_the_makefiles_and_readmes() -> None:
    """One list of commands: the Makefile runs this module, README's plan block is its last."""
    root = Path(__file__).resolve().parents[2]
    make = (root / "Makefile").read_text()
    assert "$(PY) -m llmscale.bench.demo" in make
    train, plot, plan = demo.commands(root)
    assert train[:2] == ("torchrun", "--standalone") and "--overwrite" in train
    assert plot == ("llmscale", "plot", "runs/demo")
    assert plan[: len(demo.PLAN)] == demo.PLAN and plan[-1].startswith("runs/demo/")
    assert f"$ {' '.join(demo.PLAN)}\n" in (root / "README.md").read_text()


def test_make_demo_records_in_the_run_folder_and_demo_record_in_the_project(
    run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """make demo changes no tracked file: its record goes to the (git-ignored) run folder;
    make demo-record writes docs/results/demo.json, and only it renders README's blocks."""
    folder, _ = run
    checkout = demo.run_dir  # the commands' folder stays the checkout's runs/demo
    monkeypatch.setattr(
        demo, "run_dir", lambda root=None: folder if root is None else checkout(root)
    )
    project = demo.RECORD.read_bytes()
    assert demo.main(["--record-only"]) == 0
    rec = json.loads((folder / demo.RUN_RECORD).read_text())
    assert demo.transcript(rec)[-1] == f"run folder: {folder}"
    assert demo.RECORD.read_bytes() == project  # the checkout's record untouched
    assert f"recorded {folder / demo.RUN_RECORD}: step time predicted/measured " in (
        capsys.readouterr().out
    )
    assert demo.record_path(True) == demo.RECORD
    assert demo.record_path(False) == folder / demo.RUN_RECORD
    root = Path(__file__).resolve().parents[2]
    assert "/runs/" in (root / ".gitignore").read_text().splitlines()
    assert demo.run_dir(root).relative_to(root).parts[0] == "runs"
    # make demo-record: the project's record and README's loss curve come from the same run
    (folder / "loss.png").write_bytes(b"the run's plot")
    monkeypatch.setattr(demo, "RECORD", folder / "project" / "demo.json")
    monkeypatch.setattr(demo, "LOSS_IMAGE", folder / "project" / "demo-loss.png")
    assert demo.main(["--record-only", "--record"]) == 0
    assert (folder / "project" / "demo-loss.png").read_bytes() == b"the run's plot"
    assert json.loads((folder / "project" / "demo.json").read_text())["demo"]["rows"]
    make = (root / "Makefile").read_text()
    recipe = make.split("\ndemo: $(STAMP)\n", 1)[1].split("\n\n", 1)[0]
    assert recipe.strip() == "$(PY) -m llmscale.bench.demo"  # no --record, no make docs
    record = make.split("\ndemo-record: $(STAMP)\n", 1)[1].split("\n\n", 1)[0]
    assert "--record" in record and "llmscale.docs" in record
