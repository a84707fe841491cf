"""Memory: parameters, gradients, optimizer states and activations, predicted vs measured.

Measured by the trainer itself: the bytes of parameter, gradient and optimizer-state storages,
and the bytes autograd saves for backward during the first micro-batch's forward (counted with
`saved_tensors_hooks`, each storage once; checkpointed regions count as the inputs they keep).
On CUDA the allocator's peak over the step is compared too. Predicted by the planner's
per-tensor model (`plan.predict.expected_runtime_metrics`).
"""

from __future__ import annotations

from llmscale.bench.report import Row, SuiteResult, predicted_vs_measured_bars
from llmscale.bench.runner import BenchOptions, measure, png_path
from llmscale.model.config import get_preset
from llmscale.plan import activations as act
from llmscale.plan.memory import MemoryOptions
from llmscale.plan.predict import expected_runtime_metrics, predict_memory
from llmscale.train.trainer import resolve_device

RECOMPUTE = ("none", "selective", "selective_op", "every_k", "full")
MICRO_BATCHES = (1, 4)
STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")


def memory_options(opts: BenchOptions) -> MemoryOptions:
    """The planner's kernel facts for the runtime where the benchmark runs (one process)."""
    device = resolve_device(opts.device).type
    return MemoryOptions(kernels=act.Kernels.for_runtime(get_preset(opts.model), 1, device))


def run(opts: BenchOptions) -> SuiteResult:
    res = SuiteResult(
        "memory",
        f"Memory per device, model {opts.model}, seq {opts.seq_len}: predicted vs measured",
    )
    options = memory_options(opts)
    bars: list[tuple[str, float, float]] = []
    for precision in ("fp32", "bf16"):
        for mbs in MICRO_BATCHES:
            for mode in RECOMPUTE:
                cfg = opts.job(
                    "--precision.mode", precision, "--train.recompute", mode,
                    "--train.micro_batch_size", str(mbs), "--train.global_batch_size", str(mbs),
                    "--train.steps", "1", run=f"mem-{precision}-{mbs}-{mode}",
                )  # fmt: skip
                got = measure(cfg, warmup=0).last
                want = expected_runtime_metrics(cfg, options=options)
                label = f"{precision} mbs={mbs} recompute={mode}"
                if mode == "none" and mbs == MICRO_BATCHES[0]:
                    for key in STATES:
                        res.rows.append(
                            Row(
                                "memory",
                                f"{precision} (any mbs, any recompute)",
                                key.removesuffix("_bytes"),
                                "B",
                                got[key],
                                want[key],
                            )
                        )
                res.rows.append(
                    Row(
                        "memory",
                        label,
                        "activations",
                        "B",
                        got["activation_bytes"],
                        want["activation_bytes"],
                    )
                )
                if "cuda_peak_bytes" in got:
                    res.rows.append(
                        Row(
                            "memory",
                            label,
                            "CUDA peak",
                            "B",
                            got["cuda_peak_bytes"],
                            want["cuda_peak_bytes"],
                        )
                    )
                bars.append(
                    (
                        f"{precision}\nb={mbs}\n{mode}",
                        want["activation_bytes"],
                        got["activation_bytes"],
                    )
                )
    for precision in ("fp32", "bf16"):
        cfg = opts.job(
            "--precision.mode", precision, "--optimizer.offload", "optimizer",
            "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
            "--train.steps", "1", run=f"mem-offload-{precision}",
        )  # fmt: skip
        got = measure(cfg, warmup=0).last
        want = expected_runtime_metrics(cfg, options=options)
        stage = predict_memory(cfg, options).per_rank[0]
        label = f"{precision} mbs=4 offload=optimizer"
        res.rows.append(
            Row(
                "memory",
                label,
                "device optimizer + master",
                "B",
                got["device_optimizer_bytes"] + got["device_master_bytes"],
                0.0,
            )
        )
        res.rows.append(
            Row(
                "memory",
                label,
                "host master + moments",
                "B",
                got["host_master_bytes"] + got["host_optimizer_bytes"],
                stage.host,
                "12 B/param + 4 B/tensor",
            )
        )
        for key in ("param_bytes", "grad_bytes", "activation_bytes"):
            res.rows.append(
                Row(
                    "memory",
                    label,
                    key.removesuffix("_bytes").replace("activation", "activations"),
                    "B",
                    got[key],
                    want[key],
                )
            )
    worst = max(
        abs(r.ratio - 1) for r in res.rows if r.quantity == "activations" and r.ratio is not None
    )
    res.notes.append(
        f"largest activation error: {100 * worst:.2f}% (goal: within 3%); states are exact when every ratio reads 1.000"
    )
    path = png_path(opts, "memory_activations.png")
    if path is not None:
        res.figures.append(
            predicted_vs_measured_bars(
                [b[0] for b in bars],
                [b[1] / 2**20 for b in bars],
                [b[2] / 2**20 for b in bars],
                path,
                f"saved activations per micro-batch, {opts.model}, seq {opts.seq_len}",
                "MiB",
                "measured (saved_tensors_hooks)",
            )
        )
    return res
