"""No hangs: a stalled (SIGSTOP) or dead (SIGKILL) rank stops the job within
comm.timeout_seconds plus a small grace, with exit code 4 and a message naming the rank.

The multi-process cases run `llmscale train --nproc-per-node 2` with `LLMSCALE_FAULT` (the
rank signals itself after a step: train/fault_injection.py); the heartbeat's own logic is
tested in-process on a HashStore.
"""

from __future__ import annotations

import math
import subprocess
import threading
import time

import pytest
import torch.distributed as dist
from launch_helpers import JOB, job_env, kill, llmscale_cmd, state, wait_for, workers

from llmscale.config import load_config
from llmscale.errors import ConfigError, ExitCode
from llmscale.parallel.heartbeat import DONE, Heartbeat, PeerLost, interval_for, is_peer_error

TIMEOUT = 4.0  # comm.timeout_seconds of the multi-process cases
GRACE = 12.0  # the heartbeat's 3 intervals, the teardown, and this machine's load


def _launch(run_dir, fault: str) -> subprocess.Popen[str]:
    cmd = llmscale_cmd(
        "train",
        "--nproc-per-node",
        "2",
        *JOB,
        "--train.steps",
        "40",
        "--checkpoint.enabled",
        "false",
        "--comm.timeout_seconds",
        str(TIMEOUT),
        "--job.run_dir",
        str(run_dir),
    )
    env = job_env(LLMSCALE_FAULT=fault)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _gone(pid: int) -> bool:
    return state(pid) in (None, "Z")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_stalled_rank_stops_the_job_naming_it(tmp_path, fault_row) -> None:
    proc = _launch(tmp_path / "run", "stop:1:2")
    pids: dict[int, int] = {}
    try:

        def stopped() -> bool:
            pids.update(workers(proc.pid))
            return 1 in pids and state(pids[1]) == "T"

        t_stop = wait_for(stopped, timeout=90)
        assert t_stop is not None, "rank 1 never stopped itself"
        assert 0 in pids
        t_exit = wait_for(lambda: _gone(pids[0]), timeout=TIMEOUT + 60)
        assert t_exit is not None, "rank 0 still waits for the stalled rank"
        waited = t_exit - t_stop
        kill(pids[1])  # the agent's SIGTERM stays pending on a stopped process
        _, err = proc.communicate(timeout=60)
    finally:
        for pid in pids.values():
            kill(pid)
        proc.kill()
    lines = [ln for ln in err.splitlines() if "stopped answering" in ln]
    fault_row(
        fault="a rank stalls (SIGSTOP) mid-run",
        command="LLMSCALE_FAULT=stop:1:2 llmscale train --nproc-per-node 2 "
        f"--comm.timeout_seconds {TIMEOUT:g} ...",
        expected="exit 4 within timeout + grace, naming rank 1",
        observed=f"exit {proc.returncode} after {waited:.1f} s: {lines[0] if lines else err[-200:]}",
    )
    assert proc.returncode == ExitCode.PEER_LOST, err[-3000:]
    assert len(lines) == 1 and "rank 1 of 2 stopped answering" in lines[0], err[-3000:]
    assert waited <= TIMEOUT + GRACE
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_rank_stops_the_job_naming_it(tmp_path, fault_row) -> None:
    proc = _launch(tmp_path / "run", "kill:1:2")
    pids: dict[int, int] = {}
    try:

        def killed() -> bool:
            pids.update(workers(proc.pid))
            return 1 in pids and _gone(pids[1])

        t_kill = wait_for(killed, timeout=90)
        assert t_kill is not None, "rank 1 never killed itself"
        _, err = proc.communicate(timeout=TIMEOUT + 60)
        waited = time.monotonic() - t_kill
    finally:
        for pid in pids.values():
            kill(pid)
        proc.kill()
    lines = [ln for ln in err.splitlines() if "rank 1" in ln]
    fault_row(
        fault="a rank is killed (SIGKILL) mid-run",
        command="LLMSCALE_FAULT=kill:1:2 llmscale train --nproc-per-node 2 ...",
        expected="exit 4 within timeout + grace, naming rank 1",
        observed=f"exit {proc.returncode} after {waited:.1f} s: "
        f"{lines[0] if lines else err[-200:]}",
    )
    assert proc.returncode == ExitCode.PEER_LOST, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert waited <= TIMEOUT + GRACE
    assert "Traceback" not in err


# ---- the heartbeat, in one process ----------------------------------------------------------


def _beats(n: int, timeout: float) -> list[Heartbeat]:
    """n ranks' heartbeats on one store; their monitor threads only record (the default
    would end this process)."""
    store = dist.HashStore()
    return [Heartbeat(store, r, n, timeout, on_lost=lambda e: None).start() for r in range(n)]


def test_silent_ranks_names_the_rank_that_stopped() -> None:
    beats = _beats(3, timeout=2.0)
    try:
        time.sleep(0.3)
        beats[2].stop(finished=False)  # as a killed or stopped rank: no more beats, no DONE
        assert beats[0].silent_ranks() == [2]
        assert beats[1].silent_ranks() == [2]
        err = beats[0].lost_error([2])
        assert isinstance(err, PeerLost) and err.code == ExitCode.PEER_LOST
        assert err.reporter_rank == 0 and "rank 2 of 3 stopped answering" in str(err)
        # Rank 0 lost: rank 1, the lowest alive, reports.
        assert beats[1].lost_error([0]).reporter_rank == 1
    finally:
        for b in beats:
            b.stop(finished=False)


def test_a_finished_rank_is_never_lost() -> None:
    beats = _beats(2, timeout=1.0)
    try:
        beats[1].stop(finished=True)
        assert beats[0].read()[1] >= DONE
        assert beats[0].silent_ranks(window=0.6) == []
    finally:
        beats[0].stop()


def test_the_monitor_thread_reports_a_rank_silent_past_the_timeout() -> None:
    """The fallback when no collective raises (NCCL, a subgroup with a longer timeout)."""
    seen: list[PeerLost] = []
    fired = threading.Event()

    def on_lost(e: PeerLost) -> None:
        seen.append(e)
        fired.set()

    store = dist.HashStore()
    watcher = Heartbeat(store, 0, 2, 1.0, on_lost=on_lost).start()
    silent = Heartbeat(store, 1, 2, 1.0).start()
    silent.stop(finished=False)
    t0 = time.monotonic()
    try:
        assert fired.wait(timeout=10)
        took = time.monotonic() - t0
    finally:
        watcher.stop()
    assert seen[0].lost == [1]
    # timeout + 2 intervals, measured from rank 1's last beat, polled once per interval.
    assert 1.0 <= took <= 1.0 + 4 * interval_for(1.0) + 1.0


def test_a_rank_stopped_at_once_by_ctrl_c_takes_its_peers_along(monkeypatch) -> None:
    """A second Ctrl-C stops its rank at once (`stop(interrupted=True)`); a peer that missed
    it (two signals pending at once merge) leaves too, exit 130 and silent, both from its
    monitor thread and when its collective fails, instead of naming the rank as lost."""
    from llmscale.parallel import heartbeat
    from llmscale.parallel.heartbeat import INTERRUPTED, PeerInterrupted, peer_lost

    left = threading.Event()
    store = dist.HashStore()
    peer = Heartbeat(store, 0, 2, 1.0, on_lost=lambda e: None, on_interrupted=left.set).start()
    stopped = Heartbeat(store, 1, 2, 1.0).start()
    try:
        stopped.stop(finished=False, interrupted=True)
        assert peer.read()[1] >= INTERRUPTED
        assert left.wait(timeout=10)  # within an interval, not after the 1 s timeout + 2
        assert peer.interrupted_ranks() == [1] and peer.silent_ranks(window=0.6) == []
        monkeypatch.setattr(heartbeat, "_current", peer)
        err = peer_lost(RuntimeError("Connection closed by peer"))
    finally:
        peer.stop()
    assert isinstance(err, PeerInterrupted) and err.code == ExitCode.SIGINT
    assert err.reporter_rank == -1  # nobody prints: the interrupted rank said why


def test_peer_errors_are_recognised() -> None:
    timed_out = RuntimeError(
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"
    )
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [1]:1")
    assert is_peer_error(timed_out) and is_peer_error(closed)
    wrapped = ValueError("save failed")
    wrapped.__cause__ = closed
    assert is_peer_error(wrapped)
    assert not is_peer_error(ValueError("Size mismatch between saved and current"))
    assert not is_peer_error(KeyboardInterrupt())


@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan])
def test_comm_timeout_must_be_positive_and_finite(value: float) -> None:
    with pytest.raises(ConfigError, match="comm.timeout_seconds"):
        load_config(None, ["--comm.timeout_seconds", str(value)])
    assert load_config(None, ["--comm.timeout_seconds", "5"]).comm.timeout_seconds == 5.0
