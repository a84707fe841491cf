"""Every command that reads a checkpoint reads it through one reader (issue 28): verified against
its manifest, a damaged newest checkpoint skipped for the newest intact one with a notice, and
one line (exit 2) when none is intact. The ids are the usability review's (2026-12-04)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from run_helpers import one_line, run_cli, train_args

from llmscale.train.checkpoint import MANIFEST, Checkpointer

SHARD = "__0_0.distcp"


def _flip_every_4096(path: Path) -> None:
    """The review's runs/flipped3: one byte XOR 0x40 every 4,096 bytes of the shard."""
    b = bytearray(path.read_bytes())
    for i in range(0, len(b), 4096):
        b[i] ^= 0x40
    path.write_bytes(bytes(b))


def _flip_optimizer_region(path: Path) -> None:
    """The review's runs/flipped2: 400 bytes XOR 0xFF past the weights (the optimizer's)."""
    b = bytearray(path.read_bytes())
    at = len(b) * 3 // 4
    b[at : at + 400] = bytes(x ^ 0xFF for x in b[at : at + 400])
    path.write_bytes(bytes(b))


def _notice(err: str) -> str:
    return next(x for x in err.splitlines() if "skipping damaged checkpoint" in x)


@pytest.mark.parametrize(
    ("case", "damage"),
    [("E09c", _flip_every_4096), ("E09a", _flip_optimizer_region)],
    ids=["E09c", "E09a"],
)
def test_export_skips_a_damaged_checkpoint(run, tmp_path, capsys, case, damage, fault_row) -> None:
    damage(run / "checkpoints" / "step-000002" / SHARD)
    out_dir = tmp_path / "hf"
    rc, out, err = run_cli(capsys, ["export", str(run), "--format", "hf", "--out", str(out_dir)])
    assert rc == 0, err
    notice = _notice(err)
    assert "step-000002" in notice and "checksum mismatch" in notice and "step-000001" in notice
    assert "exported step 1 " in out + err
    assert (out_dir / "config.json").is_file()
    what = "file-wide bit flips" if case == "E09c" else "400 flipped bytes (optimizer region)"
    fault_row(
        fault=f"{case}: export of a run whose newest checkpoint has {what}",
        command="llmscale export R --format hf --out DIR",
        expected="a notice naming the damaged checkpoint; exports the newest intact one",
        observed=f"exit {rc}: {notice}; exported step 1",
    )


GARBAGE = {
    "E07": ["export", "RUN", "--format", "hf", "--out", "OUT"],
    "G19": ["generate", "RUN", "--prompt", "def "],
    "EV09": ["eval", "RUN"],
}


@pytest.mark.parametrize("case", list(GARBAGE))
def test_a_garbage_checkpoint_is_one_line(run, tmp_path, capsys, case, fault_row) -> None:
    ck = run / "checkpoints"
    shutil.rmtree(ck)
    (ck / "step-000002").mkdir(parents=True)
    (ck / "step-000002" / SHARD).write_bytes(bytes(range(256)) * 40)
    (ck / "step-000002" / ".metadata").write_bytes(b"\x80\x04garbage" * 30)
    where = {"RUN": str(run), "OUT": str(tmp_path / "hf")}
    rc, out, err = run_cli(capsys, [where.get(a, a) for a in GARBAGE[case]])
    line = one_line(err)
    assert rc == 2
    assert "no intact checkpoint" in line and "step-000002 (no manifest.json)" in line
    assert not (tmp_path / "hf").exists()
    command = " ".join(GARBAGE[case]).replace("RUN", "R").replace("OUT", "DIR")
    fault_row(
        fault=f"{case}: {GARBAGE[case][0]} of a garbage checkpoint (random files, no manifest)",
        command=f"llmscale {command}",
        expected="exit 2, one line naming the checkpoint and why",
        observed=f"exit {rc}: {line}",
    )


def test_export_of_a_damaged_step_asked_for_is_one_line(run, tmp_path, capsys, fault_row) -> None:
    _flip_every_4096(run / "checkpoints" / "step-000002" / SHARD)
    rc, _, err = run_cli(
        capsys,
        ["export", str(run), "--step", "2", "--out", str(tmp_path / "hf")],
    )
    line = one_line(err)
    assert rc == 2 and "--step" in line and "step-000002 is damaged" in line
    fault_row(
        fault="E09c --step: export of the damaged step, asked for by number",
        command="llmscale export R --step 2 --out DIR",
        expected="exit 2, one line (no fallback to another step than the one asked for)",
        observed=f"exit {rc}: {line}",
    )


def test_generate_skips_a_damaged_checkpoint(run, capsys, fault_row) -> None:
    _flip_every_4096(run / "checkpoints" / "step-000002" / SHARD)
    args = ["generate", str(run), "--prompt", "def ", "--max-new-tokens", "3", "--temperature", "0"]
    rc, out, err = run_cli(capsys, args)
    assert rc == 0, err
    notice = _notice(err)
    assert "step-000002" in notice and "step-000001" in notice
    assert "step 1: 3 new tokens" in out + err
    fault_row(
        fault="G15c: generate from a run whose newest checkpoint is heavily damaged",
        command='llmscale generate R --prompt "def " --max-new-tokens 3 --temperature 0',
        expected="a notice naming it; generates from the newest intact checkpoint",
        observed=f"exit {rc}: {notice}; generated from step 1",
    )


def test_eval_skips_a_damaged_checkpoint(run, capsys, fault_row) -> None:
    _flip_every_4096(run / "checkpoints" / "step-000002" / SHARD)
    rc, out, err = run_cli(capsys, ["eval", str(run), "--json"])
    assert rc == 0, err
    notices = [x for x in err.splitlines() if "skipping damaged checkpoint" in x]
    assert len(notices) == 1 and "step-000002" in notices[0]  # once, not once per read
    result = json.loads(out)
    assert result["step"] == 1 and result["val_loss"] > 0
    fault_row(
        fault="EV07c: eval of a run whose newest checkpoint is heavily damaged",
        command="llmscale eval R",
        expected="a notice naming it; evaluates the newest intact checkpoint",
        observed=f"exit {rc}: {notices[0]}; step {result['step']}, "
        f"val_loss {result['val_loss']:.4f}",
    )


def test_init_from_skips_a_damaged_checkpoint(run, tmp_path, capsys, fault_row) -> None:
    _flip_every_4096(run / "checkpoints" / "step-000002" / SHARD)
    new = tmp_path / "new"
    rc, out, err = run_cli(capsys, train_args(new, "--checkpoint.init_from", str(run), steps=1))
    assert rc == 0, err
    notice = _notice(err)
    assert "step-000002" in notice and "using step-000001" in notice
    assert Checkpointer(new / "checkpoints").latest().step == 1
    fault_row(
        fault="I13c: --checkpoint.init_from a run whose newest checkpoint is heavily damaged",
        command="llmscale train --checkpoint.init_from R --job.run_dir NEW --train.steps 1",
        expected="a notice naming it; starts from the newest intact checkpoint's weights",
        observed=f"exit {rc}: {notice}",
    )


def test_a_manifest_listing_no_files_is_damaged(run, capsys, fault_row) -> None:
    path = run / "checkpoints" / "step-000002" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"] = {}
    path.write_text(json.dumps(manifest))
    rc_verify, out_verify, _ = run_cli(capsys, ["ckpt", "verify", str(run)])
    assert rc_verify == 1 and "manifest.json lists no files" in out_verify
    assert "1 intact, 1 damaged" in out_verify
    rc, out, err = run_cli(capsys, train_args(run, "--resume", steps=3))
    assert rc == 0, err
    assert "lists no files" in _notice(err) and "resumed from step 1" in out
    # A manifest that leaves out one file of its step does not describe it either.
    shard = run / "checkpoints" / "step-000003" / MANIFEST
    partial = json.loads(shard.read_text())
    del partial["files"][SHARD]
    shard.write_text(json.dumps(partial))
    rc_part, out_part, _ = run_cli(capsys, ["ckpt", "verify", str(run)])
    assert rc_part == 1 and f"{SHARD} not listed in manifest.json" in out_part
    fault_row(
        fault="H: a manifest rewritten to list no files (or to leave one out)",
        command="edit R/checkpoints/step-000002/manifest.json; llmscale ckpt verify R; "
        "llmscale train --job.run_dir R --resume --train.steps 3",
        expected="verify: damaged (exit 1); --resume skips it for the intact one",
        observed=f"verify exit {rc_verify} ('lists no files'), with a file left out exit "
        f"{rc_part}; --resume exit {rc}, resumed from step 1",
        data_lost="step 2 (retrained)",
    )
