"""An unusable calibration cache (`$LLMSCALE_CACHE_DIR`, review cases EN01-EN06 of
../shared/reviews/usability-2026-12-04.md) never fails a run: the figures are measured again, and
one notice line on stderr says which path and why, once per process (it was silent, and every
run paid the 1-2 s calibration again). The micro-benchmarks are replaced by constants here (the
notices are about the cache, not the figures); each case is a row of docs/reliability.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmscale import paths
from llmscale.bench.jobs import short_job
from llmscale.cli import main
from llmscale.config import load_config
from llmscale.train import calibration

CPU = torch.device("cpu")
TINY = load_config(None, short_job()).model
FAKE = {"gemm_fp32_flops": 2e9, "attention_flops": 1e9, "bandwidth_bytes": 1e10,
        "fixed_s": 1e-3, "optimizer_s": 2e-3}  # fmt: skip


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Constant figures; the list grows by one per measurement. Each test is a fresh process as
    far as the notices go."""
    calls: list[int] = []

    def measure(*args: object, **kwargs: object) -> dict[str, float]:
        calls.append(1)
        return dict(FAKE)

    monkeypatch.setattr(calibration, "measure", measure)
    monkeypatch.setattr(calibration, "probe_seconds", lambda device: 0.01)
    monkeypatch.setattr(paths, "_NOTICED", set())
    return calls


def notices(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("notice:")]


def record(folder: Path) -> Path:
    """The cache file of the tiny model's figures in `folder`."""
    key = calibration.cache_key(CPU, TINY, 2, 16, "fp32")
    return calibration.calibrate.cache_path(key, folder)


def dry_run(capsys, monkeypatch, cache: str, tmp_path: Path) -> tuple[str, str]:
    """`llmscale train --dry-run` of the tiny model with `$LLMSCALE_CACHE_DIR=cache`: it must
    succeed; its notices (and the command as a row shows it)."""
    monkeypatch.setenv("LLMSCALE_CACHE_DIR", cache)
    capsys.readouterr()
    rc = main(["train", "--dry-run", *short_job(job__run_dir=tmp_path / "run")])
    out, err = capsys.readouterr()
    assert rc == 0 and "memory per rank" in out and "step time:" in out, err
    (line,) = notices(err)
    return line, f"exit 0, the plan printed; stderr: {line}"


def test_en01_cache_under_proc(tmp_path, capsys, monkeypatch, measured, fault_row) -> None:
    line, seen = dry_run(capsys, monkeypatch, "/proc/llmscale_cache", tmp_path)
    assert line == (
        "notice: calibration cache /proc/llmscale_cache is not writable (FileNotFoundError: No "
        "such file or directory); re-measuring each run"
    )
    assert measured == [1]
    # Once per process: a second prediction in the same process measures again, silently.
    assert main(["train", "--dry-run", *short_job(job__run_dir=tmp_path / "run")]) == 0
    assert measured == [1, 1] and notices(capsys.readouterr().err) == []
    fault_row(
        fault="EN01: LLMSCALE_CACHE_DIR under /proc (cannot be created)",
        command="LLMSCALE_CACHE_DIR=/proc/llmscale_cache llmscale train --dry-run",
        expected="the plan, exit 0; one notice naming the folder and why (was: re-measured "
        "silently on every run)",
        observed=seen,
    )


def test_en02_cache_dir_is_a_file(tmp_path, capsys, monkeypatch, measured, fault_row) -> None:
    file = tmp_path / "cache_file"
    file.write_text("not a folder\n")
    line, seen = dry_run(capsys, monkeypatch, str(file), tmp_path)
    assert (
        line == f"notice: calibration cache {file} is a file, not a folder; re-measuring each run"
    )
    assert measured == [1] and file.read_text() == "not a folder\n"
    fault_row(
        fault="EN02: LLMSCALE_CACHE_DIR is a file",
        command="LLMSCALE_CACHE_DIR=work/cache_file llmscale train --dry-run",
        expected="the plan, exit 0; one notice: the path is a file (was: silent)",
        observed=seen.replace(str(tmp_path), "work"),
    )


def test_en03_garbage_cache_file(tmp_path, capsys, monkeypatch, measured, fault_row) -> None:
    folder = tmp_path / "cache_bad"
    path = record(folder)
    folder.mkdir()
    path.write_text("{garbage")
    figures, now, _ = calibration.cached_record(TINY, 2, 16, "fp32", CPU, folder)
    (line,) = notices(capsys.readouterr().err)
    assert line == (
        f"notice: calibration cache {path} is unreadable (invalid JSON at line 1, column 2); "
        "re-measured and rewritten"
    )
    assert now and figures == FAKE and measured == [1]
    assert calibration.read_figures(path, calibration.cache_key(CPU, TINY, 2, 16, "fp32")) == (
        FAKE,
        "",
    )
    # The next run reads the rewritten file: nothing measured, nothing said.
    _, now, _ = calibration.cached_record(TINY, 2, 16, "fp32", CPU, folder)
    assert not now and measured == [1] and capsys.readouterr().err == ""
    fault_row(
        fault="EN03: a calibration cache file of garbage JSON",
        command="LLMSCALE_CACHE_DIR=work/cache_bad llmscale train --dry-run",
        expected="the plan, exit 0; one notice naming the file and why, which is rewritten "
        "(was: silent)",
        observed="the run's calibration (train/calibration.cached_record) measured again and "
        "rewrote the file; stderr: "
        + line.replace(str(path), f"work/{folder.name}/calibration-KEY.json"),
    )


def test_en06_negative_figures(tmp_path, capsys, monkeypatch, measured, fault_row) -> None:
    folder = tmp_path / "cache_trunc"
    path = record(folder)
    key = calibration.cache_key(CPU, TINY, 2, 16, "fp32")
    calibration.calibrate.write_json(path, {"key": key, "figures": {**FAKE, "gemm_fp32_flops": -1},
                                            "probe_s": -1})  # fmt: skip
    figures, now, _ = calibration.cached_record(TINY, 2, 16, "fp32", CPU, folder)
    (line,) = notices(capsys.readouterr().err)
    assert line == (
        f"notice: calibration cache {path} holds an invalid figure (gemm_fp32_flops = -1); "
        "re-measured and rewritten"
    )
    assert now and figures == FAKE and json.loads(path.read_text())["figures"] == FAKE
    # The review's own EN06 file: every number after ': ' made -1 (bench/bad_inputs.py), the
    # model's shape inside the key too, so the key no longer matches the file's name.
    path.write_text(re.sub(r"(?<=: )\d+\.?\d*(e-?\d+)?", "-1", path.read_text()))
    _, now, _ = calibration.cached_record(TINY, 2, 16, "fp32", CPU, folder)
    assert now and notices(capsys.readouterr().err) == [
        f"notice: calibration cache {path} is not the record its name stands for (another key: "
        "damaged or edited); re-measured and rewritten"
    ]
    fault_row(
        fault="EN06: a calibration cache whose figures are -1",
        command="LLMSCALE_CACHE_DIR=work/cache_trunc llmscale train --dry-run",
        expected="the plan, exit 0; one notice naming the figure (was: re-measured silently)",
        observed="the run's calibration (train/calibration.cached_record) measured again and "
        "rewrote the file; stderr: "
        + line.replace(str(path), f"work/{folder.name}/calibration-KEY.json"),
    )


# EN04: a folder that cannot be written. Root writes in it anyway: the case runs without
# CAP_DAC_OVERRIDE (setpriv), hence in a subprocess of its own.
_EN04 = """
import sys, torch
from pathlib import Path
from llmscale.bench.jobs import short_job
from llmscale.config import load_config
from llmscale.train import calibration
calibration.measure = lambda *a, **k: {"gemm_fp32_flops": 2e9, "attention_flops": 1e9,
    "bandwidth_bytes": 1e10, "fixed_s": 1e-3, "optimizer_s": 2e-3}
calibration.probe_seconds = lambda device: 0.01
model = load_config(None, short_job()).model
for _ in range(2):
    _, now, _ = calibration.cached_record(model, 2, 16, "fp32", torch.device("cpu"), Path(sys.argv[1]))
    assert now
"""


@pytest.mark.slow  # a subprocess importing torch: ~3-8 s
def test_en04_unwritable_cache_folder(tmp_path, fault_row) -> None:
    folder = tmp_path / "cache_ro"
    folder.mkdir()
    folder.chmod(0o555)
    cmd = [sys.executable, "-c", _EN04, str(folder)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: file modes do not apply")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        folder.chmod(0o755)
    assert r.returncode == 0, r.stderr
    # Twice measured, once said.
    assert notices(r.stderr) == [
        f"notice: calibration cache {folder} is not writable (PermissionError: Permission "
        "denied); re-measuring each run"
    ], r.stderr
    assert list(folder.iterdir()) == []
    fault_row(
        fault="EN04: LLMSCALE_CACHE_DIR a folder that cannot be written (no CAP_DAC_OVERRIDE)",
        command="LLMSCALE_CACHE_DIR=work/cache_ro llmscale train --dry-run",
        expected="the plan, exit 0; one notice naming the folder (was: silent)",
        observed="exit 0; stderr: " + notices(r.stderr)[0].replace(str(tmp_path), "work"),
    )


@pytest.mark.slow  # a 1-step run: ~3-8 s
def test_en05_training_with_the_cache_under_proc(
    tmp_path, capsys, monkeypatch, measured, fault_row
) -> None:
    """The run's prediction (RUN_DIR/prediction.json) measures; the run trains as ever."""
    from run_helpers import run_cli, train_args

    monkeypatch.setenv("LLMSCALE_CACHE_DIR", "/proc/llmscale_cache")
    rc, _, err = run_cli(capsys, train_args(tmp_path / "run", steps=1))
    assert rc == 0, err
    assert notices(err) == [
        "notice: calibration cache /proc/llmscale_cache is not writable (FileNotFoundError: No "
        "such file or directory); re-measuring each run"
    ]
    assert measured == [1] and (tmp_path / "run" / "prediction.json").exists()
    fault_row(
        fault="EN05: train with LLMSCALE_CACHE_DIR under /proc",
        command="LLMSCALE_CACHE_DIR=/proc/llmscale_cache llmscale train --train.steps 1",
        expected="the run trains, exit 0; one notice naming the folder (was: silent)",
        observed=f"exit {rc}, 1 step trained; stderr: {notices(err)[0]}",
    )


# The prepared datasets' cache (data/prepared.py: shards' sha256 and largest ids) shares the
# folder: without it each open reads every shard again. Exercised on one small shard.


def test_dataset_cache_unwritable_or_garbage(tmp_path, monkeypatch, capsys, measured) -> None:
    from llmscale.data.prepared import SHARD_CACHE, _ShardCache

    shard = tmp_path / "train-00000.bin"
    shard.write_bytes(bytes(range(8)))
    monkeypatch.setenv("LLMSCALE_CACHE_DIR", "/proc/llmscale_cache")
    for _ in range(2):  # twice read, once said
        cache = _ShardCache()
        cache.max_id(shard, cache.sha256(shard), 8, "uint16")
        cache.save()
    assert notices(capsys.readouterr().err) == [
        "notice: dataset cache /proc/llmscale_cache is not writable (FileNotFoundError: No such "
        "file or directory); each run reads every shard again to check it"
    ]
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / SHARD_CACHE).write_text("{garbage")
    monkeypatch.setenv("LLMSCALE_CACHE_DIR", str(folder))
    cache = _ShardCache()
    sha = cache.sha256(shard)
    assert cache.max_id(shard, sha, 8, "uint16") == 0x0706  # little-endian ids 0x0100 ... 0x0706
    cache.save()
    assert notices(capsys.readouterr().err) == [
        f"notice: dataset cache {folder / SHARD_CACHE} is unreadable (not the shards' cache); "
        "rebuilt"
    ]
    assert json.loads((folder / SHARD_CACHE).read_text())["max_ids"] == {f"{sha}|uint16": 0x0706}
