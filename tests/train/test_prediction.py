"""Predictions travel with every run: `train --dry-run`, RUN_DIR/prediction.json, the summary."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from llmscale.bench.jobs import short_job
from llmscale.cli import main
from llmscale.config import load_config
from llmscale.instrument import calibrate
from llmscale.plan.plan import Plan
from llmscale.plan.predict import predict_step_time, runtime_time_params
from llmscale.stack.residency import Collectives
from llmscale.train import calibration
from llmscale.train.metrics import read_jsonl
from llmscale.train.prediction import (
    FILE_NAME,
    RunPrediction,
    catalog_hardware,
    local_hardware,
    predict_run,
)
from llmscale.train.progress import calibration_line, comparison_lines, measured_step_time
from llmscale.train.trainer import run_training

CPU = torch.device("cpu")
# Figures with round numbers: predictions from them are exact to check.
FAKE = {
    "gemm_fp32_flops": 2e9,
    "attention_flops": 1e9,
    "bandwidth_bytes": 1e10,
    "fixed_s": 1e-3,
    "optimizer_s": 2e-3,
}


def _counting_measure(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Replace the micro-benchmarks by constants; the returned list grows by one per measure."""
    calls: list[tuple] = []

    def measure(model, micro_batch, seq_len, precision, device, dtypes=(), effort=None):
        calls.append((model.name, micro_batch, seq_len, precision))
        return {**FAKE, f"gemm_{precision}_flops": 2e9}

    monkeypatch.setattr(calibration, "measure", measure)
    monkeypatch.setattr(calibration, "probe_seconds", lambda device: 0.01)  # a steady machine
    return calls


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The calibration cache in a folder of the test's own, measured by fake micro-benchmarks."""
    monkeypatch.setenv("LLMSCALE_CACHE_DIR", str(tmp_path / "cache"))
    return _counting_measure(monkeypatch)


# ---- the calibration cache -----------------------------------------------------------------

TINY = load_config(None, short_job()).model


def test_figures_are_measured_once_per_shape_then_read(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "c"
    first, measured = calibration.cached_figures(TINY, 2, 16, "fp32", CPU, folder)  # for real
    assert measured and set(first) == set(FAKE)
    assert all(v > 0 for v in first.values())
    (path,) = folder.glob("calibration-*.json")
    stored = json.loads(path.read_text())
    assert stored["key"] == calibration.cache_key(CPU, TINY, 2, 16, "fp32")
    assert stored["key"]["host"] == calibrate.machine_key(CPU)["host"]
    assert stored["probe_s"] > 0  # the probe's time alongside
    calls = _counting_measure(monkeypatch)
    # the machine as fast as then (the probe's re-timing is tests/train/test_calibration_probe's)
    monkeypatch.setattr(calibration, "probe_seconds", lambda device: stored["probe_s"])
    again, measured = calibration.cached_figures(TINY, 2, 16, "fp32", CPU, folder)
    assert calls == [] and not measured and again == first
    # Another shape or precision is another file, measured once.
    calibration.cached_figures(TINY, 4, 16, "fp32", CPU, folder)
    calibration.cached_figures(TINY, 2, 16, "bf16", CPU, folder)
    assert calls == [("tiny", 4, 16, "fp32"), ("tiny", 2, 16, "bf16")]
    assert len(list(folder.glob("calibration-*.json"))) == 3


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "",
        '{"version": 2}',
        '{"key": {}, "figures": {"fixed_s": 1}}',
        "[1, 2]",
    ],
)
def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch, capsys, text: str) -> None:
    folder = tmp_path / "c"
    key = calibration.cache_key(CPU, TINY, 2, 16, "fp32")
    path = calibrate.cache_path(key, folder)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    calls = _counting_measure(monkeypatch)
    got, measured = calibration.cached_figures(TINY, 2, 16, "fp32", CPU, folder)
    assert measured and len(calls) == 1 and got["bandwidth_bytes"] == FAKE["bandwidth_bytes"]
    assert calibration.read_figures(path, key) == (got, "")  # replaced, readable
    err = capsys.readouterr().err  # said in one line (tests/faults/test_cache_faults.py: which)
    assert err.startswith(f"notice: calibration cache {path} ") and err.count("\n") == 1, err
    assert err.endswith("; re-measured and rewritten\n"), err


def test_a_non_finite_figure_is_measured_again(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "c"
    key = calibration.cache_key(CPU, TINY, 2, 16, "fp32")
    path = calibrate.cache_path(key, folder)
    calibrate.write_json(path, {"key": key, "figures": {**FAKE, "fixed_s": float("nan")}})
    assert calibration.read_figures(path, key) == (None, "holds an invalid figure (fixed_s = NaN)")


def test_a_cache_of_another_machine_is_not_used(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "c"
    key = calibration.cache_key(CPU, TINY, 2, 16, "fp32")
    other = {**key, "threads": "999"}
    calibrate.write_json(calibrate.cache_path(key, folder), {"key": other, "figures": FAKE})
    calls = _counting_measure(monkeypatch)
    calibration.cached_figures(TINY, 2, 16, "fp32", CPU, folder)
    assert len(calls) == 1


def test_the_run_predicts_from_the_figures(cache) -> None:
    cfg = load_config(None, short_job())
    hw = local_hardware(CPU, Plan.from_job(cfg))
    cal = hw.cluster.gpu.calibration
    assert hw.measured and hw.info["figures"]["fixed_s"] == FAKE["fixed_s"]
    assert hw.cluster.gpu.peak_flops("fp32") == pytest.approx(2e9)
    assert cal.attention_efficiency.value == pytest.approx(0.5)
    # The runtime's costs on the device are its stack's, sourced to this calibration and when
    # (and under what load) it ran; the step's other fixed cost is not measured: none.
    stack = hw.stack
    assert stack.microbatch_overhead_ms.value == pytest.approx(1.0)
    streamed = 28 * cfg.model.num_params()
    assert stack.optimizer_efficiency is not None
    assert stack.optimizer_efficiency.value == pytest.approx(min(1.0, streamed / 1e10 / 2e-3))
    assert stack.step_overhead_ms.value == 0.0
    when = time.strftime("%Y-%m-%d", time.gmtime(hw.info["calibration"]["measured_at"]))
    source = stack.microbatch_overhead_ms.source
    assert source.startswith(f"{calibration.SOURCE}, {when} ")
    assert hw.info["stack_costs"]["microbatch_overhead_ms"]["value"] == pytest.approx(1.0)


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
    params = dataclasses.replace(runtime_time_params(cfg, "cpu"), stack=hw.stack)
    want = predict_step_time(cfg, hw.cluster, params)
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


def test_dry_run_memory_table_of_the_tiny_model_reads_in_mib(capsys) -> None:
    """The review's dry run printed 0.00 GiB in every column for the tiny model, and a column
    `ranks` reading 0 for its 1 rank: the table now takes the unit its largest figure reads at
    least 1 in, and the columns say what they hold (the pipeline rank, its global rank ids)."""
    job = short_job()
    assert main(["train", "--dry-run", "--gpu", "h100", *job]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("memory per rank at the step's peak, MiB:")
    head, row = lines[at + 1].split(), lines[at + 2].split()
    assert head[:4] == ["pp", "rank", "rank", "ids"] and head[-2:] == ["total", "host"]
    stage = predict_run(load_config(None, job), catalog_hardware("h100")).memory.per_rank[0]
    assert 2**20 < stage.total < 2**30
    assert row[:2] == ["0", "0"] and row[-2] == f"{stage.total / 2**20:.2f}"
    assert float(row[2]) == round(stage.params / 2**20, 2) > 0  # was 0.00 (GiB)
    fit = next(line for line in lines if line.startswith("fits: "))
    assert (
        f"the fullest rank needs {stage.total / 2**20:.2f} MiB "
        f"({stage.allocated / 2**20:.2f} allocated, the rest the caching allocator's; +" in fit
    )


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
    keys = {"offload_bytes_moved"}  # predicted by plan/offload_traffic.py
    traffic = set(Collectives().to_dict())  # prediction.json's "collectives", not memory
    byte_valued = {k for k, v in row.items() if k.endswith("_bytes") and isinstance(v, int)}
    return keys | (byte_valued - traffic)


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
    assert pred["collectives"] == {k: measured[k] for k in Collectives().to_dict()}  # no FSDP
    exact = ("param_bytes", "grad_bytes", "optimizer_bytes", "host_master_bytes")
    for key in (*exact, "offload_bytes_moved"):
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


# ---- the calibration's age and load ----------------------------------------------------------


def _loads(
    monkeypatch: pytest.MonkeyPatch, loads: list[float], threads: int = 2, cores: int = 2
) -> None:
    """Each calibration sees the next of `loads` as the other processes' load, measuring on
    `threads` threads of a machine of `cores` cores (as many as its cores: none left idle)."""
    it = iter(loads)
    monkeypatch.setattr(calibrate.LoadMeter, "other_load_cores", lambda self: next(it))
    monkeypatch.setattr(calibrate, "cpu_cores", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)


@pytest.mark.parametrize(
    ("loads", "measures", "kept", "warned"),
    [
        ([0.1], 1, 0.1, False),  # quiet: measured once
        ([0.9, 0.2], 2, 0.2, False),  # busy, then quiet: the second is kept
        ([0.9, 1.5], 2, 0.9, True),  # busy twice: the quieter one, with a warning
    ],
)
def test_a_calibration_on_a_busy_machine_is_measured_again(
    tmp_path, monkeypatch, loads, measures, kept, warned
) -> None:
    calls = _counting_measure(monkeypatch)
    _loads(monkeypatch, loads)
    figures, now, when = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert now and len(calls) == measures
    assert when.other_load_cores == kept and bool(when.warning) == warned
    assert abs(when.measured_at - time.time()) < 60
    # the cache keeps when and under what load; a read returns them
    again, now, read = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert not now and again == figures and len(calls) == measures
    assert (read.measured_at, read.other_load_cores) == (when.measured_at, kept)


@pytest.mark.parametrize(
    ("loads", "measures", "kept", "warned"),
    [
        ([1.2], 1, 0.2, False),  # others on the idle core, 0.2 on the measurement's: quiet
        ([1.9, 1.1], 2, 0.1, False),  # busy on its own core, then quiet
        ([1.5, 1.7], 2, 0.5, True),
    ],
)
def test_a_one_thread_calibration_counts_only_the_load_on_the_core_it_used(
    tmp_path, monkeypatch, loads, measures, kept, warned
) -> None:
    # a rank of the demo: one thread on a 2-core machine leaves a core to the others
    calls = _counting_measure(monkeypatch)
    _loads(monkeypatch, loads, threads=1, cores=2)
    _, _, when = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert len(calls) == measures and bool(when.warning) == warned
    assert when.other_load_cores == pytest.approx(kept)


def test_the_contending_load_is_the_others_beyond_the_idle_cores() -> None:
    assert calibration.contending_load(1.2, threads=1, cores=2) == pytest.approx(0.2)
    assert calibration.contending_load(0.7, threads=1, cores=2) == 0.0  # all on the idle core
    assert calibration.contending_load(1.2, threads=2, cores=2) == 1.2  # none idle: all count
    assert calibration.contending_load(1.2, threads=4, cores=2) == 1.2  # oversubscribed
    assert calibration.contending_load(3.5, threads=2, cores=8) == 0.0
    assert math.isnan(calibration.contending_load(math.nan, threads=1, cores=2))


def test_the_load_is_the_machines_busy_time_less_ours() -> None:
    # 3 CPU-seconds busy over 2 s of wall time, 1 of them ours: others used 1 core
    assert calibrate.other_load_cores(2.0, 3.0, 1.0) == 1.0
    assert calibrate.other_load_cores(2.0, 1.0, 1.5) == 0.0  # ticks: never below zero
    assert math.isnan(calibrate.other_load_cores(0.1, 3.0, 1.0))  # too short to say (ticks)


def test_the_calibration_line_says_its_age_and_load() -> None:
    hw = {"calibration": {"measured_at": 1000.0, "other_load_cores": 0.12, "warning": ""}}
    assert calibration_line(hw, 1000.0 + 300) == (
        "calibration: measured 5 min ago, other processes' load 0.12 cores"
    )
    hw["shared_cores"] = {
        "measured_at": 1000.0, "other_load_cores": 0.5, "oversubscription": 2.0,
        "allreduce_latency_s": 5e-4, "allreduce_bytes_per_s": 1.5e9, "step_overhead_s": 0.25,
    }  # fmt: skip
    assert calibration_line(hw, 1000.0 + 3 * 86400) == (
        "calibration: measured 3 days ago, other processes' load 0.12 cores; ranks sharing "
        "cores measured 3 days ago, load 0.50 cores (oversubscription x2.00, gloo all-reduce "
        "500 us + 1.50 GB/s, step overhead 250 ms); warning: measured while other processes "
        "used more than 0.25 cores (twice, when it was measured): the prediction carries that "
        "load"
    )
    assert calibration_line({"display": "H100"}, 0.0) == ""  # a catalog GPU: no line
    pred = RunPrediction(hardware=hw, plan={}, rank=0, memory_bytes={}, step_time_s=0.5)
    lines = comparison_lines(pred, [1.0, 0.5], {})
    assert lines[2].split()[-1] == "1.00"  # the step's ratio stays the row's last field
    assert lines[-1].startswith("calibration: measured ")  # now: its own line, last


def test_the_dry_runs_verdict_reads_the_allocated_peak_and_names_a_tight_fit() -> None:
    """A GPU whose usable memory holds the allocated peak but not the caching allocator's share
    over it fits the run tightly (the allocator flushes its cache before it fails); one just
    below the allocated peak does not fit it."""
    from llmscale.hardware.catalog import GPU, GiB, get_gpu
    from llmscale.hardware.spec import Sourced
    from llmscale.plan.memory import estimate_memory
    from llmscale.train.prediction import fit_line

    est = estimate_memory(Plan(model=load_config(None, short_job()).model, seq_len=64,
                               micro_batch_size=2, global_batch_size=2, precision="bf16"))  # fmt: skip
    w, h100 = est.worst, get_gpu("h100")

    def sized(nbytes: float) -> GPU:
        return dataclasses.replace(h100, memory_GiB=Sourced(nbytes / GiB + 1.5, "test"))

    assert fit_line(est, h100).startswith("fits: yes: ")
    assert fit_line(est, sized(w.allocated + w.allocator / 2)).startswith("fits: tightly: ")
    assert fit_line(est, sized(0.99 * w.allocated)).startswith("fits: NO: ")
