"""train.compile: every transformer block compiled with torch.compile trains like eager.

A first compile takes 10-20 s on this machine, so the compiled cases are few and combined: one
process (with recompute every_k: a plain and a checkpointed block), and one 2-rank process group
that trains FSDP2 with selective_op recompute, a pp=2 pipeline with full recompute, and FSDP2 in
bf16 (mixed precision) next to the same layout eager. The refusal with tensor parallelism on a
CPU needs no compile at all.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from parallel_harness import (
    BASE,
    assert_same_run,
    rel_error,
    run_layouts,
    single_process_reference,
)

from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.parallel.compile import Compiled, compile_problem
from llmscale.parallel.parallelize import check_runtime_support
from llmscale.train.trainer import Trainer

COMPILE = ["--train.compile", "true"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    return single_process_reference(tmp_path_factory.mktemp("eager") / "run")


@pytest.mark.slow
def test_one_process_compiled_equals_eager(reference, tmp_path) -> None:
    every_k = ["--train.recompute", "every_k", "--train.recompute_every_k", "2"]
    cfg = load_config(None, [*BASE, *COMPILE, *every_k, "--job.run_dir", str(tmp_path / "c")])
    t = Trainer(cfg)
    blocks = list(t.model.layers.values())
    assert all(isinstance(b, Compiled) for b in blocks)
    r = t.fit()
    params = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.close()
    # the same parameter names as eager (checkpoints, offload units and the planner key by name)
    assert_same_run(
        {"steps_done": r.steps_done, "losses": r.losses, "val_loss": r.val_loss, "params": params},
        reference,
        "compile+every_k",
    )


@pytest.mark.slow
def test_compiled_blocks_under_fsdp_pipeline_and_bf16(reference, tmp_path) -> None:
    bf16 = ["--parallel.dp_shard", "2", "--precision.mode", "bf16"]
    layouts = [
        {
            "name": "fsdp2_sac",
            "args": ["--parallel.dp_shard", "2", "--train.recompute", "selective_op", *COMPILE],
        },
        {
            "name": "pp2_full",
            "args": ["--parallel.pp", "2", "--train.recompute", "full", *COMPILE],
        },
        {"name": "fsdp2_bf16", "args": bf16},
        {"name": "fsdp2_bf16_compiled", "args": [*bf16, *COMPILE]},
    ]
    got = run_layouts(2, tmp_path, layouts, timeout=420)
    assert_same_run(got["fsdp2_sac"], reference, "fsdp2_sac")
    assert_same_run(got["pp2_full"], reference, "pp2_full")
    # bf16: compiled and eager round differently (fused kernels keep fp32 in registers); the
    # same training to bf16's precision.
    eager, comp = got["fsdp2_bf16"], got["fsdp2_bf16_compiled"]
    assert len(comp["losses"]) == len(eager["losses"]) == 5
    for step, (a, b) in enumerate(zip(comp["losses"], eager["losses"], strict=True), 1):
        assert rel_error(a, b) < 1e-2, f"bf16 step {step}: loss {a} vs {b}"


def test_tensor_parallel_compile_refused_on_cpu(tmp_path) -> None:
    cfg = load_config(
        None, [*BASE, *COMPILE, "--parallel.tp", "2", "--job.run_dir", str(tmp_path / "r")]
    )
    with pytest.raises(ConfigError) as e:
        check_runtime_support(cfg, torch.device("cpu"))
    assert "train.compile" in str(e.value) and "_local_tensor" in str(e.value)
    # allowed where torch is expected to support it, and without TP
    assert compile_problem(2, torch.device("cuda")) is None
    assert compile_problem(1, torch.device("cpu")) is None
    # the launcher refuses it before any worker starts: one line, exit 2
    r = subprocess.run(
        [sys.executable, "-m", "llmscale", "train", "--nproc-per-node", "2", *BASE, *COMPILE,
         "--parallel.tp", "2", "--job.run_dir", str(tmp_path / "r"), "--job.device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.compile" in lines[0] and "tensor parallelism" in lines[0]
