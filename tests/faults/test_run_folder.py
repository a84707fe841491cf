"""Run folders: one run per folder, refused before any work unless told what to do (issue 13)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import one_line, run_cli, snapshot, train_args

import llmscale.train.run_dir as run_dir_mod
from llmscale.plan.checkpoint_size import checkpoint_bytes
from llmscale.train.checkpoint import Checkpointer
from llmscale.train.metrics import read_jsonl

CMD = "llmscale train --job.run_dir R --checkpoint.interval 1 --train.steps 2"


@pytest.fixture(scope="module")
def earlier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run: metrics of 2 steps, checkpoints at steps 1 and 2."""
    from llmscale.cli import main

    run = tmp_path_factory.mktemp("earlier") / "run"
    assert main(train_args(run)) == 0
    return run


def _copy(earlier: Path, tmp_path: Path) -> Path:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(earlier, run)
    return run


def test_rerun_into_an_old_folder_is_refused_and_touches_nothing(
    earlier, tmp_path, capsys, fault_row
) -> None:
    run = _copy(earlier, tmp_path)
    before = snapshot(run)
    t0 = time.perf_counter()
    rc, out, err = run_cli(capsys, train_args(run, steps=6))
    seconds = time.perf_counter() - t0
    line = one_line(err)
    assert rc == 2
    assert "--resume" in line and "--overwrite" in line and "metrics.jsonl" in line
    assert snapshot(run) == before  # nothing touched, no lock left
    assert not (run / ".lock").exists()
    assert seconds < 10  # refused before the model is built
    fault_row(
        fault="rerun into a folder holding an earlier run",
        command=f"{CMD} (twice)",
        expected="exit 2, one line naming --resume and --overwrite; nothing touched",
        observed=f"exit {rc}: {line}; files unchanged",
    )


def test_overwrite_starts_fresh_and_keeps_other_files(earlier, tmp_path, capsys, fault_row):
    run = _copy(earlier, tmp_path)
    (run / "notes.txt").write_text("mine")
    rc, out, err = run_cli(capsys, train_args(run, "--overwrite", steps=1, interval=0))
    assert rc == 0, err
    assert [s for s, _ in Checkpointer(run / "checkpoints").checkpoints()] == [1]
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == [1]
    assert (run / "notes.txt").read_text() == "mine"
    assert "--overwrite: removed" in err
    fault_row(
        fault="--overwrite into a folder holding an earlier run",
        command=f"{CMD} --overwrite",
        expected="exit 0; the earlier run's metrics and checkpoints replaced, other files kept",
        observed=f"exit {rc}; checkpoints {[s for s, _ in Checkpointer(run / 'checkpoints').checkpoints()]}"
        f", metrics steps {[r['step'] for r in rows]}, notes.txt kept",
        data_lost="the earlier run, as asked",
    )


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys, fault_row) -> None:
    rc, out, err = run_cli(capsys, train_args(tmp_path / "r", "--resume", "--overwrite"))
    line = one_line(err)
    assert rc == 2 and "--resume" in line and "--overwrite" in line
    assert not (tmp_path / "r").exists()
    fault_row(
        fault="--resume and --overwrite together",
        command=f"{CMD} --resume --overwrite",
        expected="exit 2, one line",
        observed=f"exit {rc}: {line}",
    )


def test_resume_without_a_checkpoint_starts_from_step_0(tmp_path, capsys, fault_row) -> None:
    run = tmp_path / "r"
    rc, out, err = run_cli(capsys, train_args(run, "--resume", steps=1, interval=0))
    assert rc == 0, err
    assert "no checkpoint" in err and "step 0" in err
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == [1]
    notice = next(x for x in err.splitlines() if "no checkpoint" in x)
    fault_row(
        fault="--resume with no checkpoint (e.g. a first start under automatic restarts)",
        command=f"{CMD} --resume (empty folder)",
        expected="exit 0, a notice, training from step 0",
        observed=f"exit {rc}: {notice}; trained steps {[r['step'] for r in rows]}",
    )


def _write_lock(run: Path, host: str, pid: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / ".lock").write_text(json.dumps({"host": host, "pid": pid, "started": "earlier"}))


def test_a_second_live_run_is_refused(tmp_path, capsys, fault_row) -> None:
    run = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _write_lock(run, socket.gethostname(), holder.pid)
        rc, out, err = run_cli(capsys, train_args(run, steps=2))
        line = one_line(err)
        assert rc == 2
        assert f"pid {holder.pid}" in line and socket.gethostname() in line
        assert json.loads((run / ".lock").read_text())["pid"] == holder.pid  # still theirs
        assert not (run / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # A holder on another host cannot be checked: refused too.
    _write_lock(run, "elsewhere.example", 12345)
    rc2, _, err2 = run_cli(capsys, train_args(run, steps=2))
    assert rc2 == 2 and "elsewhere.example" in err2
    fault_row(
        fault="two runs in the same folder at once",
        command=f"{CMD} & {CMD}",
        expected="the second refused: exit 2, naming the holder's host and pid",
        observed=f"exit {rc}: {line}",
    )


def test_a_stale_lock_is_taken_over(tmp_path, capsys, fault_row) -> None:
    run = tmp_path / "r"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    _write_lock(run, socket.gethostname(), gone.pid)
    rc, out, err = run_cli(capsys, train_args(run, steps=1, interval=0))
    assert rc == 0, err
    notice = next(x for x in err.splitlines() if "took over" in x)
    assert f"pid {gone.pid}" in notice
    assert not (run / ".lock").exists()  # released at the end
    fault_row(
        fault="a lock left by a killed run (holder dead)",
        command=f"kill -9 a run, then {CMD}",
        expected="taken over with a notice; the run proceeds; the lock released at the end",
        observed=f"exit {rc}: {notice}; lock removed at the end",
    )


def test_checkpoint_folder_that_is_a_file_is_refused_before_work(
    tmp_path, capsys, fault_row
) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "checkpoints").write_text("x")
    t0 = time.perf_counter()
    rc, out, err = run_cli(capsys, train_args(run, steps=2))
    seconds = time.perf_counter() - t0
    line = one_line(err)
    assert rc == 2 and "checkpoint.folder" in line and "is a file" in line
    assert seconds < 10 and not (run / "metrics.jsonl").exists() and not (run / ".lock").exists()
    fault_row(
        fault="RUN_DIR/checkpoints is a file",
        command=f"echo x > R/checkpoints; {CMD}",
        expected="exit 2 before any work, one line",
        observed=f"exit {rc} after {seconds:.1f} s: {line}",
    )


def test_run_folder_that_is_a_file_is_refused(tmp_path, capsys, fault_row) -> None:
    run = tmp_path / "r"
    run.write_text("x")
    rc, out, err = run_cli(capsys, train_args(run, steps=2))
    line = one_line(err)
    assert rc == 2 and "job.run_dir" in line and "is a file" in line
    under = tmp_path / "r" / "sub"
    rc2, _, err2 = run_cli(capsys, train_args(under, steps=2))
    assert rc2 == 2 and "is a file" in one_line(err2)
    fault_row(
        fault="job.run_dir is a file (or under one)",
        command=f"touch R; {CMD}",
        expected="exit 2 before any work, one line",
        observed=f"exit {rc}: {line}",
    )


def test_low_disk_space_is_refused_naming_the_bytes(
    tmp_path, capsys, monkeypatch, fault_row
) -> None:
    monkeypatch.setattr(run_dir_mod, "free_bytes", lambda path: 1_000_000)
    run = tmp_path / "r"
    rc, out, err = run_cli(capsys, train_args(run, steps=6, interval=2))
    line = one_line(err)
    assert rc == 2
    from llmscale.bench.jobs import short_job
    from llmscale.config import load_config

    cfg = load_config(None, short_job(checkpoint__enabled=True))
    need = 3 * checkpoint_bytes(cfg)  # saves at steps 2, 4, 6 (keep_last 3: all kept)
    assert f"{need} B needed" in line and "1000000 B free" in line
    assert not run.exists()
    fault_row(
        fault="not enough free disk for the checkpoints",
        command=f"{CMD} on a nearly full disk (free space faked)",
        expected="exit 2 before any work, naming the bytes needed and free",
        observed=f"exit {rc}: {line}",
    )


def test_metrics_file_that_is_a_folder_is_refused(tmp_path, capsys, fault_row) -> None:
    run = tmp_path / "r"
    (run / "metrics.jsonl").mkdir(parents=True)
    rc, out, err = run_cli(capsys, train_args(run, "--overwrite", steps=1))
    line = one_line(err)
    assert rc == 2 and "metrics.jsonl is a folder" in line
    assert (run / "metrics.jsonl").is_dir()  # not removed, even under --overwrite
    fault_row(
        fault="RUN_DIR/metrics.jsonl is a folder",
        command=f"mkdir -p R/metrics.jsonl; {CMD} --overwrite",
        expected="exit 2 before any work, one line; the folder left alone",
        observed=f"exit {rc}: {line}",
    )


def test_a_run_refused_by_its_data_leaves_no_folder(tmp_path, fault_row) -> None:
    """D02, D08, D11, D12, I06 of the usability sweep: refused after the run folder was claimed
    (the data and init_from are read by the trainer), they left an empty run folder. The folders
    the run created go again; one that was there before stays. A process, as a user runs it:
    the lock's release at exit is the backstop that removes them."""
    made = tmp_path / "new" / "run"
    there = tmp_path / "there"
    there.mkdir()
    for run in (made, there):
        p = subprocess.run(
            [sys.executable, "-m", "llmscale", "train", "--data.path", str(tmp_path),
             "--data.glob", "*.nothing", "--job.run_dir", str(run), "--train.steps", "1",
             "--metrics.progress", "false"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert p.returncode == 2, p.stdout + p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "data.glob: got '*.nothing'" in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["there"]  # new/ and new/run removed
    assert list(there.iterdir()) == []  # the user's empty folder kept, its .lock gone
    fault_row(
        fault="D11 and kin: a run refused by its data after its folder was created",
        command="llmscale train --data.glob '*.nothing' --job.run_dir NEW/run",
        expected="exit 2, one line; NEW/run and NEW removed again, an existing folder kept",
        observed=f"exit 2: {p.stderr.strip()[:90]}...; left: {sorted(x.name for x in tmp_path.iterdir())}",
    )
