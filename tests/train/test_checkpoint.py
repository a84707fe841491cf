"""Resume is exact; checkpoints are atomic and pruned."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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


# ---- manifest ------------------------------------------------------------------------------


def _save(folder: Path, step: int, keep_last: int = 5, **layout: int) -> Path:
    ck = Checkpointer(folder, keep_last, layout=layout or None)
    return ck.save(step, {"w": torch.arange(1000, dtype=torch.float32) * step, "step": step})


def test_manifest_lists_every_file_with_its_size_and_checksum(tmp_path) -> None:
    import hashlib

    from llmscale import __version__
    from llmscale.train.checkpoint import MANIFEST, read_manifest, verify_checkpoint

    path = _save(tmp_path, 7, dp_shard=2, world_size=2)
    assert path.name == "step-000007" and not list(tmp_path.glob("*.tmp"))
    m = read_manifest(path)
    assert m["step"] == 7 and m["llmscale_version"] == __version__
    assert m["layout"] == {"dp_shard": 2, "world_size": 2}
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    assert sorted(m["files"]) == on_disk and ".metadata" in on_disk
    for name, entry in m["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(path) is None


def test_verify_names_what_is_wrong(tmp_path) -> None:
    from llmscale.train.checkpoint import MANIFEST, verify_checkpoint

    path = _save(tmp_path, 1)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert verify_checkpoint(path) == f"{shard.name} corrupt: checksum mismatch"
    shard.write_bytes(data[:100])
    assert verify_checkpoint(path) == f"{shard.name} truncated: 100 of {len(data)} B"
    shard.unlink()
    assert verify_checkpoint(path) == f"{shard.name} missing"
    (path / MANIFEST).write_text("{not json")
    assert verify_checkpoint(path).startswith(f"{MANIFEST} unreadable")
    (path / MANIFEST).unlink()
    assert verify_checkpoint(path) == f"no {MANIFEST}"


def test_latest_is_the_newest_intact_and_select_names_the_damaged(tmp_path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (tmp_path / "step-000003" / "manifest.json").unlink()
    ck = Checkpointer(tmp_path)
    sel = ck.select()
    assert sel.chosen.step == 2
    assert [(d.step, d.problem) for d in sel.damaged] == [(3, "no manifest.json")]


def test_prune_keeps_the_current_step_before_higher_ones_of_another_history(tmp_path) -> None:
    for step in (2, 4, 50):
        _save(tmp_path, step)
    ck = Checkpointer(tmp_path, keep_last=2)
    ck.save(6, {"w": torch.zeros(3)})
    # 50 belongs to another history: it goes first; the run's own 6 and 4 stay.
    assert [s for s, _ in ck.checkpoints()] == [4, 6]
    ck1 = Checkpointer(tmp_path, keep_last=1)
    ck1.save(5, {"w": torch.zeros(3)})  # lower than the others: still kept
    assert [s for s, _ in ck1.checkpoints()] == [5]


def test_resaving_a_step_replaces_it_whole(tmp_path) -> None:
    from llmscale.train.checkpoint import verify_checkpoint

    _save(tmp_path, 3)
    path = _save(tmp_path, 3)
    assert verify_checkpoint(path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"]


@pytest.mark.parametrize(
    "extra",
    [(), ("--optimizer.offload", "optimizer", "--precision.mode", "bf16")],
    ids=["fp32", "offload-bf16"],
)
def test_predicted_checkpoint_bytes_match_a_real_checkpoint(cfg_factory, extra) -> None:
    """plan/checkpoint_size.py against the files a tiny run writes: within 3%. The two jobs
    hold different states (offload: bf16 model entries, an fp32 master, fewer group keys)."""
    from llmscale.plan.checkpoint_size import checkpoint_bytes

    cfg = cfg_factory(*extra, "--checkpoint.enabled", "true", "--train.steps", "1")
    t = Trainer(cfg)
    t.fit()
    (path,) = [p for _, p in t.checkpointer.checkpoints()]
    measured = sum(p.stat().st_size for p in path.iterdir())
    predicted = checkpoint_bytes(cfg)
    assert abs(predicted / measured - 1) < 0.03, (predicted, measured)
