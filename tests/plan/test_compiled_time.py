"""The time model's compiled variant (train.compile, `llmscale plan --compile`): fused blocks.

torch.compile fuses each chain of a block's element-wise ops into one kernel, so the blocks'
memory-bound traffic is the chains' inputs and outputs (`compiled_block_bytes`) instead of one
kernel per eager op; matmuls, collectives and the head are unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from llmscale.bench.jobs import short_job
from llmscale.config import load_config
from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.predict import runtime_time_params
from llmscale.plan.time import DEFAULT_TIME, estimate_step_time
from llmscale.train.prediction import catalog_hardware, predict_run

H100 = Cluster.of("h100")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("recompute", ["none", "full", "selective_op"])
def test_compiled_blocks_move_fewer_elementwise_bytes(precision, recompute) -> None:
    plan = Plan(
        model=get_preset("llama3-8b"), seq_len=4096, micro_batch_size=1, global_batch_size=8,
        precision=precision, recompute=recompute, tp=2, dp_shard=4,
    )  # fmt: skip
    for base in (DEFAULT_TIME, replace(DEFAULT_TIME, elementwise="torchtitan")):
        eager = estimate_step_time(plan, H100, base)
        comp = estimate_step_time(plan, H100, replace(base, compiled=True))
        assert comp.breakdown["elementwise"] < 0.7 * eager.breakdown["elementwise"]
        assert comp.breakdown["matmul"] == eager.breakdown["matmul"]
        assert comp.seconds < eager.seconds
    # already fused: compiling changes nothing
    saved = replace(DEFAULT_TIME, elementwise="saved")
    assert (
        estimate_step_time(plan, H100, replace(saved, compiled=True)).seconds
        == estimate_step_time(plan, H100, saved).seconds
    )


def test_run_prediction_reads_train_compile(tmp_path) -> None:
    """prediction.json and `train --dry-run` price the blocks compiled when train.compile is."""
    got = {}
    for flag in ("false", "true"):
        job = short_job(
            job__run_dir=tmp_path / flag, model__name="llama3.2-1b", train__compile=flag
        )
        cfg = load_config(None, [*job, "--precision.mode", "bf16", "--data.seq_len", "2048"])
        assert runtime_time_params(cfg, compiled=cfg.train.compile).compiled is (flag == "true")
        pred = predict_run(cfg, catalog_hardware("h100"))
        got[flag] = (pred.step_time_s, pred.step_breakdown_s["elementwise"])
    assert got["true"][1] < got["false"][1] and got["true"][0] < got["false"][0]


def test_plan_compile_flag() -> None:
    layout = ["--tp", "8", "--pp", "1", "--dp-shard", "8", "--dp-replicate", "1", "--mbs", "1",
              "--recompute", "none", "--zero-stage", "3", "--sp", "--offload", "none"]  # fmt: skip
    base = [sys.executable, "-m", "llmscale", "plan", "--model", "llama2-70b", "--gpu", "h100",
            "--gpus", "64", "--seq", "4096", "--global-batch", "512", "--json", *layout]  # fmt: skip
    out = {}
    for extra in ((), ("--compile",)):
        r = subprocess.run([*base, *extra], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        (c,) = d["candidates"]
        out[bool(extra)] = (d["inputs"]["compiled"], c["step_time"]["seconds"])
    assert out[False][0] is False and out[True][0] is True
    assert out[True][1] < out[False][1]
