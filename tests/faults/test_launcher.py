"""The launcher (`llmscale train --nproc-per-node N`) refuses bad input in one process, as one
line with exit code 2, before any worker starts (so no worker prints, and no torchrun traceback).
"""

import subprocess
import sys

import pytest

FAST = ["--data.max_files", "20", "--train.steps", "1", "--metrics.progress", "false"]


def _run(args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "llmscale", *args], capture_output=True, text=True, cwd=tmp_path
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--parallel.dp_shard", "4", "--train.global_batch_size", "16"],
            "degrees whose product equals the world size 2",
        ),
        (
            ["--model.name", "llama3-405b", "--parallel.dp_shard", "2", "--data.seq_len", "64"],
            "memory: the planner predicts",
        ),
        (["--max-restarts", "-1"], "--max-restarts: got -1"),
    ],
)
def test_launcher_refuses_bad_input_before_any_worker_starts(
    args, needle, tmp_path, fault_row
) -> None:
    argv = ["train", "--nproc-per-node", "2", *FAST, "--train.micro_batch_size", "4", *args]
    r = _run(argv, tmp_path)
    fault_row(
        fault=f"bad input to the launcher ({' '.join(args)})",
        command="llmscale " + " ".join(argv),
        expected="one line, exit 2, no worker started",
        observed=f"exit {r.returncode}: {r.stderr.strip()[:160]}",
    )
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stdout == ""  # no worker printed its banner
