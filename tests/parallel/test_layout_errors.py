"""Bad layouts fail with one line naming the field, before any process-group work."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from parallel_harness import BASE, free_port, worker_env

from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.train.trainer import Trainer


def _p(**degrees: object) -> list[str]:
    return [a for k, v in degrees.items() for a in (f"--parallel.{k}", str(v).lower())]


@pytest.mark.parametrize(
    ("world", "overrides", "field", "needle"),
    [
        (3, _p(tp=3), "parallel.tp", "a divisor of model.n_heads=4"),
        (2, _p(tp=2) + ["--model.n_kv_heads", "1"], "parallel.tp", "model.n_kv_heads=1"),
        (2, _p(tp=2) + ["--model.ffn_dim", "191"], "parallel.tp", "model.ffn_dim=191"),
        (8, _p(pp=8), "parallel.pp", "8 stages, at most model.n_layers=4"),
        (
            4,
            _p(pp=2, pp_schedule="interleaved_1f1b", pp_chunks=4),
            "parallel.pp",
            "8 stages, at most model.n_layers=4 or exactly n_layers + 2 = 6",
        ),
        (4, _p(dp_shard=2), "parallel", "degrees whose product equals the world size 4"),
        (2, _p(dp_shard=4), "parallel", "degrees whose product equals the world size 2"),
        (2, _p(dp_shard=2, sequence_parallel=True), "parallel.sequence_parallel", "tp = 1"),
        (
            2,
            _p(tp=2, sequence_parallel=True) + ["--data.seq_len", "33"],
            "data.seq_len",
            "a multiple of parallel.tp=2",
        ),
        (
            2,
            _p(pp=2, pp_schedule="interleaved_1f1b", pp_chunks=2)
            + ["--train.global_batch_size", "6"],
            "train.global_batch_size",
            "a multiple of pp=2 for interleaved_1f1b",
        ),
        (
            2,
            _p(pp=2, pp_schedule="interleaved_1f1b"),
            "parallel.pp_chunks",
            ">= 2 with pp_schedule = 'interleaved_1f1b'",
        ),
        (2, _p(pp=2, pp_chunks=2), "parallel.pp_chunks", "1 unless pp_schedule"),
        (
            2,
            _p(pp=2) + ["--train.global_batch_size", "2"],
            "train.global_batch_size",
            "at least pp=2 for 1f1b",
        ),
        (2, _p(dp_shard=2, zero_stage=0), "parallel.zero_stage", "1 | 2 | 3"),
        (
            4,
            _p(dp_shard=4) + ["--train.global_batch_size", "12"],
            "train.global_batch_size",
            "micro_batch_size x dp = 2 x 4 = 8",
        ),
        # Tied embeddings run under pp > 1 (the last stage's copy, summed on the device), not
        # with an offloaded optimizer.
        (
            2,
            _p(pp=2) + ["--model.tie_embeddings", "true", "--optimizer.offload", "optimizer"],
            "optimizer.offload",
            "none with parallel.pp > 1 and model.tie_embeddings",
        ),
        # Explicit layers per pipeline stage (issue 12): one entry per stage, summing to the
        # model's layers, at least one on every stage but the first and the last (which may hold
        # the embedding or the head alone).
        (2, _p(pp=2) + ["--parallel.pp_layers", "[1, 2]"], "parallel.pp_layers", "got 3"),
        (2, _p(pp=2) + ["--parallel.pp_layers", "[4]"], "parallel.pp_layers", "2 entries"),
        (2, _p(pp=2) + ["--parallel.pp_layers", "[-1, 5]"], "parallel.pp_layers", ">= 0"),
        (
            3,
            _p(pp=3) + ["--parallel.pp_layers", "[2, 0, 2]", "--train.global_batch_size", "6"],
            "parallel.pp_layers",
            "at least one layer on every stage but the first and the last",
        ),
        (
            4,
            _p(pp=2, pp_schedule="interleaved_1f1b", pp_chunks=2, pp_layers="[1, 1, 2]"),
            "parallel.pp_layers",
            "4 entries (one per pipeline stage: pp x pp_chunks), got 3",
        ),
        # Values the planner costs before the runtime has them: refused with one line.
        # Context parallelism with what the runtime does not compose it with yet.
        (
            2,
            _p(cp=2) + ["--optimizer.offload", "optimizer"],
            "optimizer.offload",
            "none with parallel.cp > 1 (not supported yet)",
        ),
        (1, ["--precision.mode", "fp8"], "precision.mode", "fp8 training needs"),
        (2, _p(cp=2) + ["--data.seq_len", "30"], "data.seq_len", "a multiple of 2 x parallel.cp"),
    ],
)
def test_bad_layout_is_a_config_error_before_any_process_group(
    world, overrides, field, needle, monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))  # as torchrun would set it
    with pytest.raises(ConfigError) as e:
        Trainer(load_config(None, [*BASE, "--job.run_dir", str(tmp_path), *overrides]))
    assert e.value.field == field
    assert needle in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert not dist.is_initialized()


def test_cli_rank_exits_at_once_instead_of_waiting_for_peers(tmp_path) -> None:
    """Rank 0 of a 2-rank job with a 4-rank layout: rendezvous would block; it must not start."""
    env = {
        **worker_env(),
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    args = [sys.executable, "-m", "llmscale", "train", *BASE, "--job.run_dir", str(tmp_path)]
    t0 = time.perf_counter()
    r = subprocess.run(
        [*args, *_p(pp=2, tp=2)], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "parallel: got 'pp x dp_replicate x dp_shard x tp = 2 x 1 x 1 x 2 = 4'" in lines[0]
    assert "the world size 2" in lines[0]
    assert time.perf_counter() - t0 < 60
