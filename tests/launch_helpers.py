"""Multi-process jobs for the fault, restart, multi-node and launcher tests.

Every job is the same short one (tiny preset, sequences of 32 tokens, 6 steps of a global batch
of 8 in micro-batches of 2, FSDP over 2 ranks, a checkpoint every 2 steps), so that its
uninterrupted 2-process run, `reference()`, is trained once per test session and every test
compares with it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from llmscale.bench.jobs import short_job
from llmscale.train.metrics import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
JOB = short_job(
    parallel__dp_shard=2,
    train__micro_batch_size=2,
    train__global_batch_size=8,
    train__steps=STEPS,
    train__eval_sequences=8,
    checkpoint__enabled=True,
    checkpoint__interval=2,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.pop("LLMSCALE_FAULT", None)
    env.update(extra)
    return env


def llmscale_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmscale", *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run(cmd: list[str], timeout: float = 150, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, env=job_env(**env), timeout=timeout, cwd=ROOT
    )


@dataclass
class Losses:
    train: list[float]
    val: float | None


def losses(run_dir: Path) -> Losses:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r["loss"] for r in rows if r.get("kind") == "train"]
    val = [r["val_loss"] for r in rows if r.get("kind") == "eval"]
    return Losses(train, val[-1] if val else None)


@functools.cache
def reference() -> tuple[subprocess.CompletedProcess[str], Losses]:
    """The job, uninterrupted, as 2 local workers (`llmscale train --nproc-per-node 2`)."""
    run_dir = Path(tempfile.mkdtemp(prefix="llmscale-reference-"))
    r = run(llmscale_cmd("train", "--nproc-per-node", "2", *JOB, "--job.run_dir", str(run_dir)))
    assert r.returncode == 0, f"reference run failed ({r.returncode}):\n{r.stderr[-4000:]}"
    return r, losses(run_dir)


# ---- the processes of a running job (for SIGSTOP/SIGKILL from outside) ----------------------


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def worker_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def workers(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the workers a launcher started (its children that have a RANK)."""
    out = {}
    for pid in children(launcher_pid):
        rank = worker_rank(pid)
        if rank is not None:
            out[rank] = pid
    return out


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T for stopped, Z...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def wait_for(predicate, timeout: float, every: float = 0.05) -> float | None:  # type: ignore[no-untyped-def]
    """Poll until `predicate()` is true; the monotonic time it became so, None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(every)
    return None


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
