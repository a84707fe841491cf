"""Restarts: `torchrun --max-restarts 1 ... llmscale train --resume` recovers from a killed rank.

Rank 1 kills itself (SIGKILL, `LLMSCALE_FAULT=kill:1:4`) after step 4's checkpoint on the first
attempt; the agent restarts both workers, which rendezvous again (a store prefix per attempt:
parallel/dims.py `rendezvous_store`), resume from step 4 and finish. The losses equal an
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import pytest
from launch_helpers import JOB, free_port, losses, reference, run, torchrun_cmd


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_max_restarts_recovers_a_killed_rank(tmp_path, fault_row) -> None:
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd(
        "--nproc-per-node", "2", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}",
        "-m", "llmscale", "train", *JOB, "--job.run_dir", str(run_dir), "--resume",
    )  # fmt: skip
    r = run(cmd, timeout=240, LLMSCALE_FAULT="kill:1:4")
    got = losses(run_dir)
    _, want = reference()
    resumed = [ln for ln in r.stdout.splitlines() if "resumed from step" in ln]
    fault_row(
        fault="a rank is killed (SIGKILL) after a checkpoint, under torchrun --max-restarts 1",
        command="LLMSCALE_FAULT=kill:1:4 torchrun --nproc-per-node 2 --max-restarts 1 "
        "-m llmscale train --checkpoint.interval 2 --resume ...",
        expected="the restarted workers resume from step 4; final losses equal an "
        "uninterrupted run's bit for bit",
        observed=f"exit {r.returncode}; {resumed[0] if resumed else 'no resume'}; final loss "
        f"{got.train[-1] if got.train else None!r} vs {want.train[-1]!r}, validation "
        f"{got.val!r} vs {want.val!r}",
        data_lost="none" if got.train == want.train else "the steps after the kill",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert resumed and resumed[0].strip().startswith("resumed from step 4"), r.stdout[-3000:]
    assert got.train == want.train  # bit for bit, every step (4 before the kill, 2 after)
    assert got.val == want.val
