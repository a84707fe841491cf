"""bench/gpu.sh runs on a CPU-only machine: it skips the GPU parts, or measures on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmscale.bench import gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA: the script would run for real"
)
def test_script_without_cuda_skips_with_a_clear_message(tmp_path) -> None:
    r = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "no CUDA device: skipping the GPU parts" in r.stdout
    data = json.loads((tmp_path / "gpu_results.json").read_text())
    assert data["device"] == "none" and "skipped" in data
    assert "no CUDA device" in (tmp_path / "gpu_results.md").read_text()


def test_same_measurements_on_the_cpu(tmp_path, capsys) -> None:
    argv = [
        "--allow-cpu",
        "--model",
        "tiny",
        "--seq",
        "32",
        "--steps",
        "3",
        "--micro-batch",
        "2",
        "--data-files",
        "8",
        "--out",
        str(tmp_path),
    ]
    if torch.cuda.is_available():
        pytest.skip("CUDA present: --allow-cpu is ignored")
    assert gpu.main(argv) == 0
    data = json.loads((tmp_path / "gpu_results.json").read_text())
    assert [r["recompute"] for r in data["mfu"]] == ["none", "selective", "full"]
    for r in data["mfu"]:
        assert 0 < r["measured_mfu"] < 1.5 and 0 < r["predicted_mfu"] <= 1
        assert r["measured_step_time_s"] > 0 and r["predicted_step_time_s"] > 0
    assert data["max_micro_batch"] == []  # needs a CUDA memory limit
    assert [r["optimizer"] for r in data["offload"]] == [
        "on device",
        "offload, serial",
        "offload, overlapped",
    ]
    md = (tmp_path / "gpu_results.md").read_text()
    assert "## MFU, bf16" in md and "## Optimizer offload" in md


def test_unknown_model_is_a_one_line_error(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "llmscale.bench.gpu", "--model", "gpt9", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "model.name" in r.stderr and "Traceback" not in r.stderr


def test_unknown_gpu_override_is_refused_before_any_work(tmp_path) -> None:
    r = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh"), "--gpu", "h300", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "h300" in r.stderr and "h200" in r.stderr  # names the allowed catalog GPUs
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "gpu_results.json").exists()


def test_calibration_part_puts_the_catalog_next_to_the_device() -> None:
    """Part 0 (run on CUDA only) exercised on the CPU: the catalog column is the H200's own
    calibration, the measured one the micro-benchmarks, and the table shows both."""
    import argparse

    from llmscale.plan.cluster import Cluster

    args = argparse.Namespace(model="tiny", micro_batch=2, seq=32, device="cpu")
    cluster = Cluster.of("h200")
    part = gpu.calibration_part(args, cluster)
    rows = {r["quantity"]: r for r in part["rows"]}
    cal, peak = cluster.gpu.calibration, cluster.gpu.peak_flops("bf16")
    share = rows["GEMM share of the bf16 peak"]
    # Small GEMMs: below the large-GEMM efficiency, by the catalog's own shape rule.
    assert 0 < share["catalog"] < cal.gemm_efficiency.value
    assert rows["GEMM rate, the model's linears"]["catalog"] == pytest.approx(
        share["catalog"] * peak / 1e12
    )
    attention = rows["attention (causal SDPA fwd+bwd) share of the bf16 peak"]
    assert attention["catalog"] == cal.attention_efficiency.value
    assert all(r["measured"] > 0 for r in part["rows"])
    md = gpu.markdown({"model": "tiny", "device": "cpu", "calibration": part, "mfu": [],
                       "offload": []})  # fmt: skip
    assert "## Calibration: the catalog vs micro-benchmarks" in md
