"""Many machines: two torchrun agents on this machine, as two nodes of one job.

`torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint
localhost:PORT` (what the README's multi-node and SLURM lines run on each node) trains the same
losses as a single-node 2-process run, bit for bit, and as a 1-process run to the layouts'
tolerance (FSDP's reduce-scatter sums in another order).
"""

from __future__ import annotations

import subprocess

import pytest
from launch_helpers import JOB, ROOT, free_port, job_env, losses, reference, torchrun_cmd

from llmscale.config import load_config
from llmscale.train.trainer import Trainer

RTOL = 1e-5  # as tests/parallel/parallel_harness.py


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_train_the_single_node_losses(tmp_path) -> None:
    run_dir = tmp_path / "two-nodes"
    port = free_port()
    agents = [
        subprocess.Popen(
            torchrun_cmd(
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"localhost:{port}",
                "--rdzv-id",
                "multinode-test",
                "-m",
                "llmscale",
                "train",
                *JOB,
                "--job.run_dir",
                str(run_dir),
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=job_env(),
            cwd=ROOT,
        )
        for node in (0, 1)
    ]
    try:
        outs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for a, (_, err) in zip(agents, outs, strict=True):
        assert a.returncode == 0, err[-4000:]
    two_nodes = losses(run_dir)
    _, one_node = reference()
    assert len(two_nodes.train) == len(one_node.train) > 0
    assert two_nodes.train == one_node.train  # the same layout: bit for bit
    assert two_nodes.val == one_node.val

    # dp only: one process accumulating the same global batch agrees to the layouts' tolerance.
    cfg = load_config(
        None, [*JOB, "--parallel.dp_shard", "1", "--job.run_dir", str(tmp_path / "one")]
    )
    with Trainer(cfg) as t:
        single = t.fit()
    for a, b in zip(two_nodes.train, single.losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b)
    assert two_nodes.val is not None and single.val_loss is not None
    assert abs(two_nodes.val - single.val_loss) <= RTOL * abs(single.val_loss)
