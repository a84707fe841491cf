"""The run-time memory check: the planner's prediction against this machine, before building."""

from __future__ import annotations

import pytest
import torch

from llmscale.cli import main
from llmscale.config import load_config
from llmscale.errors import UsageError
from llmscale.plan import activations as act
from llmscale.plan.memory import MemoryOptions
from llmscale.plan.predict import predict_memory
from llmscale.train import memcheck
from llmscale.train.memcheck import Capacity, check_memory, predicted_need

CPU = torch.device("cpu")
BIG = ["--model.name", "llama2-70b", "--train.steps", "1"]


def test_a_run_that_cannot_fit_stops_with_one_line_before_building(capsys, tmp_path) -> None:
    assert main(["train", *BIG, "--job.run_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "llama2-70b" in err and "cannot fit" in err and "--job.memory_check" in err
    assert not (tmp_path / "r").exists()  # nothing was written


def test_warn_and_off_let_it_through() -> None:
    warned = check_memory(load_config(None, [*BIG, "--job.memory_check", "warn"]), CPU)
    assert len(warned) == 1 and "cannot fit" in warned[0]
    assert check_memory(load_config(None, [*BIG, "--job.memory_check", "off"]), CPU) == []
    with pytest.raises(UsageError, match="cannot fit"):
        check_memory(load_config(None, BIG), CPU)


def test_on_a_cpu_the_need_is_every_rank_on_this_host(monkeypatch) -> None:
    options = MemoryOptions(kernels=act.RUNTIME_CPU)
    one = load_config(None, [])
    stage = predict_memory(one, options).per_rank[0]
    assert predicted_need(one, CPU) == (0.0, stage.total + stage.host)
    batch = ["--train.micro_batch_size", "4", "--train.global_batch_size", "8"]
    dp2 = load_config(None, [*batch, "--parallel.dp_replicate", "2"])
    per_rank = predict_memory(dp2, options).per_rank[0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert predicted_need(dp2, CPU)[1] == 2 * (per_rank.total + per_rank.host)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per host: two hosts share the job
    assert predicted_need(dp2, CPU)[1] == per_rank.total + per_rank.host


def test_more_than_is_free_now_is_a_warning(monkeypatch) -> None:
    cfg = load_config(None, [])
    need = predicted_need(cfg, CPU)[1]
    monkeypatch.setattr(
        memcheck, "host_capacity", lambda: Capacity("RAM", int(10 * need), int(need / 2))
    )
    (w,) = check_memory(cfg, CPU)
    assert "free now" in w and "cannot fit" not in w
    monkeypatch.setattr(memcheck, "host_capacity", lambda: Capacity("RAM", int(10 * need), None))
    assert check_memory(cfg, CPU) == []


def test_on_a_gpu_the_allocated_peak_decides_and_the_allocators_share_warns(monkeypatch) -> None:
    """As the planner's verdict: a GPU holding the allocated peak but not the caching
    allocator's share over it runs the job, with a warning; one below the peak stops it."""
    cuda = torch.device("cuda", 0)
    cfg = load_config(None, [])
    allocated, _ = predicted_need(cfg, cuda)
    reserved = memcheck.predicted_memory(cfg, cuda).total
    assert reserved > allocated > 0
    between = int((allocated + reserved) / 2)
    monkeypatch.setattr(memcheck, "cuda_capacity", lambda d: Capacity("GPU", between, None))
    (w,) = check_memory(cfg, cuda)
    assert w.startswith("memory: tight: ") and "expandable_segments" in w
    monkeypatch.setattr(
        memcheck, "cuda_capacity", lambda d: Capacity("GPU", int(reserved) + 1, None)
    )
    assert check_memory(cfg, cuda) == []
    short = int(0.99 * allocated)
    monkeypatch.setattr(memcheck, "cuda_capacity", lambda d: Capacity("GPU", short, None))
    with pytest.raises(UsageError, match="cannot fit"):
        check_memory(cfg, cuda)
