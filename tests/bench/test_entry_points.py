"""The root bench/ scripts are thin entry points into llmscale.bench; tiny runs of the cheap ones."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("offload", "overhead", "scaling", "plan_speed", "published", "loader", "bad_inputs")


def test_every_script_is_a_package_module() -> None:
    assert sorted(p.stem for p in (ROOT / "bench").glob("*.py")) == sorted(SCRIPTS)
    for name in SCRIPTS:
        assert importlib.util.find_spec(f"llmscale.bench.{name}") is not None, name


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_only_calls_its_package_module(name: str) -> None:
    tree = ast.parse((ROOT / "bench" / f"{name}.py").read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert [(n.module, [a.name for a in n.names]) for n in imports] == [
        (f"llmscale.bench.{name}", ["main"])
    ]
    private = [
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
    ]
    assert not private, private


def test_help_of_every_script() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name in SCRIPTS
    }
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, (name, err[-2000:])
        assert out.startswith("usage:") and f"llmscale.bench.{name}" in out, (name, out)


def test_plan_speed_times_a_small_search(capsys) -> None:
    from llmscale.bench import plan_speed

    plan_speed.main(
        ["--model", "llama2-7b", "--gpus", "8", "--seq", "2048", "--global-batch", "64"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].split()[:3] == ["search", "wall", "s"]
    row = lines[1].split()
    assert row[:4] == ["llama2-7b", "on", "8", "h200,"]
    wall, cpu, costed, fit = float(row[9]), float(row[10]), int(row[11]), int(row[12])
    assert cpu > 0 and 0 < wall < 60 and 0 < fit <= costed
    assert row[13] == "-" and "s/step" in lines[1]  # no target; the best plan named
    # The two searches are what it times by default.
    assert [(c.model, c.gpus, c.gpu, c.target_s) for c in plan_speed.CASES] == [
        ("llama2-70b", 64, "h200", 1.0),
        ("llama3-70b", 4096, "h100", 0.5),
    ]


def test_published_prints_every_row(capsys) -> None:
    from llmscale.bench import published

    published.main([])
    out = capsys.readouterr().out
    assert out.count("gpt-") == 10 and "ratio range" in out


def test_offload_tiny_run_with_a_simulated_link(capsys) -> None:
    from llmscale.bench import offload

    argv = ["--model", "tiny", "--rounds", "1", "--block", "2", "--warmup", "1", "--seq", "32"]
    offload.main([*argv, "--batch", "2", "--accum", "1", "--link-gbps", "1"])
    out = capsys.readouterr().out
    assert "link 1 GB/s (simulated)" in out or "link native" in out  # native on a CUDA host
    for mode in ("off", "serial", "overlap"):
        assert f"device parameters {mode}" in out
    # Bytes moved: none without offload; the serial and overlapped runs move what is predicted.
    moved = {
        line.split()[4]: line.split()[5:]
        for line in out.splitlines()
        if line.strip().startswith("bytes moved per step")
    }
    assert moved["off"] == ["0.00", "MiB"]
    for mode in ("serial", "overlap"):
        assert moved[mode][2] == "(predicted" and moved[mode][0] == moved[mode][3]
    assert "host Adam per step" in out


def test_offload_modes_come_from_the_config() -> None:
    from llmscale.bench import offload
    from llmscale.config import OFFLOAD_MODES

    with pytest.raises(SystemExit):
        offload.main(["--offload", "no-such-mode"])
    assert set(OFFLOAD_MODES) - {"none"} <= set(offload.offload_choices())
