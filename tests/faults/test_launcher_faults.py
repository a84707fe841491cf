"""Launcher faults of the review (../shared/reviews/faults-2026-12-04.md, A, B, C and the orphans
of t14), each on the job of launch_helpers (tiny model, 6 steps, a checkpoint every 2), through
`llmscale train --nproc-per-node N` as a user runs it:

- A: a `kill -9`'d rank of a 4-rank job is named alone (was "ranks 0, 2, 3 of 4", 15 s late);
- B: `--max-restarts` without `--resume`: the restarted attempt resumes its own run;
- C: one SIGINT delivered to the launcher and its workers together: one checkpoint, exit 130;
- orphans: the workers of a `kill -9`'d launcher stop after a checkpoint, not train on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from launch_helpers import JOB, job_env, llmscale_cmd, losses, reference, run, wait_for, workers

from llmscale.train.metrics import read_jsonl


def start(run_dir: Path, *extra: str, **env: str) -> subprocess.Popen[str]:
    cmd = llmscale_cmd("train", "--nproc-per-node", "2", *JOB, "--job.run_dir", str(run_dir),
                       *extra)  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env(**env),
        start_new_session=True,
    )  # fmt: skip


def wait_rows(run_dir: Path, n: int, proc: subprocess.Popen[str], timeout: float = 200) -> None:
    """Until metrics.jsonl holds `n` training rows (the job is in step n + 1)."""

    def enough() -> bool:
        assert proc.poll() is None, proc.communicate()
        try:
            rows = read_jsonl(run_dir / "metrics.jsonl")
        except (OSError, ValueError):
            return False
        return sum(r.get("kind") == "train" for r in rows) >= n

    assert wait_for(enough, timeout, every=0.1) is not None


def checkpoints(run_dir: Path) -> list[int]:
    return sorted(
        int(p.name.split("-")[1])
        for p in (run_dir / "checkpoints").glob("step-*")
        if not p.name.endswith(".tmp")
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_rank_of_four_is_named_alone(tmp_path, fault_row) -> None:
    run_dir = tmp_path / "run"
    timeout = 30
    cmd = llmscale_cmd("train", "--nproc-per-node", "4", *JOB, "--parallel.dp_shard", "2",
                       "--parallel.tp", "2", "--comm.timeout_seconds", str(timeout),
                       "--job.run_dir", str(run_dir))  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(LLMSCALE_FAULT="kill:2:3"))  # fmt: skip
    # The fault fires right after step 3's row: time from that row to the command's exit.
    wait_rows(run_dir, 3, proc, timeout=300)
    t_row = time.monotonic()
    out, err = proc.communicate(timeout=300)
    took = time.monotonic() - t_row
    named = [ln for ln in err.splitlines() if "died" in ln or "stopped answering" in ln]
    fault_row(
        fault="A: kill -9 of rank 2 of a 4-rank job (dp_shard 2 x tp 2)",
        command="LLMSCALE_FAULT=kill:2:3 llmscale train --nproc-per-node 4 --parallel.dp_shard 2 "
        f"--parallel.tp 2 --comm.timeout_seconds {timeout} ...",
        expected=f"rank 2 named alone, exit 4, within comm.timeout_seconds ({timeout} s) + a few",
        observed=f"exit {proc.returncode} after {took:.1f} s: {' | '.join(named)}",
    )
    assert proc.returncode == 4, err[-3000:]
    assert named == [
        "llmscale train: rank 2 of the job died (SIGKILL); the job stopped. Restart it with "
        "--resume to continue from the last checkpoint"
    ], err[-3000:]
    assert took < timeout + 5
    assert checkpoints(run_dir) == [2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_b_max_restarts_without_resume_resumes_its_own_run(tmp_path, fault_row) -> None:
    run_dir = tmp_path / "run"
    cmd = llmscale_cmd("train", "--nproc-per-node", "2", "--max-restarts", "1", *JOB,
                       "--job.run_dir", str(run_dir))  # fmt: skip
    r = run(cmd, timeout=300, LLMSCALE_FAULT="kill:1:5")
    got = losses(run_dir)
    _, want = reference()
    notice = [ln for ln in r.stderr.splitlines() if "--max-restarts" in ln]
    fault_row(
        fault="B: rank 1 killed after step 5, --max-restarts 1 without --resume",
        command="LLMSCALE_FAULT=kill:1:5 llmscale train --nproc-per-node 2 --max-restarts 1 ...",
        expected="the restarted attempt resumes its own run from step 4 (not refused as a rerun);"
        " losses equal an uninterrupted run's bit for bit",
        observed=f"exit {r.returncode}; {notice[0] if notice else 'no notice'}; final loss "
        f"{got.train[-1] if got.train else None!r} vs {want.train[-1]!r}",
        data_lost="none" if got.train == want.train else "the run",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert notice == [f"attempt 2 of this job (--max-restarts): resuming its run in {run_dir}"]
    assert "resumed from step 4" in r.stdout
    assert got.train == want.train and got.val == want.val


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_c_one_sigint_to_the_launcher_and_its_workers(tmp_path, fault_row) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_rows(run_dir, 3, proc)
    pids = [proc.pid, *workers(proc.pid).values()]
    assert len(pids) == 3
    # As a scheduler, or a terminal's process group, delivers it: to every process. The workers
    # first and the launcher a little later, so that the launcher's forwarded copy reaches each
    # worker after it handled its own (two signals pending at once would merge into one).
    for pid in pids[1:]:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    last = rows[-1]["step"]
    stopped = [ln for ln in err.splitlines() if "stopped by SIGINT" in ln]
    fault_row(
        fault="C: one SIGINT to the launcher and both workers at once, in step 4",
        command="kill -INT LAUNCHER WORKER0 WORKER1",
        expected="one checkpoint at the step it stopped after, exit 130, no traceback",
        observed=f"exit {proc.returncode}: {stopped[0] if stopped else err.strip()[-300:]}; "
        f"checkpoints {checkpoints(run_dir)}",
        data_lost="none" if last in checkpoints(run_dir) else f"steps after {checkpoints(run_dir)}",
    )
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "stopped answering" not in err and len(stopped) == 1, err[-3000:]
    assert last < 6 and last in checkpoints(run_dir)
    assert stopped[0].endswith(f"checkpoint written to {run_dir / 'checkpoints'}/step-"
                               f"{last:06d}, resume with --resume")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_orphans_workers_stop_when_their_launcher_is_killed(tmp_path, fault_row) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_rows(run_dir, 3, proc)
    pids = list(workers(proc.pid).values())
    assert len(pids) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def gone() -> bool:
        return all(not Path(f"/proc/{p}").exists() or _zombie(p) for p in pids)

    t0 = time.monotonic()
    ended = wait_for(gone, 120, every=0.2)
    _, err = proc.communicate(timeout=30)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    last = rows[-1]["step"]
    fault_row(
        fault="orphans (t14): kill -9 of the --nproc-per-node launcher in step 4",
        command="kill -9 LAUNCHER",
        expected="the workers stop after a checkpoint of the step they were in (parent-death "
        "signal: SIGTERM), not train on",
        observed=f"workers gone after {(ended or t0) - t0:.1f} s at step {last}; checkpoints "
        f"{checkpoints(run_dir)}",
        data_lost="none" if last in checkpoints(run_dir) else "the steps after the last save",
    )
    assert ended is not None, "workers still running"
    assert last < 6 and last in checkpoints(run_dir), (last, checkpoints(run_dir), err[-2000:])
    assert not (run_dir / ".lock").exists()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
