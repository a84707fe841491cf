"""The trainer with `[optimizer] offload = "optimizer"`: same run as without, ledger, resume, plots."""

from __future__ import annotations

import pytest
import torch

from llmscale.cli import main
from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.offload import OffloadedAdamW, overlap_stats, read_timeline
from llmscale.train.metrics import read_jsonl
from llmscale.train.plot import timeline_path
from llmscale.train.trainer import Trainer

OFFLOAD = ("--optimizer.offload", "optimizer")
# 5 steps of 2 micro-batches each, clipping at 1.0 (the default; the norms here are 2-7).
STEPS = ("--train.steps", "5", "--train.micro_batch_size", "2", "--train.global_batch_size", "4")


def _train_rows(t: Trainer) -> list[dict]:
    return [r for r in read_jsonl(t.run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "overlap, clip",
    [("false", "1.0"), ("true", "1.0"), ("true", "0")],  # the last updates during backward
)
def test_five_steps_equal_the_on_device_optimizer(cfg_factory, overlap: str, clip: str) -> None:
    common = (*STEPS, "--train.max_grad_norm", clip)
    ref = Trainer(cfg_factory(*common, run="ref"))
    r_ref = ref.fit()
    t = Trainer(
        cfg_factory(*common, *OFFLOAD, "--optimizer.offload_overlap", overlap, run="offload")
    )
    assert isinstance(t.optimizer, OffloadedAdamW)
    assert t.optimizer.update_in_backward == (overlap == "true" and clip == "0")
    r = t.fit()
    assert r.losses == pytest.approx(r_ref.losses, rel=1e-6, abs=0)
    assert r.losses[:2] == r_ref.losses[:2]  # the fused kernel's rounding shows from step 3 on
    tol = 1e-6 if clip != "0" else 1e-5  # unclipped Adam amplifies it (see test_adamw)
    for (name, p), q in zip(t.model.named_parameters(), ref.model.parameters(), strict=True):
        assert _rel(p, q) < tol, name
    rows, ref_rows = _train_rows(t), _train_rows(ref)
    for a, b in zip(rows, ref_rows, strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["lr"] == b["lr"]


@pytest.mark.parametrize(
    "extra",
    [(), ("--train.recompute", "full", "--model.tie_embeddings", "true")],
    ids=["plain", "recompute-tied"],
)
def test_exact_kernel_is_bitwise_the_on_device_optimizer(cfg_factory, extra) -> None:
    """Recomputation re-runs block forwards inside backward; a tied embedding feeds the head."""
    ref = Trainer(cfg_factory(*STEPS, *extra, run="ref"))
    r_ref = ref.fit()
    t = Trainer(
        cfg_factory(*STEPS, *extra, *OFFLOAD, "--optimizer.offload_kernel", "exact", run="x")
    )
    assert t.fit().losses == r_ref.losses
    assert all(
        torch.equal(p, q) for p, q in zip(t.model.parameters(), ref.model.parameters(), strict=True)
    )


def test_ledger_device_holds_no_optimizer_state_host_holds_12_bytes_per_param(
    cfg_factory,
) -> None:
    t = Trainer(cfg_factory(*STEPS, *OFFLOAD, "--train.steps", "2"))
    t.fit()
    n, tensors = t.cfg.model.num_params(), len(list(t.model.parameters()))
    for row in _train_rows(t):
        assert row["device_optimizer_bytes"] == 0 and row["device_master_bytes"] == 0
        assert row["optimizer_bytes"] == row["host_optimizer_bytes"]  # moments, wherever they are
        # fp32 master + 2 moments, plus AdamW's 4-byte step counter per tensor (as plan/memory).
        assert row["host_optimizer_bytes"] + row["host_master_bytes"] == 12 * n + 4 * tensors
        assert row["host_master_bytes"] == 4 * n
        assert row["param_bytes"] == 4 * n  # fp32 working weights stay on the device
        assert row["grad_bytes"] == 0  # each device gradient is released once downloaded


def test_ledger_of_the_on_device_path(cfg_factory) -> None:
    t = Trainer(cfg_factory())
    row = t.train_step()
    n = t.cfg.model.num_params()
    assert (
        row["device_optimizer_bytes"]
        == row["optimizer_bytes"]
        == 8 * n + 4 * len(list(t.model.parameters()))
    )
    assert row["host_optimizer_bytes"] == row["host_master_bytes"] == 0


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_low_precision_keeps_2_byte_weights_on_device(cfg_factory, mode: str) -> None:
    common = (*STEPS, "--precision.mode", mode, "--train.steps", "4")
    ref = Trainer(cfg_factory(*common, run="ref")).fit()
    t = Trainer(cfg_factory(*common, *OFFLOAD, run="off"))
    r = t.fit()
    n = t.cfg.model.num_params()
    row = _train_rows(t)[-1]
    assert row["param_bytes"] == 2 * n and row["host_master_bytes"] == 4 * n
    # Not the same arithmetic as fp32 weights under autocast (the weights themselves are
    # rounded to 16 bits, as Megatron's bf16 params with fp32 main params), but the same run.
    assert r.losses == pytest.approx(ref.losses, abs=0.05)
    for p in t.model.parameters():
        assert torch.equal(p.detach(), t.optimizer.state[p]["master"].to(p.dtype))
    if mode == "fp16":
        assert row["loss_scale"] == t.scaler.scale


def test_fp16_overflow_skips_the_step_and_backs_off(cfg_factory) -> None:
    cfg = cfg_factory(
        *STEPS, *OFFLOAD, "--precision.mode", "fp16", "--precision.initial_scale", "1e30",
        "--precision.max_scale", "1e30", "--train.steps", "2",
    )  # fmt: skip
    t = Trainer(cfg)
    masters = [t.optimizer.state[p]["master"].clone() for p in t.model.parameters()]
    row = t.train_step()
    assert row["skipped"] and t.scaler.scale == 5e29
    assert all(
        torch.equal(t.optimizer.state[p]["master"], m)
        for p, m in zip(t.model.parameters(), masters, strict=True)
    )
    assert t.optimizer.slots[0].step.item() == 0


def test_resume_is_bitwise(cfg_factory) -> None:
    common = (*STEPS, *OFFLOAD, "--train.steps", "6", "--checkpoint.enabled", "true")
    full = Trainer(cfg_factory(*common, run="full"))
    full.fit()
    first = Trainer(cfg_factory(*common, "--checkpoint.stop_after", "3", run="resumed"))
    assert first.fit().interrupted
    second = Trainer(cfg_factory(*common, "--checkpoint.resume", "true", run="resumed"))
    r = second.fit()
    assert r.steps_done == 6 and len(r.losses) == 3
    assert [x["loss"] for x in _train_rows(full)] == [x["loss"] for x in _train_rows(second)]
    for p, q in zip(full.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(full.optimizer.state[p][k], second.optimizer.state[q][k]), k


def test_timeline_is_written_and_plotted(cfg_factory, tmp_path, capsys) -> None:
    t = Trainer(cfg_factory(*STEPS, *OFFLOAD, "--train.steps", "3"))
    t.fit()
    path = timeline_path(t.run_dir)
    meta, ivs = read_timeline(path)
    assert meta["overlap"] is True and meta["units"] == [u.name for u in t.optimizer.units]
    units = {u.name for u in t.optimizer.units}
    for step in (0, 1, 2):
        mine = [iv for iv in ivs if iv.step == step]
        for phase in ("forward", "backward", "download", "norm", "update", "upload"):
            assert {iv.unit for iv in mine if iv.phase == phase} == units, (step, phase)
        # Two micro-batches: every parameter's gradient was downloaded twice.
        assert sum(iv.phase == "download" for iv in mine) == 2 * len(t.optimizer.slots)
        assert all(iv.end >= iv.start for iv in mine)
    stats = overlap_stats(ivs, [1])
    assert stats.offload_s > 0 and stats.compute_s > 0
    out = tmp_path / "tl.png"
    cli = ["plot", str(t.run_dir), "--timeline"]
    assert main([*cli, "--step", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
    assert main([*cli, "--step", "40"]) == 2
    assert "--step" in capsys.readouterr().err


def test_what_is_not_supported_is_refused(tmp_path, capsys) -> None:
    # (optimizer+params under FSDP2: tests/offload/test_trainer_params.py)
    with pytest.raises(ConfigError, match=r"precision\.underflow_steps"):
        load_config(None, [*OFFLOAD, "--precision.underflow_steps", "[1]"])
    with pytest.raises(ConfigError, match=r"optimizer\.offload_kernel"):
        load_config(None, [*OFFLOAD, "--optimizer.offload_kernel", "avx"])
    assert main(["plot", str(tmp_path), "--timeline"]) == 2
    assert "timeline-rank0.json" in capsys.readouterr().err
