"""Resume is exact; checkpoints are atomic and pruned."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from llmscale.train.checkpoint import Checkpointer
from llmscale.train.metrics import read_jsonl
from llmscale.train.trainer import Trainer

CKPT = ("--checkpoint.enabled", "true", "--train.steps", "10")


def _losses(run_dir: Path) -> list[float]:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["loss"] for r in rows]


def test_interrupted_and_resumed_run_equals_uninterrupted_bitwise(cfg_factory) -> None:
    common = (*CKPT, "--train.micro_batch_size", "2")  # accumulation in play too
    full = Trainer(cfg_factory(*common, run="full"))
    full.fit()
    first = Trainer(cfg_factory(*common, "--checkpoint.stop_after", "5", run="resumed"))
    r1 = first.fit()
    assert r1.interrupted and r1.steps_done == 5
    second = Trainer(cfg_factory(*common, "--checkpoint.resume", "true", run="resumed"))
    r2 = second.fit()
    assert r2.steps_done == 10 and len(r2.losses) == 5
    assert _losses(full.run_dir) == _losses(second.run_dir)  # all 10, bitwise
    for a, b in zip(full.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_keep_last_and_tmp_folders_ignored(cfg_factory) -> None:
    t = Trainer(cfg_factory(*CKPT, "--checkpoint.interval", "2", "--checkpoint.keep_last", "2"))
    t.fit()
    ck = Checkpointer(t.run_dir / "checkpoints")
    assert [s for s, _ in ck.checkpoints()] == [8, 10]
    # A half-written save (killed mid-write) is never picked up.
    partial = t.run_dir / "checkpoints" / "step-000012.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"garbage")
    assert ck.latest()[0] == 10
    # A folder without DCP metadata is not a checkpoint either.
    (t.run_dir / "checkpoints" / "step-000014").mkdir()
    assert ck.latest()[0] == 10


def test_killed_process_resumes_from_last_complete_checkpoint(tmp_path) -> None:
    """SIGKILL a real run mid-training; resuming reproduces the uninterrupted loss curve."""
    args = [
        sys.executable, "-m", "llmscale", "train",
        "--data.max_files", "40", "--data.seq_len", "32",
        "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
        "--train.steps", "12", "--checkpoint.interval", "1",
        "--metrics.progress", "false",
    ]  # fmt: skip
    ref = tmp_path / "ref"
    subprocess.run([*args, "--job.run_dir", str(ref)], check=True, capture_output=True)
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        [*args, "--job.run_dir", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    metrics = run / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert 5 <= max(done) < 12, done
    subprocess.run([*args, "--job.run_dir", str(run), "--resume"], check=True, capture_output=True)
    assert _losses(run) == _losses(ref)


def test_sigterm_finishes_the_step_and_writes_a_checkpoint(tmp_path) -> None:
    args = [
        sys.executable, "-m", "llmscale", "train", "--job.run_dir", str(tmp_path / "r"),
        "--data.max_files", "40", "--data.seq_len", "32", "--train.steps", "100000",
        "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
        "--metrics.progress", "false",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (
        metrics.exists() and metrics.read_text().count("\n") >= 2
    ):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143  # ExitCode.SIGTERM
    latest = Checkpointer(tmp_path / "r" / "checkpoints").latest()
    assert latest is not None
    assert latest[0] == max(r["step"] for r in read_jsonl(metrics))
    assert f"after step {latest[0]};" in err and "resume with --resume" in err
