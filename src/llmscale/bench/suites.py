"""The benchmark suites by name; each module has `run(opts: BenchOptions) -> SuiteResult`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI lists the suites without importing torch
    from llmscale.bench.report import SuiteResult
    from llmscale.bench.runner import BenchOptions

SUITES: dict[str, str] = {
    "memory": "llmscale.bench.memory",
    "time": "llmscale.bench.timing",
    "recompute": "llmscale.bench.recompute",
    "accum": "llmscale.bench.accum",
    "precision": "llmscale.bench.precision",
    "pipeline": "llmscale.bench.pipeline",
    "published": "llmscale.bench.published",
    "loader": "llmscale.bench.loader",
    "compile": "llmscale.bench.compile",
    "finetune": "llmscale.bench.finetune",
    "cp": "llmscale.bench.cp",
    "zero": "llmscale.bench.zero",
}


def get_suite(name: str) -> Callable[[BenchOptions], SuiteResult]:
    fn: Callable[[BenchOptions], SuiteResult] = importlib.import_module(SUITES[name]).run
    return fn
