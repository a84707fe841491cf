"""Step time: the planner's time model on this device (calibrated by micro-benchmarks) vs the trainer.

The device is measured first (`train.calibration.measured_cluster`: the model's GEMMs on cold
operands, the attention core in the run's dtype, the block's element-wise ops, a one-token step
for the per-micro-batch dispatch, and the optimizer step); the planner then predicts each
configuration's step from FLOPs and bytes at those achieved rates (the measured device's
calibration), with the runtime's stack at the costs measured on it (`Stack.on_device`).
"""

from __future__ import annotations

from llmscale.bench.report import Row, SuiteResult
from llmscale.bench.runner import BenchOptions, measure
from llmscale.config import JobConfig
from llmscale.model.config import get_preset
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.predict import predict_step_time
from llmscale.plan.time import DEFAULT_TIME, TimeParams, time_params
from llmscale.train.calibration import measured_cluster
from llmscale.train.trainer import resolve_device

CONFIGS = (("fp32", 4), ("fp32", 16), ("bf16", 4), ("bf16", 16))
# Timed steps per configuration at least; each row is the fastest of them, as each
# micro-benchmark of the calibration is the fastest of its trials: both sides are the machine
# undisturbed by the other work on it.
TIMED_STEPS = 6


def calibrated(
    opts: BenchOptions, micro_batch: int, precision: str = "fp32"
) -> tuple[Cluster, TimeParams, dict[str, float]]:
    """The measured device and the time parameters that go with it: the runtime's kernels on it,
    its stack at the costs measured there (attention measured in `precision`)."""
    device = resolve_device(opts.device)
    model = get_preset(opts.model)
    # The run's dtype, and fp32 and bf16 (the GPU check's CPU mode reads the bf16 rate); fp16
    # GEMMs run at a few GFLOP/s on a CPU and are measured only for fp16 runs.
    dtypes = tuple(dict.fromkeys(("fp32", "bf16", precision)))
    cluster, costs, figures = measured_cluster(
        model, micro_batch, opts.seq_len, device, dtypes=dtypes, precision=precision
    )
    kernels = act.Kernels.for_runtime(model, 1, device.type)  # the suites run one process
    stack = DEFAULT_TIME.stack.on_device(costs)
    params = time_params(stack, kernels)
    return cluster, params, figures


def predicted_seconds(cfg: JobConfig, cluster: Cluster, params: TimeParams) -> float:
    return predict_step_time(cfg, cluster, params).seconds


def run(opts: BenchOptions) -> SuiteResult:
    res = SuiteResult(
        "time",
        f"Step time, model {opts.model}, seq {opts.seq_len}: planner on the measured device vs trainer",
    )
    calib_rows = []
    for precision, mbs in CONFIGS:
        cluster, params, figures = calibrated(opts, mbs, precision)
        cfg = opts.job(
            "--precision.mode", precision, "--train.micro_batch_size", str(mbs),
            "--train.global_batch_size", str(mbs),
            "--train.steps", str(max(opts.steps, TIMED_STEPS) + opts.warmup),
            run=f"time-{precision}-{mbs}",
        )  # fmt: skip
        m = measure(cfg, opts.warmup)
        pred = predict_step_time(cfg, cluster, params)
        parts = ", ".join(f"{k} {1000 * v:.0f}" for k, v in pred.breakdown.items() if v > 0)
        res.rows.append(
            Row(
                "time",
                f"{precision} mbs={mbs}",
                "step time",
                "s",
                m.min_step_time_s,
                pred.seconds,
                f"ms: {parts}",
            )
        )
        calib_rows.append(
            [
                f"{precision} mbs={mbs}",
                f"{figures['gemm_' + precision + '_flops'] / 1e9:.1f}",
                f"{figures['bandwidth_bytes'] / 1e9:.1f}",
            ]
        )
    res.notes.append(
        "The device is micro-benchmarked on the runtime's own kernels (train/calibration.py): "
        "the model's GEMMs on cold operands, the attention core in the run's dtype, the block's "
        "element-wise ops (their bandwidth net of the same ops on one token, whose fixed cost "
        "is the dispatch's), the one-token forward and backward (dispatch) and the optimizer "
        "step. The planner then prices each configuration's GEMMs, attention, element-wise "
        "bytes, dispatch and optimizer at those rates. Measured is the fastest of "
        f"{TIMED_STEPS} or more steps, as each micro-benchmark keeps its fastest trial: step "
        "times on this shared 2-core machine vary by 10-30% from run to run; the same model is validated against published GPU "
        "results in bench/published.py, and on an H100/H200 by bench/gpu.sh."
    )
    res.tables["measured device (micro-benchmarks)"] = (
        ["configuration", "GEMM GFLOP/s", "elementwise GB/s"],
        calib_rows,
    )
    return res
