"""README.md's prose figures (`docs_pages.py`): each renders from its record or the planner, and a
changed record or planner changes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmscale import docs, docs_pages
from llmscale.bench import startup
from llmscale.cli import main
from llmscale.model.config import get_preset

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "results" / startup.RECORD.name


def _ctx(tmp_path: Path, rec: dict | None) -> docs.Context:
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True, exist_ok=True)
    if rec is not None:
        (results / startup.RECORD.name).write_text(json.dumps(rec))
    return docs.Context(results / "results.json", measure=False)


def test_the_recorders_output_is_what_the_renderers_read(tmp_path: Path) -> None:
    """bench/startup.py's record, measured here with a 1 MiB shard, rendered by all three."""
    rec = startup.record(["--shard-mb", "1"], shard_mb=1)
    s = rec[startup.SUITE]
    assert s["verify"]["shard_bytes"] == 2**20 and s["calibration"]["model"] == "tiny"
    assert 0 < s["probe"]["median_pass_seconds"] < s["probe"]["seconds"]
    ctx = _ctx(tmp_path, rec)
    assert docs_pages.startup_calibration(ctx).startswith(f"{s['calibration']['seconds']:.1f} s ")
    assert (
        docs_pages.startup_probe(ctx) == f"{1e3 * s['probe']['seconds']:.0f} ms in the same record"
    )
    verify = docs_pages.startup_verify(ctx)
    assert verify.startswith(f"{s['verify']['first_seconds']:.2f} s for a 1 MiB shard")
    assert f"reads nothing: {1e3 * s['verify']['again_seconds']:.1f} ms" in verify


def test_a_doctored_startup_record_changes_the_blocks(tmp_path: Path) -> None:
    rec = json.loads(RECORD.read_text())
    s = rec[startup.SUITE]
    s["calibration"]["seconds"] = 12.34
    s["probe"]["seconds"] = 0.5
    s["verify"].update(first_seconds=1.234, again_seconds=0.0021, shard_bytes=64 * 2**20)
    s["load_average"] = [9.5, 1.25]
    ctx = _ctx(tmp_path, rec)
    assert docs_pages.startup_calibration(ctx).startswith("12.3 s at the demo's shape")
    assert "load average 9.50 at the start, 1.25 at the end" in docs_pages.startup_calibration(ctx)
    assert docs_pages.startup_probe(ctx) == "500 ms in the same record"
    verify = docs_pages.startup_verify(ctx)
    assert verify.startswith("1.23 s for a 64 MiB shard") and "nothing: 2.1 ms" in verify
    # Without the record: the command that measures it.
    bare = _ctx(tmp_path / "bare", None)
    assert docs_pages.startup_probe(bare) == f"not measured yet: `{docs_pages.STARTUP_COMMAND}`"


def test_make_docs_rewrites_a_block_whose_record_changed(tmp_path: Path) -> None:
    for f in ("README.md", "docs/results/results.json", f"docs/results/{RECORD.name}"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    rec = json.loads(RECORD.read_text())
    rec[startup.SUITE]["probe"]["seconds"] = 0.25
    (tmp_path / "docs" / "results" / RECORD.name).write_text(json.dumps(rec))
    only = ["startup-probe", "startup-verify"]
    assert docs.write(tmp_path, only=only) == ["README.md: startup-probe"]
    assert (
        "A fixed probe (<!-- generated: startup-probe (make docs) -->250 ms in the same record"
        in (tmp_path / "README.md").read_text()
    )


def test_the_memory_check_quote_is_the_commands_own(capsys: pytest.CaptureFixture[str]) -> None:
    """README quotes what `llmscale train --model.name llama2-70b` says on a CPU host."""
    import torch

    from llmscale.config import load_config
    from llmscale.train.memcheck import GIB, host_capacity, predicted_need

    cfg = load_config(None, ["--model.name", "llama2-70b"])
    need = predicted_need(cfg, torch.device("cpu"))[1]
    if host_capacity().total >= need:
        pytest.skip("this host holds llama2-70b's predicted bytes: no message to compare")
    assert main(["train", "--model.name", "llama2-70b", "--job.run_dir", "unused"]) == 2
    err = capsys.readouterr().err
    rendered = docs_pages.memcheck_need(docs.Context(measure=False))
    assert rendered == f"the planner predicts {need / GIB:.1f} GiB for llama2-70b"
    assert f"memory: {rendered} in this layout" in err and "it cannot fit" in err


def test_the_planner_blocks_follow_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = docs.Context(measure=False)
    # The small model's parameters without offload: 4 B each (fp32), all on the device.
    whole = 4 * get_preset("small").num_params() / 2**20
    assert docs_pages.params_window(ctx).endswith(f"of the small model's {whole:.2f} MiB in fp32")
    fit = docs_pages.korthikanti_fit(ctx)
    assert fit.startswith("which it reproduces to ") and float(fit.split()[4][:-1]) < 1.0

    from llmscale.plan import activations as act

    eq1 = act.korthikanti_bytes
    monkeypatch.setattr(act, "korthikanti_bytes", lambda *a: eq1(*a) * 1.25)
    doctored = docs_pages.korthikanti_fit(ctx)  # every case now 1/1.25 of eq. 1: 20% off
    assert doctored.endswith("% for a GPT-3 layer")
    assert float(doctored.split()[4][:-1]) == pytest.approx(20.0, abs=0.01)
    from llmscale.train import memcheck

    monkeypatch.setattr(memcheck, "predicted_need", lambda cfg, dev: (0.0, 2.5 * memcheck.GIB))
    assert docs_pages.memcheck_need(ctx) == "the planner predicts 2.5 GiB for llama2-70b"
