"""Predictions travel with every run: `train --dry-run`, RUN_DIR/prediction.json, the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmscale.bench.jobs import short_job
from llmscale.cli import main
from llmscale.config import load_config
from llmscale.instrument import calibrate
from llmscale.plan.plan import Plan
from llmscale.plan.predict import predict_step_time, runtime_time_params
from llmscale.train.metrics import read_jsonl
from llmscale.train.prediction import (
    FILE_NAME,
    RunPrediction,
    local_hardware,
)
from llmscale.train.progress import comparison_lines, measured_step_time
from llmscale.train.trainer import run_training

CPU = torch.device("cpu")
# A calibration with round figures: predictions from it are exact to check.
FAKE_RATES = {n: 1e9 * (i + 1) for i, n in enumerate(calibrate.GEMM_SIZES["cpu"])}
FAKE_BANDWIDTH = 1e10


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The calibration cache in a folder of the test's own, holding a fake fp32 calibration."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("LLMSCALE_CACHE_DIR", str(folder))
    key = calibrate.machine_key(CPU)
    fake = calibrate.Calibration(key, FAKE_BANDWIDTH, {"fp32": dict(FAKE_RATES)})
    calibrate.write_cache(calibrate.cache_path(key), fake)
    return folder


def _counting_measure(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the micro-benchmarks by constants; the returned list grows by one per GEMM."""
    calls: list[str] = []

    def gemm(n: int, dtype: torch.dtype, device: torch.device) -> float:
        calls.append(f"{dtype}-{n}")
        return 2e9

    monkeypatch.setattr(calibrate, "square_gemm_flops_per_s", gemm)
    monkeypatch.setattr(calibrate, "bandwidth_bytes_per_s", lambda *a, **k: 3e10)
    return calls


# ---- the calibration cache -----------------------------------------------------------------


def test_calibration_is_measured_once_then_read(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "c"
    first = calibrate.cached_calibration(CPU, ("fp32",), folder)  # really measured
    assert first.seconds > 0 and first.bandwidth_bytes > 0
    assert set(first.gemm_flops["fp32"]) == set(calibrate.GEMM_SIZES["cpu"])
    assert all(r > 0 for r in first.gemm_flops["fp32"].values())
    (path,) = folder.glob("calibration-*.json")
    assert json.loads(path.read_text())["key"] == calibrate.machine_key(CPU)
    calls = _counting_measure(monkeypatch)
    again = calibrate.cached_calibration(CPU, ("fp32",), folder)
    assert calls == [] and again.seconds == 0.0
    assert again.gemm_flops == first.gemm_flops and again.bandwidth_bytes == first.bandwidth_bytes
    # Another dtype is measured and added; the bandwidth and fp32 figures are kept.
    both = calibrate.cached_calibration(CPU, ("bf16",), folder)
    assert len(calls) == len(calibrate.GEMM_SIZES["cpu"]) and all("bfloat16" in c for c in calls)
    assert both.gemm_flops["fp32"] == first.gemm_flops["fp32"]
    assert both.bandwidth_bytes == first.bandwidth_bytes
    assert set(json.loads(path.read_text())["gemm_flops_per_s"]) == {"fp32", "bf16"}


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "",
        '{"version": 1}',
        '{"version": 99, "key": {}, "bandwidth_bytes_per_s": 1, "gemm_flops_per_s": {}}',
        "[1, 2]",
    ],
)
def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch, text: str) -> None:
    folder = tmp_path / "c"
    path = calibrate.cache_path(calibrate.machine_key(CPU), folder)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    calls = _counting_measure(monkeypatch)
    got = calibrate.cached_calibration(CPU, ("fp32",), folder)
    assert len(calls) == len(calibrate.GEMM_SIZES["cpu"]) and got.bandwidth_bytes == 3e10
    assert calibrate.read_cache(path, calibrate.machine_key(CPU)) == got  # replaced, readable


def test_a_cache_of_another_machine_is_not_used(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "c"
    key = calibrate.machine_key(CPU)
    other = calibrate.Calibration({**key, "threads": "999"}, 1.0, {"fp32": dict(FAKE_RATES)})
    path = calibrate.cache_path(key, folder)
    calibrate.write_cache(path, other)  # under this machine's name, but another's key
    calls = _counting_measure(monkeypatch)
    assert calibrate.cached_calibration(CPU, ("fp32",), folder).key == key
    assert len(calls) == len(calibrate.GEMM_SIZES["cpu"])


def test_gemm_rate_interpolates_between_sizes() -> None:
    cal = calibrate.Calibration({}, 1.0, {"fp32": dict(FAKE_RATES)})
    small, mid, large = calibrate.GEMM_SIZES["cpu"]
    assert cal.gemm_rate("fp32", 1) == FAKE_RATES[small]
    assert cal.gemm_rate("fp32", mid) == FAKE_RATES[mid]
    assert cal.gemm_rate("fp32", 10 * large) == FAKE_RATES[large]
    between = cal.gemm_rate("fp32", (small * mid) ** 0.5)  # halfway on a log scale
    assert between == pytest.approx((FAKE_RATES[small] + FAKE_RATES[mid]) / 2)


# ---- llmscale train --dry-run ----------------------------------------------------------------


def test_dry_run_on_this_cpu_prints_memory_and_time_and_trains_nothing(
    cache, tmp_path, capsys
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--dry-run", *short_job(job__run_dir=run_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "model tiny" in out and "1 rank(s)" in out
    assert f"{torch.get_num_threads()} thread" in out and ", measured)" in out
    assert "memory per rank" in out and "fits: yes" in out
    cfg = load_config(None, short_job(job__run_dir=run_dir))
    hw = local_hardware(CPU, Plan.from_job(cfg))
    want = predict_step_time(cfg, hw.cluster, runtime_time_params(cfg, "cpu"))
    assert f"step time: {want.seconds:.3f} s predicted" in out
    assert "MFU" not in out  # against a measured rate it would mean nothing
    assert not run_dir.exists()


def test_dry_run_predicts_a_multi_rank_layout_without_torchrun(cache, capsys) -> None:
    layout = ["--parallel.pp", "2", "--parallel.dp_shard", "2", "--parallel.tp", "2"]
    batch = ["--train.micro_batch_size", "2", "--train.global_batch_size", "8"]
    # --job.device cuda: the local device does not matter for a catalog GPU (none here is fine).
    argv = ["train", "--dry-run", "--gpu", "h100", *short_job(), *layout, *batch]
    assert main([*argv, "--job.device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "8 rank(s): pp 2 x dp_replicate 1 x dp_shard 2 x tp 2" in out
    assert "NVIDIA H100" in out and "hardware catalog" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[:2] for r in rows] == [["0", "0-3"], ["1", "4-7"]]
    assert "fits: yes" in out and "MFU" in out and "step time:" in out


def test_dry_run_with_an_unknown_gpu_names_the_allowed_ones(capsys) -> None:
    assert main(["train", "--dry-run", "--gpu", "h900", *short_job()]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "h900" in err and "h100" in err and "h200" in err


def test_dry_run_of_an_invalid_config_is_one_line(capsys) -> None:
    assert main(["train", "--dry-run", "--gpu", "h100", "--parallel.tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.tp" in err and "Traceback" not in err


def test_gpu_needs_dry_run(capsys) -> None:
    assert main(["train", "--gpu", "h100"]) == 2
    assert "--dry-run" in capsys.readouterr().err


# ---- RUN_DIR/prediction.json and the summary -------------------------------------------------


def _byte_keys(row: dict) -> set[str]:
    return {k for k, v in row.items() if k.endswith("_bytes") and isinstance(v, int)}


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--optimizer.offload", "optimizer", "--train.global_batch_size", "4"],
    ],
    ids=["plain", "offload-accum"],
)
def test_every_run_writes_its_prediction(cache, tmp_path, capsys, extra) -> None:
    run_dir = tmp_path / "run"
    overrides = short_job(
        job__run_dir=run_dir, train__steps=2, train__micro_batch_size=2,
        train__global_batch_size=2,
    )  # fmt: skip
    cfg = load_config(None, [*overrides, *extra])
    run_training(cfg)
    pred = json.loads((run_dir / FILE_NAME).read_text())
    assert set(pred) >= {"hardware", "plan", "memory_bytes", "step_time_s"}
    assert pred["plan"]["model"] == "tiny" and pred["plan"]["world_size"] == 1
    assert pred["hardware"]["name"] == "measured" and pred["step_time_s"] > 0
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    measured = rows[-1]
    assert set(pred["memory_bytes"]) == _byte_keys(measured)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "host_master_bytes"):
        assert pred["memory_bytes"][key] == measured[key], key  # byte-exact on the CPU
    assert pred["memory_bytes"]["activation_bytes"] == pytest.approx(
        measured["activation_bytes"], rel=0.02
    )
    assert not list(run_dir.glob("*.tmp"))  # written atomically: no temporary file left
    out = capsys.readouterr().out
    assert "vs measured, rank 0:" in out
    (param_line,) = [line for line in out.splitlines() if line.strip().startswith("param_bytes")]
    assert param_line.split()[-1] == "1.00"
    (step_line,) = [line for line in out.splitlines() if line.strip().startswith("step_time_s")]
    ratio = pred["step_time_s"] / measured_step_time([r["step_time_s"] for r in rows])
    assert step_line.split()[-1] == f"{ratio:.2f}"


def test_the_summary_puts_predicted_next_to_measured() -> None:
    pred = RunPrediction(
        hardware={"display": "GPU X"},
        plan={},
        rank=0,
        memory_bytes={"param_bytes": 2048.0, "host_master_bytes": 0.0, "grad_bytes": 1024.0},
        step_time_s=0.5,
    )
    times = [9.0, 1.0, 2.0]
    last = {"kind": "train", "step_time_s": 2.0, "param_bytes": 1024, "grad_bytes": 2048}
    assert measured_step_time(times) == 1.5  # the median after the first (warm-up) step
    assert measured_step_time([3.0]) == 3.0 and measured_step_time([]) is None
    head, columns, step, param, grad = comparison_lines(pred, times, last)
    assert "GPU X" in head and "rank 0" in head
    assert columns.split() == ["predicted", "measured", "ratio"]
    assert step.split() == ["step_time_s", "0.500", "s", "1.500", "s", "0.33"]
    assert param.split() == ["param_bytes", "2.0", "KiB", "1.0", "KiB", "2.00"]
    assert grad.split() == ["grad_bytes", "1.0", "KiB", "2.0", "KiB", "0.50"]
    assert comparison_lines(pred, [], {}) == []  # no step ran
    unknown = RunPrediction({}, {}, 0, {}, None, not_modelled="parallel.cp: got 2")
    assert comparison_lines(unknown, times, last) == [
        "predicted vs measured: not modelled (parallel.cp: got 2)"
    ]
