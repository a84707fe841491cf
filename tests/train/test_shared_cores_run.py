"""A multi-process CPU run measures its ranks' shared-core costs and predicts its step from them
(train/shared_cores.py, plan/shared_cores.py): the demo's layout, dp_shard 2 x tp 2, shrunk."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from launch_helpers import ROOT, free_port, job_env, torchrun_cmd

from llmscale.bench.jobs import short_job


@pytest.mark.slow  # 4 processes
def test_four_ranks_on_shared_cores_predict_from_their_measured_costs(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = short_job(
        job__run_dir=run_dir, parallel__dp_shard=2, parallel__tp=2,
        train__micro_batch_size=2, train__global_batch_size=4, train__steps=4,
        metrics__progress=False,
    )  # fmt: skip
    cmd = torchrun_cmd(
        "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port",
        str(free_port()), "-m", "llmscale", "train", *args,
    )  # fmt: skip
    env = job_env(LLMSCALE_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    pred = json.loads((run_dir / "prediction.json").read_text())
    shared = pred["hardware"]["shared_cores"]
    assert shared["oversubscription"] >= 1.0  # 4 ranks on this machine's cores
    assert shared["allreduce_latency_s"] > 0 and shared["allreduce_bytes_per_s"] > 0
    assert shared["step_overhead_s"] > 0 and math.isfinite(shared["other_load_cores"])
    parts = pred["step_breakdown_s"]
    assert set(parts) == {"step_overhead", "matmul", "elementwise", "tp_comm"}
    assert pred["step_time_s"] == pytest.approx(sum(parts.values()), rel=1e-9)
    assert parts["step_overhead"] == shared["step_overhead_s"]
    lines = out.stdout.splitlines()
    (step,) = [line for line in lines if line.strip().startswith("step_time_s")]
    assert float(step.split()[1]) == pytest.approx(pred["step_time_s"], abs=5e-4)
    calibration = [line for line in lines if line.startswith("calibration: measured ")]
    assert len(calibration) == 1 and "ranks sharing cores measured" in calibration[0]
