"""Regional compilation (train.compile): step time with and without, compile time apart.

Per configuration the same job trains eager and compiled, side by side in one process, a step
of each in turn (so other work on a shared machine slows both alike). The compiled job's first
step pays the compilation (dynamo tracing and inductor's code generation for the block's
forward and backward; its other steps reuse the graph), so it is reported apart: the first
step's time less the steady step's. Steady step times are medians of the steps after the warm-up, each
next to the planner's prediction on the measured device (`timing.calibrated`), eager and with
`TimeParams.compiled` (the blocks' element-wise traffic as fused kernels). Inductor's on-disk
cache is a fresh folder under the bench's work folder, so the compile time is a cold compile.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

from llmscale.bench.report import Row, SuiteResult
from llmscale.bench.runner import BenchOptions
from llmscale.bench.timing import calibrated
from llmscale.plan.predict import predict_step_time
from llmscale.train.trainer import Trainer

CONFIGS = (("fp32", 4), ("bf16", 4))


def _trainer(opts: BenchOptions, precision: str, mbs: int, compiled: bool) -> Trainer:
    cfg = opts.job(
        "--precision.mode", precision, "--train.micro_batch_size", str(mbs),
        "--train.global_batch_size", str(mbs), "--train.compile", str(compiled).lower(),
        "--train.eval_sequences", "0",
        run=f"compile-{precision}-{mbs}-{'on' if compiled else 'off'}",
    )  # fmt: skip
    return Trainer(cfg)


def _steps(opts: BenchOptions, precision: str, mbs: int) -> dict[bool, list[float]]:
    """Step times (every step, the first included) of the eager and the compiled job, their
    steps taken in turn so that other work on the machine slows both alike."""
    import torch

    torch._dynamo.reset()  # the compiled job compiles from scratch (no graph kept in memory)
    trainers = {c: _trainer(opts, precision, mbs, c) for c in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(opts.steps + max(opts.warmup, 1)):
            for compiled, t in trainers.items():
                times[compiled].append(float(t.train_step()["step_time_s"]))
    finally:
        for t in trainers.values():
            t.close()
    return times


def run(opts: BenchOptions) -> SuiteResult:
    res = SuiteResult(
        "compile",
        f"Regional compilation, model {opts.model}, seq {opts.seq_len}: eager vs train.compile",
    )
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(opts.work_dir / "inductor-cache")
    try:
        _measure(opts, res)
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    return res


def _measure(opts: BenchOptions, res: SuiteResult) -> None:
    warm = max(opts.warmup, 1)  # the compiled job's first step is never a steady one
    table = []
    for precision, mbs in CONFIGS:
        cluster, params, _ = calibrated(opts, mbs, precision)
        name = f"{precision} mbs={mbs}"
        steady, first = {}, {}
        both = _steps(opts, precision, mbs)
        for compiled in (False, True):
            times = both[compiled]
            first[compiled] = times[0]
            steady[compiled] = statistics.median(times[warm:] or times)
            cfg = opts.job("--precision.mode", precision, "--train.micro_batch_size", str(mbs),
                           "--train.global_batch_size", str(mbs))  # fmt: skip
            pred = predict_step_time(cfg, cluster, dataclasses.replace(params, compiled=compiled))
            label = "compiled" if compiled else "eager"
            elem = 1000 * pred.breakdown["elementwise"]
            res.rows.append(
                Row("compile", f"{name} {label}", "step time", "s", steady[compiled],
                    pred.seconds, f"elementwise {elem:.1f} ms predicted")
            )  # fmt: skip
        res.rows.append(
            Row("compile", name, "compile time (first step - steady)", "s",
                max(first[True] - steady[True], 0.0))
        )  # fmt: skip
        table.append(
            [
                name,
                f"{1000 * first[False]:.0f}",
                f"{1000 * steady[False]:.1f}",
                f"{first[True]:.2f}",
                f"{1000 * steady[True]:.1f}",
                f"{steady[False] / steady[True]:.2f}",
            ]
        )
    res.tables["eager vs compiled, measured"] = (
        [
            "configuration",
            "eager first step ms",
            "eager steady ms",
            "compiled first step s",
            "compiled steady ms",
            "speed-up",
        ],
        table,
    )
    res.notes.append(
        "train.compile compiles each transformer block with torch.compile (parallel/compile.py); "
        "one compiled graph serves every block. The first compiled step includes the cold "
        "compile of the forward and backward; steady steps are medians after the warm-up. The "
        "planner's compiled variant prices the blocks' element-wise ops as fused kernels "
        "(plan/time.py compiled_block_bytes); it does not model the per-op dispatch a compiled "
        "block saves on a CPU. Step times on this shared 2-core machine vary by 10-30% from run "
        "to run."
    )
