"""Context parallelism: the planner's step time for cp = 2 vs the trainer's, on 2 CPU ranks.

Two layouts of the same work on 2 ranks (gloo, one thread each): cp = 2 (each rank holds half of
every sequence, ring attention, gradients all-reduced over the cp ranks) and its baseline,
dp_replicate = 2 with the same global batch (each rank holds whole sequences, SDPA). Every rank
sees b x s tokens per micro-batch in both.

Each repetition first measures the device on both ranks at once, so that the figures see the
two ranks sharing the machine's cores and memory as they do when they train (bench/cp_worker.py:
train/calibration.py's GEMMs, attention, element-wise bandwidth, per-micro-batch and optimizer
costs for one rank's micro-batch; the runtime's ring blocks at cp = 2's chunk size, `ring_
attention_flops_per_s`; and the link between the ranks, a ring pass over gloo at two sizes,
`instrument.calibrate.measured_link`), then trains both layouts, in alternating order. The
planner predicts each repetition's two steps from that repetition's figures. Measured is each
run's fastest timed step (as each micro-benchmark keeps its fastest trial); the rows give the
medians over the repetitions of measured and of predicted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmscale.bench.report import Row, SuiteResult
from llmscale.bench.runner import BenchOptions
from llmscale.config import JobConfig, to_toml
from llmscale.instrument import calibrate
from llmscale.model.config import get_preset
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.predict import predict_step_time
from llmscale.plan.time import DEFAULT_TIME, StepTime, TimeParams
from llmscale.plan.time import time_params as stack_time_params
from llmscale.train import calibration
from llmscale.train.metrics import read_jsonl

SUITE = "cp"
CP = 2
MICRO_BATCH = 2  # sequences per rank per micro-batch in the baseline (cp = 2: CP x as many)
TIMED_STEPS = 6  # at least, per run


@dataclass(frozen=True)
class Layout:
    name: str
    label: str
    args: tuple[str, ...]


LAYOUTS = (
    Layout("dp2", f"dp_replicate=2, b={MICRO_BATCH}",
           ("--parallel.dp_replicate", "2", "--train.micro_batch_size", str(MICRO_BATCH))),
    Layout("cp2", f"cp={CP}, b={CP * MICRO_BATCH}",
           ("--parallel.cp", str(CP), "--train.micro_batch_size", str(CP * MICRO_BATCH))),
)  # fmt: skip


def job(opts: BenchOptions, layout: Layout, rep: int, min_steps: int = TIMED_STEPS) -> JobConfig:
    """One run of `layout`: same global batch (2 b sequences) on 2 ranks, fp32, on the CPU."""
    return opts.job(
        "--job.device", "cpu", *layout.args,
        "--train.global_batch_size", str(CP * MICRO_BATCH),
        "--train.steps", str(max(opts.steps, min_steps) + opts.warmup),
        "--train.eval_sequences", "0", "--metrics.activation_memory", "false",
        run=f"{layout.name}-{rep}",
    )  # fmt: skip


DISPLAY = "this CPU, 2 ranks of 1 thread (measured)"


def cluster_of(figures: dict[str, float]) -> Cluster:
    """The measured device of one repetition: one rank's rates, its ring blocks, the link."""
    cluster = calibration.cluster_from(figures, "fp32", DISPLAY)
    cluster = calibration.with_ring_attention(cluster, figures["ring_attention_flops"])
    return calibrate.with_link(cluster, figures, "gloo between 2 local ranks (measured)")


def time_params(opts: BenchOptions, figures: dict[str, float]) -> TimeParams:
    """The runtime's CPU kernels, its stack at the costs one repetition's `figures` measured
    (on a CPU nothing of the ranks' traffic hidden: `calibration.CPU_COMM_OVERLAP`)."""
    model = get_preset(opts.model)
    kernels = act.Kernels.for_runtime(model, 1, "cpu")
    stack = DEFAULT_TIME.stack.on_device(calibration.device_costs(figures, model, DISPLAY))
    return stack_time_params(stack, kernels)


def fastest_step(cfg: JobConfig, warmup: int) -> float:
    rows = [r for r in read_jsonl(Path(cfg.job.run_dir) / "metrics.jsonl") if r["kind"] == "train"]
    timed = rows[warmup:] or rows
    return float(min(r["step_time_s"] for r in timed))


def run(
    opts: BenchOptions,
    repetitions: int | None = None,
    min_steps: int = TIMED_STEPS,
    effort: calibration.Effort = calibration.BENCH,
) -> SuiteResult:
    """Both layouts, `repetitions` times (default: opts.seeds, at least 3), each run at least
    `min_steps` timed steps, the device measured at `effort` before each repetition."""
    reps = repetitions if repetitions is not None else max(3, opts.seeds)
    runs: list[list[JobConfig]] = []
    for rep in range(reps):
        order = LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]
        runs.append([job(opts, layout, rep, min_steps) for layout in order])
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    _launch(opts, runs, effort)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()

    measured: dict[str, list[float]] = {x.name: [] for x in LAYOUTS}
    predicted: dict[str, list[StepTime]] = {x.name: [] for x in LAYOUTS}
    links = []
    for rep, cfgs in enumerate(runs):
        path = opts.work_dir / "cp" / f"calibration-{rep}.json"
        figures = {k: float(v) for k, v in json.loads(path.read_text()).items()}
        cluster, params = cluster_of(figures), time_params(opts, figures)
        links.append(figures)
        for cfg in cfgs:
            name = Path(cfg.job.run_dir).name.rsplit("-", 1)[0]
            measured[name].append(fastest_step(cfg, opts.warmup))
            predicted[name].append(predict_step_time(cfg, cluster, params))

    res = SuiteResult(
        SUITE,
        f"Context parallelism: step time, planner on the measured ranks vs trainer ({opts.model}, "
        f"seq {opts.seq_len}, 2 CPU ranks)",
    )
    for layout in LAYOUTS:
        preds = predicted[layout.name]
        median_pred = statistics.median(p.seconds for p in preds)
        mid = min(preds, key=lambda p: abs(p.seconds - median_pred))
        parts = ", ".join(f"{k} {1000 * v:.1f}" for k, v in mid.breakdown.items() if v > 0)
        res.rows.append(
            Row(SUITE, layout.label, "step time", "s", statistics.median(measured[layout.name]),
                median_pred, f"ms: {parts}")
        )  # fmt: skip
    # cp's step over the baseline's, per repetition: what the ring adds, with the device's
    # general rates (and the load they were measured under) common to both layouts.
    base, ring = LAYOUTS[0].name, LAYOUTS[1].name
    meas_ratio = [c / b for c, b in zip(measured[ring], measured[base], strict=True)]
    pred_ratio = [
        c.seconds / b.seconds for c, b in zip(predicted[ring], predicted[base], strict=True)
    ]
    res.rows.append(
        Row(SUITE, f"{LAYOUTS[1].label} over {LAYOUTS[0].label}", "step time ratio", "x",
            statistics.median(meas_ratio), statistics.median(pred_ratio),
            "median over repetitions of each one's ratio: the ring's cost over SDPA's")
    )  # fmt: skip
    res.tables["per repetition (ms): measured / predicted step; measured link"] = (
        ["repetition", *(x.label for x in LAYOUTS), "ring GFLOP/s", "p2p latency", "p2p GB/s"],
        [
            [
                str(rep),
                *(
                    f"{1000 * measured[x.name][rep]:.0f} / "
                    f"{1000 * predicted[x.name][rep].seconds:.0f}"
                    for x in LAYOUTS
                ),
                f"{links[rep]['ring_attention_flops'] / 1e9:.2f}",
                f"{1e6 * links[rep]['p2p_latency_s']:.0f} us",
                f"{links[rep]['p2p_bytes_per_s'] / 1e9:.2f}",
            ]
            for rep in range(reps)
        ],
    )
    res.notes += [
        f"{reps} repetitions, each: the device measured on both ranks at once (GEMMs, "
        "attention, element-wise bandwidth, fixed costs, optimizer for one rank's micro-batch; "
        "the runtime's ring blocks at cp = 2's chunk size; a ring pass over gloo at "
        f"{calibrate.P2P_SIZES[0] // 1024} KiB and {calibrate.P2P_SIZES[1] // 2**20} MiB), then "
        f"both layouts trained for {opts.warmup} warm-up + {min_steps} or more steps, their "
        "order alternating. Measured: each run's fastest step; rows: medians over the "
        "repetitions of measured and of predicted (each from its repetition's figures).",
        f"Load average (1, 5, 15 min) before {_load(load_before)}, after {_load(load_after)} "
        f"({wall:.0f} s of runs) on {os.cpu_count()} cores: other work on the machine slows "
        "the ranks unevenly, and every ring pass waits for the slower one.",
    ]
    return res


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def _launch(opts: BenchOptions, runs: list[list[JobConfig]], effort: calibration.Effort) -> None:
    folder = opts.work_dir / "cp"
    folder.mkdir(parents=True, exist_ok=True)
    repetitions = []
    for cfgs in runs:
        paths = []
        for cfg in cfgs:
            path = folder / f"{Path(cfg.job.run_dir).name}.toml"
            path.write_text(to_toml(cfg))
            paths.append(str(path))
        repetitions.append(paths)
    spec = folder / "spec.json"
    spec.write_text(json.dumps({
        "model": opts.model, "micro_batch": MICRO_BATCH, "cp_micro_batch": CP * MICRO_BATCH,
        "seq_len": opts.seq_len, "cp": CP,
        "out": str(folder), "repetitions": repetitions,
        "effort": [effort.trials, effort.min_seconds],
    }))  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "2", "-m", "llmscale.bench.cp_worker", str(spec),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(
            f"cp bench: torchrun failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        )
