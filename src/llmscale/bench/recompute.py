"""Recomputation's time overhead: measured step times vs the planner's prediction.

Full recomputation costs ~33% extra compute (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost", arXiv:1604.06174; quoted by the article "Distributed Solutions: Practical Approaches
to Scale LLM Compute, Part 2"): one more forward of the blocks on top of forward + backward
(3 forward-equivalents become 4). Measured here as the fastest step of
each mode over the fastest step without recomputation, on the same batches. selective_op (op-level
checkpointing) recomputes the unsaved matmuls and element-wise ops; its policy runs as a Python
dispatch mode over every op of the block, forward and recompute, a per-op cost that small models
on a CPU feel most.
"""

from __future__ import annotations

from llmscale.bench.report import Row, SuiteResult, predicted_vs_measured_bars
from llmscale.bench.runner import BenchOptions, png_path
from llmscale.bench.timing import calibrated, predicted_seconds
from llmscale.model.config import get_preset
from llmscale.plan.plan import Plan
from llmscale.plan.time import recompute_fraction
from llmscale.train.trainer import Trainer

MODES = ("none", "selective", "selective_op", "every_k", "full")
MICRO_BATCH = 8
ROUNDS = 2  # passes over the modes, each of warm-up + timed steps


def run(opts: BenchOptions) -> SuiteResult:
    res = SuiteResult(
        "recompute",
        f"Recompute time overhead, model {opts.model}, mbs {MICRO_BATCH} x seq {opts.seq_len}, fp32",
    )
    cluster, params, _ = calibrated(opts, MICRO_BATCH)
    model = get_preset(opts.model)
    trainers: dict[str, Trainer] = {}
    predicted: dict[str, float] = {}
    flops: dict[str, float] = {}
    for mode in MODES:
        cfg = opts.job(
            "--train.recompute", mode, "--train.micro_batch_size", str(MICRO_BATCH),
            "--train.global_batch_size", str(MICRO_BATCH),
            "--train.steps", str(ROUNDS * (opts.steps + opts.warmup)), run=f"recompute-{mode}",
        )  # fmt: skip
        trainers[mode] = Trainer(cfg)
        predicted[mode] = predicted_seconds(cfg, cluster, params)
        flops[mode] = model.train_flops_per_token(
            opts.seq_len, recompute_fraction(Plan.from_job(cfg))
        )
    # Round-robin over the modes, so that a slow spell of the machine hits all of them alike;
    # each mode's time is its fastest step.
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(ROUNDS * (opts.steps + opts.warmup)):
        for mode, t in trainers.items():
            dt = t.train_step()["step_time_s"]
            if r >= opts.warmup:
                times[mode].append(dt)
    measured = {m: min(v) for m, v in times.items()}
    for mode in MODES[1:]:
        ratio_m = measured[mode] / measured["none"]
        ratio_p = predicted[mode] / predicted["none"]
        over_f = 100 * (flops[mode] / flops["none"] - 1)
        res.rows.append(
            Row(
                "recompute",
                f"recompute={mode}",
                "step time / none",
                "x",
                ratio_m,
                ratio_p,
                f"FLOPs alone: +{over_f:.1f}%",
            )
        )
    res.tables["step times (fastest step)"] = (
        ["mode", "measured", "predicted", "extra FLOPs"],
        [
            [
                m,
                f"{1000 * measured[m]:.0f} ms",
                f"{1000 * predicted[m]:.0f} ms",
                f"+{100 * (flops[m] / flops['none'] - 1):.1f}%",
            ]
            for m in MODES
        ],
    )
    res.notes.append(
        "Full recomputation runs the blocks' forward twice: +33% FLOPs by the count (3 forward-equivalents become 4), "
        f"measured here x{measured['full'] / measured['none']:.3f} of the step time."
    )
    path = png_path(opts, "recompute_overhead.png")
    if path is not None:
        res.figures.append(
            predicted_vs_measured_bars(
                [r.config.split("=")[1] for r in res.rows],
                [100 * ((r.predicted or 1) - 1) for r in res.rows],
                [100 * (r.measured - 1) for r in res.rows],
                path,
                f"recompute overhead, {opts.model}",
                "extra step time vs none (%)",
            )
        )
    return res
