"""A cached calibration is used only while this machine still runs as fast as when it was
measured: a fixed probe (train/calibration.py) is timed with every measurement and again at each
use; past `PROBE_TOLERANCE` the figures are measured again, and a line says so. The probe's
times are injected here: a test cannot rely on the machine's real load."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from llmscale.bench.jobs import short_job
from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.instrument import calibrate
from llmscale.parallel.dims import ParallelDims
from llmscale.plan.shared_cores import SharedCoreCosts
from llmscale.train import calibration, shared_cores

CPU = torch.device("cpu")
CFG = load_config(None, short_job())
TINY = CFG.model
FAKE = {"gemm_fp32_flops": 2e9, "attention_flops": 1e9, "bandwidth_bytes": 1e10,
        "fixed_s": 1e-3, "optimizer_s": 2e-3}  # fmt: skip


@pytest.fixture(autouse=True)
def _probe_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite turns the probe's re-check off (tests/conftest.py); these tests are about it."""
    monkeypatch.delenv(calibration.PROBE_TOLERANCE_ENV, raising=False)


def test_the_tolerance_can_be_set_and_a_bad_one_is_one_line(monkeypatch) -> None:
    assert calibration.probe_tolerance() == calibration.PROBE_TOLERANCE == 1.25
    assert calibration.probe_change(0.01, 0.02, "figures")  # 2x slower: measured again
    monkeypatch.setenv(calibration.PROBE_TOLERANCE_ENV, "3")
    assert calibration.probe_change(0.01, 0.02, "figures") == ""
    monkeypatch.setenv(calibration.PROBE_TOLERANCE_ENV, "inf")
    assert calibration.probe_change(0.01, 10.0, "figures") == ""
    for bad in ("0.5", "nan", "fast"):
        monkeypatch.setenv(calibration.PROBE_TOLERANCE_ENV, bad)
        with pytest.raises(ConfigError, match="LLMSCALE_PROBE_TOLERANCE: got"):
            calibration.probe_tolerance()


class Machine:
    """The probe's time now (set by the test) and the measurements taken."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, probe_s: float) -> None:
        self.probe_s = probe_s
        self.measured = 0
        monkeypatch.setattr(calibration, "probe_seconds", lambda device: self.probe_s)
        monkeypatch.setattr(shared_cores, "probe_seconds", lambda device: self.probe_s)

        def measure(*args: object, **kwargs: object) -> dict[str, float]:
            self.measured += 1
            return {k: v * self.probe_s / 0.01 if k == "fixed_s" else v for k, v in FAKE.items()}

        monkeypatch.setattr(calibration, "measure", measure)


def test_the_probe_times_a_fixed_workload() -> None:
    seconds = calibration.probe_seconds(CPU)  # for real: a positive, short time
    assert 0 < seconds < 5.0


@pytest.mark.parametrize(
    ("then", "now", "verdict"),
    [
        (0.010, 0.010, ""),
        (0.010, 0.0125, ""),  # 1.25x: at the tolerance, still this machine
        (0.010, 0.008, ""),  # 1 / 1.25
        (0.010, 0.013, "1.30x slower"),
        (0.010, 0.005, "2.00x faster"),
        (math.nan, 0.010, "no probe time"),  # a record from before probes: cannot tell
    ],
)
def test_a_probe_beyond_the_tolerance_says_why(then: float, now: float, verdict: str) -> None:
    line = calibration.probe_change(then, now, "figures")
    assert (line == "") == (verdict == "")
    assert verdict in line and ("\n" not in line)
    if verdict.endswith(("slower", "faster")):
        assert (
            f"({1e3 * now:.1f} ms, then {1e3 * then:.1f} ms; beyond the tolerance, 1.25x)" in line
        )


def test_figures_measured_fast_are_measured_again_when_the_machine_is_slower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    machine = Machine(monkeypatch, probe_s=0.010)  # a quiet machine
    fast, now, when = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert now and machine.measured == 1 and when.probe_s == 0.010 and when.refreshed == ""
    (path,) = tmp_path.glob("calibration-*.json")
    assert json.loads(path.read_text())["probe_s"] == 0.010

    machine.probe_s = 0.012  # within 1.25x: the cache is this machine's
    again, now, _ = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert not now and again == fast and machine.measured == 1
    assert capsys.readouterr().err == ""

    machine.probe_s = 0.025  # others' load: 2.5x slower
    slow, now, when = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert now and machine.measured == 2 and slow["fixed_s"] == pytest.approx(2.5e-3)
    assert "2.50x slower" in when.refreshed and "measuring again" in when.refreshed
    assert capsys.readouterr().err == when.refreshed + "\n"  # said, in one line
    assert json.loads(path.read_text())["probe_s"] == 0.025  # the cache follows the machine

    _, now, _ = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert not now and machine.measured == 2  # still as slow: the new figures are used

    machine.probe_s = 0.010  # the load is gone: faster than the cache, measured again
    _, now, when = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert now and machine.measured == 3 and "2.50x faster" in when.refreshed


def test_a_cache_record_without_a_probe_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = Machine(monkeypatch, probe_s=0.010)
    calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    (path,) = tmp_path.glob("calibration-*.json")
    data = json.loads(path.read_text())
    del data["probe_s"]
    path.write_text(json.dumps(data))
    _, now, when = calibration.cached_record(TINY, 2, 16, "fp32", CPU, tmp_path)
    assert now and machine.measured == 2 and "no probe time" in when.refreshed


def test_shared_core_costs_are_measured_again_when_the_ranks_run_slower(
    one_rank: ParallelDims,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("LLMSCALE_CACHE_DIR", str(tmp_path / "cache"))
    machine = Machine(monkeypatch, probe_s=0.020)

    def measure(cfg: object, dims: object, device: object) -> tuple[SharedCoreCosts, float]:
        machine.measured += 1
        overhead = 0.25 * machine.probe_s / 0.020  # the step's overhead follows the speed
        costs = SharedCoreCosts(oversubscription=2.0, allreduce_latency_s=1e-3,
                                allreduce_bytes_per_s=1e9, step_overhead_s=overhead,
                                other_load_cores=0.1, measured_at=1.0)  # fmt: skip
        return costs, shared_cores.probe_together(dims, device)  # type: ignore[arg-type]

    monkeypatch.setattr(shared_cores, "measure", measure)
    costs, warnings = shared_cores.cached_costs(CFG, one_rank, CPU)
    assert machine.measured == 1 and warnings == [] and costs is not None
    path = calibrate.cache_path(shared_cores.cache_key(CFG, one_rank, CPU))
    assert json.loads(path.read_text())["probe_s"] == 0.020

    machine.probe_s = 0.022  # within the tolerance: read, not measured
    again, warnings = shared_cores.cached_costs(CFG, one_rank, CPU)
    assert machine.measured == 1 and again == costs and warnings == []

    machine.probe_s = 0.040  # twice as slow now
    slow, warnings = shared_cores.cached_costs(CFG, one_rank, CPU)
    assert machine.measured == 2 and slow is not None
    assert slow.step_overhead_s == pytest.approx(0.5)
    assert slow == dataclasses.replace(costs, step_overhead_s=0.5)
    (line,) = warnings
    assert "2.00x slower" in line and "ranks sharing cores" in line
    assert capsys.readouterr().err == line + "\n"
    assert json.loads(path.read_text())["probe_s"] == 0.040
