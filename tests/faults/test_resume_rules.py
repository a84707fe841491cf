"""What a run may write and what a resume continues (issue 28): checkpoint folders a run owns,
resumes refused when the model or train.steps does not continue the checkpoint, a precision
change logged, and metrics.jsonl repaired rather than rewritten. Ids: the usability review's
(K09, K10, K12, T37b, DS12) and the fault review's (D, E, F) of 2026-12-04."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from run_helpers import one_line, run_cli, snapshot, train_args

import llmscale.train.trainer as trainer_mod
from llmscale.errors import JobStopped
from llmscale.train.checkpoint import Checkpointer
from llmscale.train.metrics import JsonlWriter, read_jsonl, truncate_after

CMD = "llmscale train --job.run_dir R --checkpoint.interval 1 --resume"


SHAPES = {
    "K09": (("--model.dim", "128"), "wider (dim 64 -> 128)", "model.dim"),
    "F": (("--model.n_layers", "2"), "shallower (4 layers -> 2)", "model.n_layers"),
    "F-deeper": (("--model.n_layers", "6"), "deeper (4 layers -> 6)", "model.n_layers"),
    "F-heads": (
        ("--model.n_heads", "8", "--model.n_kv_heads", "4"),
        "the heads re-split (same weight shapes)",
        "model",
    ),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_resume_with_another_model_shape_is_refused(run, capsys, case, fault_row) -> None:
    flags, what, field = SHAPES[case]
    before = snapshot(run)
    rc, out, err = run_cli(capsys, train_args(run, "--resume", *flags, steps=4))
    line = one_line(err)
    assert rc == 2
    assert f"error: {field}" in line and "step-000002" in line
    assert snapshot(run) == before  # nothing pruned, nothing written, no lock left
    assert [s for s, _ in Checkpointer(run / "checkpoints").checkpoints()] == [1, 2]
    fault_row(
        fault=f"{case}: --resume with the model {what}",
        command=f"{CMD} --train.steps 4 {' '.join(flags)}",
        expected="exit 2, one line naming the model key; the checkpoints untouched",
        observed=f"exit {rc}: {line}; checkpoints 1, 2 and every file unchanged",
    )


def test_resume_of_an_old_checkpoint_with_another_shape_compares_weights(
    run, capsys, fault_row
) -> None:
    """A checkpoint whose manifest predates the model record: its weights' shapes decide."""
    for step in (1, 2):
        path = run / "checkpoints" / f"step-{step:06d}" / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest["model"], manifest["precision"]
        path.write_text(json.dumps(manifest))
    before = snapshot(run)
    rc, _, err = run_cli(capsys, train_args(run, "--resume", "--model.n_layers", "2", steps=4))
    line = one_line(err)
    assert rc == 2 and "18 weights this model lacks" in line and "layers.2." in line
    assert snapshot(run) == before
    fault_row(
        fault="F (old manifest): --resume --model.n_layers 2 on a checkpoint without a model "
        "record",
        command=f"{CMD} --train.steps 4 --model.n_layers 2",
        expected="exit 2, one line naming the weights the model lacks; nothing pruned",
        observed=f"exit {rc}: {line}",
    )


def test_resume_with_steps_at_or_below_the_checkpoint_is_refused(
    run, capsys, monkeypatch, fault_row
) -> None:
    before = snapshot(run)
    results = []
    for steps in (1, 2):
        rc, out, err = run_cli(capsys, train_args(run, "--resume", steps=steps))
        results.append((rc, one_line(err)))
    assert all(rc == 2 and "train.steps" in line and "step-000002" in line for rc, line in results)
    assert snapshot(run) == before
    # A restarted attempt (--max-restarts) of a job that wrote its last checkpoint: done, exit 0.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    rc_restart, out_restart, err_restart = run_cli(capsys, train_args(run, "--resume", steps=2))
    assert rc_restart == 0, err_restart
    assert "resumed from step 2" in out_restart
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"] == [
        1,
        2,
    ]
    fault_row(
        fault="K10: --resume with train.steps below (and at) the checkpoint's step 2",
        command=f"{CMD} --train.steps 1 (and 2)",
        expected="exit 2, one line: nothing to train",
        observed=f"exit {results[0][0]}: {results[0][1]}; a restarted attempt at step 2 of 2: "
        f"exit {rc_restart}, nothing trained",
    )


def test_fp32_checkpoint_resumed_as_fp16_starts_at_initial_scale(run, capsys, fault_row) -> None:
    flags = ("--precision.mode", "fp16", "--precision.initial_scale", "1024")
    rc, out, err = run_cli(capsys, train_args(run, "--resume", *flags, steps=3))
    assert rc == 0, err
    notice = next(x for x in err.splitlines() if x.startswith("precision:"))
    assert "fp32" in notice and "fp16" in notice and "initial_scale = 1024" in notice
    row = next(r for r in read_jsonl(run / "metrics.jsonl") if r.get("step") == 3)
    assert row["loss_scale"] == 1024.0  # not the 1.0 the fp32 run kept, clamped to min_scale 8
    fault_row(
        fault="K12: an fp32 checkpoint resumed with --precision.mode fp16",
        command=f"{CMD} --train.steps 3 --precision.mode fp16 --precision.initial_scale 1024",
        expected="a logged conversion; the loss scale starts at initial_scale",
        observed=f"exit {rc}: {notice}; step 3 ran at scale {row['loss_scale']:g}",
    )


def test_another_runs_checkpoint_folder_is_refused(run, tmp_path, capsys, fault_row) -> None:
    before = snapshot(run)
    other = tmp_path / "other"
    rc, out, err = run_cli(
        capsys,
        train_args(
            other,
            "--checkpoint.folder",
            "../run/checkpoints",
            "--checkpoint.keep_last",
            "1",
            steps=3,
        ),
    )
    line = one_line(err)
    assert rc == 2 and "checkpoint.folder" in line and "step-000002" in line
    assert snapshot(run) == before  # its newest checkpoint is still there
    assert not other.exists()
    # A new folder outside the run folder is created, marked and used; a second run is refused.
    rc_new, _, err_new = run_cli(
        capsys, train_args(other, "--checkpoint.folder", "../ext", steps=1)
    )
    assert rc_new == 0, err_new
    # T37: said, not silent
    ext = (tmp_path / "ext").resolve()
    assert f"checkpoint.folder {ext} is outside the run folder: marked as this run's" in err_new
    assert json.loads((tmp_path / "ext" / ".llmscale-owner").read_text())["run_dir"] == str(
        other.resolve()
    )
    rc_third, _, err_third = run_cli(
        capsys, train_args(tmp_path / "third", "--checkpoint.folder", "../ext", steps=1)
    )
    assert rc_third == 2 and f"files of the run {other.resolve()}" in one_line(err_third)
    fault_row(
        fault="T37b: --checkpoint.folder pointing at another run's checkpoints",
        command="llmscale train --job.run_dir NEW --checkpoint.folder ../R/checkpoints "
        "--checkpoint.keep_last 1 --train.steps 3",
        expected="exit 2, one line; the other run's checkpoints untouched",
        observed=f"exit {rc}: {line}; R unchanged; a new outside folder: exit {rc_new}, "
        f"then another run into it: exit {rc_third}",
    )


def test_a_run_that_crashed_before_its_first_step_does_not_block_a_rerun(
    tmp_path, capsys, monkeypatch, fault_row
) -> None:
    """DS12 and DS20b crashed at step 1 (ids >= vocab); their folders held config.toml,
    prediction.json and an empty metrics.jsonl, which refused the rerun."""
    run = tmp_path / "run"

    def crash(self):
        raise IndexError("index out of range in self")

    with monkeypatch.context() as m:
        m.setattr(trainer_mod.Trainer, "train_step", crash)
        with pytest.raises(IndexError):
            run_cli(capsys, train_args(run, steps=1))
    left = sorted(p.name for p in run.iterdir())
    assert (run / "metrics.jsonl").stat().st_size == 0
    rc, out, err = run_cli(capsys, train_args(run, steps=1))
    assert rc == 0, err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"] == [1]
    fault_row(
        fault="DS12/DS20b: rerun after a run crashed before its first step",
        command="llmscale train --job.run_dir R (crashes at step 1); the same again",
        expected="the rerun starts (nothing of the crashed run to keep)",
        observed=f"the crash left {left}; rerun exit {rc}, trained step 1",
    )


def test_torn_last_metrics_line_is_dropped_with_a_notice(run, capsys, fault_row) -> None:
    metrics = run / "metrics.jsonl"
    rows_before = read_jsonl(metrics)
    with metrics.open("ab") as f:
        f.write(b'{"lr": 0.0006, "grad_norm": 3.2, "step": 3, "lo')  # a full disk's torn row
    rc, out, err = run_cli(capsys, train_args(run, "--resume", steps=3))
    assert rc == 0, err
    notice = next(x for x in err.splitlines() if "torn last line" in x)
    rows = read_jsonl(metrics)  # every line parses
    assert rows[: len(rows_before)] == rows_before
    assert [r["step"] for r in rows if r.get("kind") == "train"] == [1, 2, 3]
    fault_row(
        fault="D: metrics.jsonl with a torn last line (full disk, host crash), then --resume",
        command=f"append half a row to R/metrics.jsonl; {CMD} --train.steps 3",
        expected="the torn line dropped with a notice; resumes",
        observed=f"exit {rc}: {notice}; rows of steps 1-3, all parse",
    )


def test_a_failed_metrics_write_is_one_line(tmp_path, fault_row) -> None:
    writer = JsonlWriter(tmp_path / "metrics.jsonl")

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    writer._fh = FullDisk()
    with pytest.raises(JobStopped) as stopped:
        writer.write({"step": 1, "loss": 5.0})
    writer.close()  # the buffered bytes fail again: not a second error
    message = str(stopped.value)
    assert "No space left on device" in message and "--resume" in message
    assert stopped.value.code == 1
    fault_row(
        fault="D (write): a metrics row written to a full disk",
        command="llmscale train (metrics.jsonl's write fails ENOSPC)",
        expected="exit 1, one line; the checkpoints kept",
        observed=f"JobStopped (exit {int(stopped.value.code)}): {message}",
    )


def test_resume_cuts_metrics_without_rewriting_them(tmp_path, monkeypatch, fault_row) -> None:
    """Fault E: the resume rewrote metrics.jsonl in place (truncate, then write), and a kill in
    between left it empty. Now only its tail is cut: the file is never opened for writing from
    the start, and the bytes it keeps are never written again."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "loss": 5.0 - s / 1e4} for s in range(1, 20001)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text)
    inode = path.stat().st_ino
    keep = text[: text.index('"step": 15001,') - len('{"kind": "train", ')]
    real_open = Path.open

    def guarded_open(self, mode="r", *args, **kwargs):
        assert "w" not in mode or self != path, f"{self} opened with {mode!r}"
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", guarded_open)
    monkeypatch.setattr(Path, "write_text", lambda *a, **k: pytest.fail("rewritten"))
    truncate_after(path, 15000)
    monkeypatch.undo()
    assert path.stat().st_ino == inode
    assert path.read_text() == keep
    assert read_jsonl(path)[-1]["step"] == 15000
    fault_row(
        fault="E: --resume trims metrics.jsonl (20,000 rows, resumed from 15,000)",
        command=f"{CMD} on a long run",
        expected="the rows after the checkpoint cut off; the file never emptied, even for a moment",
        observed=f"one truncate: {len(keep)} B kept byte for byte (15,000 rows), same inode",
    )


def test_resume_without_a_checkpoint_keeps_the_earlier_metrics(tmp_path, capsys, fault_row) -> None:
    """f11: --resume on a folder whose earlier run wrote no checkpoint starts from step 0 and
    keeps that run's rows (renamed metrics-earlier-1.jsonl), with the notice naming them."""
    run = tmp_path / "run"
    assert main_args(train_args(run, "--checkpoint.enabled", "false", steps=3)) == 0
    earlier_rows = (run / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 3]  # and eval
    rc, _, err = run_cli(
        capsys, train_args(run, "--checkpoint.enabled", "false", "--resume", steps=2)
    )
    assert rc == 0
    assert "starting from step 0; the earlier metrics.jsonl kept as metrics-earlier-1.jsonl" in err
    assert (run / "metrics-earlier-1.jsonl").read_bytes() == earlier_rows
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 2]
    # A second resume keeps both earlier files; --overwrite removes them with the run's own.
    rc, _, err = run_cli(
        capsys, train_args(run, "--checkpoint.enabled", "false", "--resume", steps=2)
    )
    assert rc == 0 and "kept as metrics-earlier-2.jsonl" in err
    assert (run / "metrics-earlier-1.jsonl").read_bytes() == earlier_rows
    rc, _, _ = run_cli(capsys, train_args(run, "--checkpoint.enabled", "false", "--overwrite"))
    assert rc == 0 and not list(run.glob("metrics-earlier-*"))
    fault_row(
        fault="f11: --resume on a folder whose earlier run wrote no checkpoint (3 steps)",
        command="llmscale train --job.run_dir R --checkpoint.enabled false --resume",
        expected="starts from step 0 with a notice; the earlier rows kept",
        observed="notice names metrics-earlier-1.jsonl, which holds the 4 earlier rows "
        "byte for byte; a second resume keeps it and writes metrics-earlier-2.jsonl",
    )


def main_args(args: list[str]) -> int:
    from llmscale.cli import main

    return main(args)
