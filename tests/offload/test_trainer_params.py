"""The trainer with `[optimizer] offload = "optimizer+params"`: the same run, bytes, resume, plot."""

from __future__ import annotations

import pytest
import torch

from llmscale.bench.jobs import short_job
from llmscale.cli import main
from llmscale.config import load_config
from llmscale.offload import OffloadedAdamW, read_timeline
from llmscale.offload.timeline import PARAMS_LANE
from llmscale.train.metrics import read_jsonl
from llmscale.train.plot import timeline_path
from llmscale.train.trainer import Trainer

PARAMS = ("--optimizer.offload", "optimizer+params")
EXACT = ("--optimizer.offload_kernel", "exact")
# 5 steps of 2 micro-batches each, clipping at 1.0 (the default; the norms here are 2-7).
STEPS = ("--train.steps", "5", "--train.micro_batch_size", "2", "--train.global_batch_size", "4")


def _config(run_dir, *overrides: str):
    """The default job, shrunk for tests (tests/conftest.py's make_config; a test module cannot
    import a conftest by name: several folders have one)."""
    base = short_job(job__run_dir=run_dir, train__micro_batch_size=4, train__global_batch_size=4)
    return load_config(None, [*base, *overrides])


def _rows(t: Trainer) -> list[dict]:
    return [r for r in read_jsonl(t.run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """On-device AdamW runs, by the overrides that change the reference (made once each)."""
    cache: dict[tuple[str, ...], tuple[list[float], dict[str, torch.Tensor]]] = {}

    def get(*extra: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        if extra not in cache:
            run = tmp_path_factory.mktemp("ref")
            t = Trainer(_config(run, *STEPS, *extra))
            losses = t.fit().losses
            cache[extra] = (losses, {k: v.clone() for k, v in t.model.state_dict().items()})
        return cache[extra]

    return get


@pytest.mark.parametrize(
    "ref_args, extra",
    [
        ((), ()),
        ((), ("--optimizer.offload_overlap", "false")),
        (("--train.recompute", "full"), ()),
        (("--train.recompute", "selective", "--model.tie_embeddings", "true"), ()),
        (("--train.max_grad_norm", "0"), ()),  # updated during backward
    ],
    ids=["overlap", "serial", "recompute-full", "selective-tied", "update-in-backward"],
)
def test_exact_kernel_is_bitwise_the_on_device_optimizer(
    cfg_factory, references, ref_args, extra
) -> None:
    ref_losses, ref_sd = references(*ref_args)
    t = Trainer(cfg_factory(*STEPS, *ref_args, *extra, *PARAMS, *EXACT))
    assert isinstance(t.optimizer, OffloadedAdamW) and t.optimizer.offload_params
    assert t.fit().losses == ref_losses
    sd = t.model.state_dict()  # the host copies: the device holds no parameter between steps
    assert sd.keys() == ref_sd.keys()
    assert all(torch.equal(sd[k], v) for k, v in ref_sd.items())
    assert all(p.untyped_storage().nbytes() == 0 for p in t.model.parameters())


def test_fused_kernel_within_its_rounding(cfg_factory, references) -> None:
    ref_losses, ref_sd = references()
    t = Trainer(cfg_factory(*STEPS, *PARAMS))
    losses = t.fit().losses
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    sd = t.model.state_dict()
    assert max(_rel(sd[k], v) for k, v in ref_sd.items()) < 1e-6


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_low_precision_holds_2_byte_host_copies(cfg_factory, mode: str) -> None:
    common = (*STEPS, "--precision.mode", mode, "--train.steps", "4")
    ref = Trainer(cfg_factory(*common, "--optimizer.offload", "optimizer", run="opt")).fit()
    t = Trainer(cfg_factory(*common, *PARAMS, run="params"))
    r = t.fit()
    # The same arithmetic as offloading the optimizer only: the same 16-bit weights go up.
    assert r.losses == ref.losses
    n = t.cfg.model.num_params()
    row = _rows(t)[-1]
    assert row["param_bytes"] == 0 and row["host_param_bytes"] == 2 * n
    sd = t.model.state_dict()
    for name, p in t.model.named_parameters():
        assert sd[name].dtype == DTYPE[mode]
        assert torch.equal(sd[name], t.optimizer.state[p]["master"].to(DTYPE[mode]))


DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize(
    "offload, mode",
    [("optimizer+params", "fp32"), ("optimizer+params", "bf16"), ("optimizer", "bf16")],
)
def test_resume_is_bitwise(cfg_factory, offload: str, mode: str) -> None:
    """bf16 too: loading the model's 16-bit weights keeps the checkpoint's fp32 master."""
    common = (
        *STEPS, "--train.steps", "4", "--optimizer.offload", offload, "--precision.mode", mode,
        "--checkpoint.enabled", "true",
    )  # fmt: skip
    full = Trainer(cfg_factory(*common, run="full"))
    full.fit()
    assert (
        Trainer(cfg_factory(*common, "--checkpoint.stop_after", "2", run="res")).fit().interrupted
    )
    second = Trainer(cfg_factory(*common, "--checkpoint.resume", "true", run="res"))
    assert second.fit().steps_done == 4
    assert [x["loss"] for x in _rows(full)] == [x["loss"] for x in _rows(second)]
    a, b = full.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for p, q in zip(full.model.parameters(), second.model.parameters(), strict=True):
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(full.optimizer.state[p][k], second.optimizer.state[q][k]), k


def test_ledger_and_timeline(cfg_factory, tmp_path) -> None:
    t = Trainer(cfg_factory(*STEPS, *PARAMS, "--train.steps", "3"))
    t.fit()
    n, tensors = t.cfg.model.num_params(), len(list(t.model.parameters()))
    for row in _rows(t):
        assert row["param_bytes"] == 0 and row["grad_bytes"] == 0  # between steps: none
        assert row["host_optimizer_bytes"] + row["host_master_bytes"] == 12 * n + 4 * tensors
        assert row["host_param_bytes"] == 0  # fp32: the master is uploaded
        # At most two consecutive units at once (tiny: embedding + first block is the most).
        assert 0 < row["device_param_peak_bytes"] < 4 * n / 2
    meta, ivs = read_timeline(timeline_path(t.run_dir))
    assert meta["offload_params"] is True and meta["prefetch"] == 1
    units = set(meta["units"])
    for step in (0, 1, 2):
        mine = [iv for iv in ivs if iv.step == step]
        for phase in ("fetch", "resident", "update"):
            assert {iv.unit for iv in mine if iv.phase == phase} == units, (step, phase)
        assert {iv.unit for iv in mine if iv.phase == "refetch"} == units - {"head"}
        # Every unit is on the device twice per micro-batch, around its forward and its backward;
        # the head once, from its forward straight into its backward.
        assert sum(iv.lane == PARAMS_LANE for iv in mine) == 2 * (2 * len(units) - 1)
        assert not any(iv.phase == "upload" for iv in mine)  # no upload after the update
    out = tmp_path / "tl.png"
    assert main(["plot", str(t.run_dir), "--timeline", "--step", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000


def test_under_data_parallelism_fsdp2_holds_the_parameters() -> None:
    """dp > 1: FSDP2's CPUOffloadPolicy (tests/offload/test_offload_layouts.py trains it)."""
    batch = ["--train.micro_batch_size", "4", "--train.global_batch_size", "8"]
    for layout in (["--parallel.dp_shard", "2"], ["--parallel.dp_replicate", "2"]):
        assert load_config(None, [*PARAMS, *batch, *layout]).fsdp_cpu_offload
    for layout in (["--parallel.tp", "2"], ["--parallel.pp", "2"]):
        assert not load_config(None, [*PARAMS, *batch, *layout]).fsdp_cpu_offload
    off = ["--optimizer.offload", "optimizer", *batch, "--parallel.dp_shard", "2"]
    assert not load_config(None, off).fsdp_cpu_offload
