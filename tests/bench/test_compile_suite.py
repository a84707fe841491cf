"""`llmscale bench --what compile` on the tiny model: its rows, not its timings."""

from __future__ import annotations

import math
import os

import pytest

from llmscale.bench import compile as compile_suite
from llmscale.bench.report import markdown
from llmscale.bench.runner import BenchOptions
from llmscale.bench.suites import get_suite


@pytest.mark.slow
@pytest.mark.timeout(600)  # a cold compile: 10-20 s on an idle 2-core machine, minutes if busy
def test_compile_suite_rows(tmp_path, monkeypatch) -> None:
    configs = (("fp32", 4),)  # one configuration: each costs a cold compile
    monkeypatch.setattr(compile_suite, "CONFIGS", configs)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    opts = BenchOptions(
        model="tiny", seq_len=32, steps=2, warmup=1, device="cpu", data_files=8,
        work_dir=tmp_path,
    )  # fmt: skip
    res = get_suite("compile")(opts)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before  # restored
    assert (tmp_path / "inductor-cache").is_dir()  # compiled into its own, cold, cache
    steps = {r.config: r for r in res.rows if r.quantity == "step time"}
    assert len(steps) == 2 * len(configs)
    assert all(r.measured > 0 and r.predicted > 0 for r in steps.values())
    for precision, mbs in configs:
        name = f"{precision} mbs={mbs}"
        eager, comp = steps[f"{name} eager"], steps[f"{name} compiled"]
        assert comp.predicted < eager.predicted  # fused element-wise kernels
    compile_rows = [r for r in res.rows if r.quantity.startswith("compile time")]
    assert len(compile_rows) == len(configs)
    assert all(math.isfinite(r.measured) and r.measured > 0 for r in compile_rows)
    assert "| fp32 mbs=4 compiled | step time |" in markdown([res], header="# results")
