"""Pipeline suite: the bubble of real pipeline-parallel runs next to the schedule simulator's.

Each configuration (pp, schedule, micro-batches) trains for `warmup + steps` steps on CPU
processes (gloo, one thread each) with `[metrics] pipeline_timeline` on, which records when each
rank ran each forward and backward chunk (`instrument/pipeline.py`). Per timed step the measured
bubble is 1 - sum(busy) / (pp x makespan), the simulator's definition, over the first op start
to the last op end. The prediction is `plan.schedule.simulate` fed with what was measured: the
mean forward and backward op time of every stage, and as `t_p2p` the median wait on another
rank's output (see `p2p_gaps`). The closed form assumes equal stages and free p2p. The
measured per-rank op order is compared with the simulator's op by op.

All configurations of one world size run in one torchrun group (start-up and rendezvous cost
more than a short run).
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

from llmscale.bench.report import Row, SuiteResult, half_iqr
from llmscale.bench.runner import BenchOptions, png_path
from llmscale.config import SPLIT_BACKWARD_SCHEDULES, pipeline_chunks, to_toml
from llmscale.instrument.pipeline import FILE_NAME
from llmscale.parallel.timeline import (
    OpRecord,
    PipelineTimeline,
    StepStats,
    as_sim_result,
    p2p_gaps,
    replay,
    slack_fraction,
    stage_kind_times,
    step_stats,
)
from llmscale.plan import activations as act
from llmscale.plan.memory import (
    MemoryOptions,
    inflight_units,
    pipeline_held,
    rank_activation_bytes,
)
from llmscale.plan.predict import as_plan
from llmscale.plan.schedule import Op, SimResult, bubble_fraction, schedule_ops, simulate
from llmscale.report.gantt import draw_gantts_png
from llmscale.train.metrics import read_jsonl

SUITE = "pipeline"
N_LAYERS = 8  # every split below is even: pp x chunks divides 8
MICRO_BATCH = 1  # sequences per micro-batch


@dataclass(frozen=True)
class PipeConfig:
    """One pipeline run: degree, schedule, micro-batches per step."""

    pp: int
    schedule: str
    microbatches: int

    @property
    def chunks(self) -> int:
        return pipeline_chunks(self.schedule, 2)

    @property
    def name(self) -> str:
        return f"pp{self.pp}-{self.schedule}-m{self.microbatches}"

    @property
    def label(self) -> str:
        sched = {"interleaved_1f1b": "interleaved v=2", "zero_bubble": "zero_bubble v=2"}.get(
            self.schedule, self.schedule
        )
        return f"pp={self.pp} {sched} m={self.microbatches}"


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# The split-backward schedules (B and W apart), at the micro-batch counts the Gantt charts draw.
SPLIT_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")
CONFIGS: tuple[PipeConfig, ...] = tuple(
    PipeConfig(pp, s, m) for pp, ms in ((2, (2, 4, 8)), (4, (4, 8))) for s in SCHEDULES for m in ms
) + tuple(PipeConfig(pp, s, m) for pp, m in ((2, 4), (4, 8)) for s in SPLIT_SCHEDULES)
# Drawn when opts.png_dir is set: measured above simulated, one figure per pipeline degree.
GANTT_M = {2: 4, 4: 8}


@dataclass
class Measured:
    """What one configuration's timed steps gave, and the simulator's replay of it."""

    cfg: PipeConfig
    stats: list[StepStats]
    median_step: int  # index into stats of the step with the median bubble
    timeline: PipelineTimeline
    steps: list[int]
    t_fwd: list[float]
    t_bwd: list[float]
    t_p2p: float
    slack: float  # median share of rank-time idle with the next op's inputs there
    replayed: float  # median bubble of the simulator replaying each step's measured op times
    sim: SimResult
    order_ok: bool
    order_diff: str
    peak_bytes: float  # the memory run's saved-activation peak on stage 0 (its last step)
    predicted_peak_bytes: float  # the planner's: in-flight units x one micro-batch's bytes
    inflight: int  # the planner's in-flight units on stage 0
    held: dict[str, tuple[float, float]]  # stage 0's PipelineMemory metrics: measured, planner

    @property
    def bubble(self) -> float:
        return statistics.median(s.bubble_fraction for s in self.stats)

    @property
    def bubble_spread(self) -> float | None:
        """Half the interquartile range of the steps' bubbles (`half_iqr`)."""
        return half_iqr([s.bubble_fraction for s in self.stats])

    @property
    def makespan(self) -> float:
        return statistics.median(s.makespan for s in self.stats)


def run(opts: BenchOptions, configs: tuple[PipeConfig, ...] = CONFIGS) -> SuiteResult:
    """Run every configuration under torchrun, then compare each with the simulator."""
    t0 = time.perf_counter()
    for pp in sorted({c.pp for c in configs}):
        _launch(opts, pp, [c for c in configs if c.pp == pp])
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]  # over the last minute: others' processes share the cores too
    results = [analyse(opts, c) for c in configs]

    res = SuiteResult(
        SUITE,
        f"Pipeline bubble and in-flight activations: measured (CPU, gloo) vs schedule simulator "
        f"and planner ({opts.model})",
    )
    for m in results:
        c = m.cfg
        order = "order = simulator" if m.order_ok else f"order differs: {m.order_diff}"
        order += f"; {100 * m.slack:.1f}% idle with inputs ready"
        bubble_spread = m.bubble_spread
        spread = None if bubble_spread is None else 100 * bubble_spread
        res.rows += [
            Row(SUITE, c.label, "bubble (simulator)", "%", 100 * m.bubble,
                100 * m.sim.bubble_fraction, order, spread),
            Row(SUITE, c.label, "bubble (closed form)", "%", 100 * m.bubble,
                100 * bubble_fraction(c.schedule, c.pp, c.microbatches, c.chunks),
                "equal stages, free p2p", spread),
            Row(SUITE, c.label, "makespan", "s", m.makespan, m.sim.makespan,
                f"median of {len(m.stats)} steps"),
            Row(SUITE, c.label, "activations in flight, stage 0", "B", m.peak_bytes,
                m.predicted_peak_bytes,
                f"{m.inflight} units of 1/{c.chunks} stage x one micro-batch (planner)"),
            Row(SUITE, c.label, "receive buffers, stage 0", "B",
                *m.held["pipeline_buffer_bytes"],
                "an activation and a gradient per micro-batch and stage, as received"),
        ]  # fmt: skip
        if c.schedule in SPLIT_BACKWARD_SCHEDULES:
            res.rows.append(
                Row(SUITE, c.label, "kept from B for W, stage 0", "B",
                    *m.held["pending_weight_grad_bytes"],
                    "peak: output gradients at W's ops until W, input gradients until the end")
            )  # fmt: skip
    res.tables["measured op times fed to the simulator (ms, per stage)"] = (
        [
            "configuration",
            "forward",
            "backward",
            "p2p wait",
            "idle, inputs ready",
            "bubble, replayed",
        ],
        [
            [
                m.cfg.label,
                " ".join(f"{1000 * t:.1f}" for t in m.t_fwd),
                " ".join(f"{1000 * t:.1f}" for t in m.t_bwd),
                f"{1000 * m.t_p2p:.2f}",
                f"{100 * m.slack:.1f}%",
                f"{100 * m.replayed:.1f}%",
            ]
            for m in results
        ],
    )
    res.notes += [
        f"Model {opts.model} with n_layers={N_LAYERS}, seq {opts.seq_len}, micro-batch "
        f"{MICRO_BATCH} sequence, fp32, one thread per rank; {opts.warmup} warm-up + "
        f"{opts.steps} timed steps per configuration, measured = their median ({wall:.0f} s "
        "of runs). Predicted = simulate() fed with the measured mean forward and backward "
        "time of each stage and, as t_p2p, the median measured wait on another rank's output "
        "(p2p wait: send, receive and the schedule's bookkeeping).",
        "The simulator is given the measured busy time, so its bubble differs from the "
        "measured one only through the makespan. Two things lengthen the measured one: idle "
        "with the next op's inputs already there (Python between ops, p2p beyond the median, "
        "a rank waiting for a core), and ops that vary in time (a slow op on the critical "
        "path delays every rank; a fast one elsewhere gives nothing back). 'bubble, replayed' "
        "is the simulator run on each measured step with every op's own measured time and "
        "the measured order: it keeps the variation and drops the idle.",
        f"CPU caveat: this machine has {os.cpu_count()} cores, shared with other work (load "
        f"average {load:.1f} after the runs). At pp = 4 four ranks share them: ranks run by "
        "turns, op times inflate and vary, and a waiting rank lends its core to the others, "
        "which GPU ranks do not do. The pp = 4 rows check orders and dependencies more than "
        "GPU-like timing.",
    ]
    if opts.device == "cuda":
        res.notes.append("--device cuda: this suite runs its pipelines on CPU ranks (gloo).")
    if opts.png_dir is not None:
        for pp, m_draw in GANTT_M.items():
            drawn = [m for m in results if m.cfg.pp == pp and m.cfg.microbatches == m_draw]
            if drawn:
                res.figures.append(_draw(opts, pp, m_draw, drawn))
    return res


# ---- running ------------------------------------------------------------------------------


def job_args(c: PipeConfig) -> list[str]:
    """The overrides of one configuration's job (on top of `BenchOptions.job`'s)."""
    return [
        "--job.device", "cpu",
        "--model.n_layers", str(N_LAYERS), "--model.tie_embeddings", "false",
        "--parallel.pp", str(c.pp), "--parallel.pp_schedule", c.schedule,
        "--parallel.pp_chunks", str(c.chunks),
        "--train.micro_batch_size", str(MICRO_BATCH),
        "--train.global_batch_size", str(MICRO_BATCH * c.microbatches),
        "--train.eval_sequences", "0",
        # The counter hooks the first micro-batch's forward: it would lengthen that op.
        "--metrics.activation_memory", "false",
        "--metrics.pipeline_timeline", "true",
    ]  # fmt: skip


MEMORY_STEPS = 2  # the last step's peak is read: the first runs the schedule's shape inference


def memory_args(c: PipeConfig) -> list[str]:
    """A second, short run of the configuration that counts what each stage holds in flight."""
    return [
        *job_args(c), "--train.steps", str(MEMORY_STEPS),
        "--metrics.activation_memory", "true", "--metrics.pipeline_timeline", "false",
    ]  # fmt: skip


def _launch(opts: BenchOptions, pp: int, configs: list[PipeConfig]) -> None:
    paths = []
    for c in configs:
        for args, run in ((job_args(c), c.name), (memory_args(c), f"{c.name}-memory")):
            cfg = opts.job(*args, run=run)
            path = opts.work_dir / f"{run}.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(to_toml(cfg))
            paths.append(str(path))
    spec = opts.work_dir / f"pipeline-pp{pp}.json"
    spec.write_text(json.dumps({"configs": paths}))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(pp), "-m", "llmscale.bench.pipeline_worker", str(spec),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(
            f"pipeline bench, pp={pp}: torchrun failed ({r.returncode}):\n"
            f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        )


# ---- analysis -----------------------------------------------------------------------------


def analyse(opts: BenchOptions, c: PipeConfig) -> Measured:
    """Read one configuration's timeline, drop the warm-up steps, replay it in the simulator."""
    tl = PipelineTimeline.load(opts.work_dir / c.name / FILE_NAME)
    steps = [s for s in sorted(tl.steps) if s > opts.warmup] or sorted(tl.steps)
    timed = [tl.steps[s] for s in steps]
    stats = [step_stats(ops, c.pp) for ops in timed]
    t_fwd, t_bwd, t_w = backward_costs(timed, c.pp * c.chunks)
    gaps = [g for ops in timed for g in p2p_gaps(ops, c.pp)]
    t_p2p = max(0.0, statistics.median(gaps)) if gaps else 0.0
    sim = simulate(c.schedule, c.pp, c.microbatches, c.chunks, t_fwd, t_bwd, t_p2p, t_w)
    want = measured_spelling(schedule_ops(c.schedule, c.pp, c.microbatches, c.chunks))
    diffs = [
        f"step {s} rank {r}: {' '.join(got)}"
        for s, st in zip(steps, stats, strict=True)
        for r, got in enumerate(st.orders)
        if got != want[r]
    ]
    peak, predicted, inflight, held = _activation_peak(opts, c)
    bubbles = [s.bubble_fraction for s in stats]
    median_step = bubbles.index(sorted(bubbles)[len(bubbles) // 2])
    return Measured(
        cfg=c,
        stats=stats,
        median_step=median_step,
        timeline=tl,
        steps=steps,
        t_fwd=t_fwd,
        t_bwd=t_bwd,
        t_p2p=t_p2p,
        slack=statistics.median(slack_fraction(ops, c.pp) for ops in timed),
        replayed=statistics.median(replay(ops, c.pp, t_p2p).bubble_fraction for ops in timed),
        sim=sim,
        order_ok=not diffs,
        order_diff=diffs[0] if diffs else "",
        peak_bytes=peak,
        predicted_peak_bytes=predicted,
        inflight=inflight,
        held=held,
    )


def measured_spelling(orders: list[list[Op]]) -> list[tuple[str, ...]]:
    """The simulator's per-rank orders as the runtime's timeline records them: a backward that
    torch runs whole (dualpipev's full and overlapped backward actions, which the simulator
    writes as a B and a W joined into one action) is one B op there, so the joined W is
    dropped."""
    return [tuple(str(op) for op in rank if not (op.kind == "W" and op.joined)) for rank in orders]


def backward_costs(
    steps: list[list[OpRecord]], n_stages: int
) -> tuple[list[float], list[float], list[float] | None]:
    """Per-stage costs for the simulator from measured steps: forward, the whole backward and
    its weight-gradient part (None when no W op ran: the backward was never split). Where a
    stage's backward is split, the whole is its mean B (input gradient) plus its mean W; where
    torch ran it whole (no W for that micro-batch), the mean of those B ops, half of it W."""
    t_fwd = stage_kind_times(steps, n_stages, "F")
    whole: list[list[float]] = [[] for _ in range(n_stages)]
    split_b: list[list[float]] = [[] for _ in range(n_stages)]
    w: list[list[float]] = [[] for _ in range(n_stages)]
    for ops in steps:
        has_w = {(o.stage, o.microbatch) for o in ops if o.kind == "W"}
        for o in ops:
            if o.kind == "W":
                w[o.stage].append(o.duration)
            elif o.kind == "B":
                (split_b if (o.stage, o.microbatch) in has_w else whole)[o.stage].append(o.duration)
    if not any(w):
        return t_fwd, stage_kind_times(steps, n_stages, "B"), None
    t_bwd, t_w = [], []
    for s in range(n_stages):
        if w[s]:
            tw = statistics.fmean(w[s])
            t_bwd.append(statistics.fmean(split_b[s]) + tw)
            t_w.append(tw)
        else:
            tb = statistics.fmean(whole[s])
            t_bwd.append(tb)
            t_w.append(tb / 2)
    return t_fwd, t_bwd, t_w


def _activation_peak(
    opts: BenchOptions, c: PipeConfig
) -> tuple[float, float, int, dict[str, tuple[float, float]]]:
    """Stage 0's measured peak of saved activations and the planner's prediction of it, and
    what the stages hold besides (`parallel.pipeline.PipelineMemory`'s two metrics), measured
    and predicted."""
    run = f"{c.name}-memory"
    rows = [r for r in read_jsonl(opts.work_dir / run / "metrics.jsonl") if r["kind"] == "train"]
    plan = as_plan(opts.job(*memory_args(c), run=run))
    options = MemoryOptions(kernels=act.RUNTIME_CPU)  # the suite's ranks run on the CPU
    predicted = rank_activation_bytes(plan, 0, options)
    inflight = inflight_units(c.schedule, c.pp, c.microbatches, c.chunks, 0)
    want = pipeline_held(plan, 0, options)
    held = {
        "pending_weight_grad_bytes": (
            float(rows[-1]["pending_weight_grad_bytes"]),
            want.pending_weight_grads,
        ),
        "pipeline_buffer_bytes": (float(rows[-1]["pipeline_buffer_bytes"]), want.pipeline_buffers),
    }
    return float(rows[-1]["activation_peak_bytes"]), predicted, inflight, held


def _draw(opts: BenchOptions, pp: int, m: int, drawn: list[Measured]) -> Path:
    results: list[SimResult] = []
    titles: list[str | None] = []
    for x in drawn:
        c = x.cfg
        ops = x.timeline.steps[x.steps[x.median_step]]
        meas = as_sim_result(ops, c.schedule, c.pp, c.microbatches, c.chunks)
        results += [_in_ms(meas), _in_ms(x.sim)]
        titles += [
            f"{c.label}, measured (step {x.steps[x.median_step]}): bubble "
            f"{meas.bubble_fraction:.1%}, {1000 * meas.makespan:.0f} ms",
            f"{c.label}, simulated: bubble "
            f"{x.sim.bubble_fraction:.1%}, {1000 * x.sim.makespan:.0f} ms",
        ]
    path = png_path(opts, f"pipeline-gantt-pp{pp}-m{m}.png")
    assert path is not None
    return draw_gantts_png(results, path, titles, time_unit="ms")


def _in_ms(r: SimResult) -> SimResult:
    from dataclasses import replace

    return replace(
        r,
        makespan=1000 * r.makespan,
        timeline=tuple(t._replace(start=1000 * t.start, end=1000 * t.end) for t in r.timeline),
    )
