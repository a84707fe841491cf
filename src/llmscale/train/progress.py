"""What a run prints: a header, a progress bar on a terminal, a line every log_every steps, the
end-of-run table; and RUN_DIR/summary.json, the same as data."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from llmscale.config import JobConfig
from llmscale.instrument.calibrate import BUSY_CORES
from llmscale.ui import console, human_bytes

if TYPE_CHECKING:
    from llmscale.train.prediction import RunPrediction
    from llmscale.train.trainer import Trainer, TrainResult


def format_row(row: dict[str, Any]) -> str:
    parts = [
        f"step {row['step']:>5}",
        f"loss {row['loss']:.4f}",
        f"lr {row['lr']:.2e}",
        f"|g| {row['grad_norm']:.3f}",
        f"{row['tokens_per_s']:,.0f} tok/s",
        f"{row['flops_per_s'] / 1e9:,.2f} GFLOP/s",
    ]
    if "mfu" in row:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if "cuda_peak_bytes" in row:
        parts.append(f"peak {human_bytes(row['cuda_peak_bytes'])}")
    else:
        parts.append(f"act {human_bytes(row['activation_bytes'])}")
    if row.get("skipped"):
        parts.append(f"[yellow]overflow: step skipped, scale -> {row['loss_scale']:g}[/]")
    elif row.get("loss_scale", 1.0) != 1.0:
        parts.append(f"scale {row['loss_scale']:g}")
    if "val_loss" in row:
        parts.append(f"val {row['val_loss']:.4f}")
    if "underflow" in row:
        u = row["underflow"]
        parts.append(f"fp16 underflow {100 * u[0]['underflow_fraction']:.1f}% unscaled")
    return "  ".join(parts)


def measured_step_time(step_times: Sequence[float]) -> float | None:
    """Median step time, after the first (warm-up) step when there are more."""
    times = list(step_times[1:] if len(step_times) > 1 else step_times)
    return statistics.median(times) if times else None


class Compared(NamedTuple):
    """A row of the end-of-run table: a figure the planner predicted next to the measured one.
    `unit`: "s" seconds, "B" bytes (as bench rows)."""

    quantity: str
    predicted: float | None
    measured: float | None
    unit: str


def compared_rows(
    prediction: RunPrediction, step_times: Sequence[float], last: dict[str, Any]
) -> list[Compared]:
    """Step time (the median of `step_times` after the first) and each memory figure of the
    `last` row, leaving out those both sides report as zero."""
    rows = [Compared("step_time_s", prediction.step_time_s, measured_step_time(step_times), "s")]
    for key, pred in prediction.memory_bytes.items():
        got = last.get(key)
        if pred or got:
            rows.append(Compared(key, pred, got, "B"))
    return rows


def comparison_table(
    rows: Sequence[Compared],
    hardware: dict[str, Any],
    rank: int,
    now: float,
    not_modelled: str | None = None,
) -> list[str]:
    """The end-of-run table of `rows` and the calibration line as of `now` (what a run prints,
    and README's demo block from the demo's record)."""
    out = [
        f"predicted (prediction.json, {hardware.get('display', '?')}) vs measured, rank {rank}:",
        f"  {'':<24} {'predicted':>11}  {'measured':>11}  {'ratio':>6}",
    ]
    for r in rows:
        fmt: Callable[[float], str] = (lambda s: f"{s:.3f} s") if r.unit == "s" else human_bytes
        ratio = f"{r.predicted / r.measured:.2f}" if r.predicted is not None and r.measured else "-"
        p = fmt(r.predicted) if r.predicted is not None else "-"
        g = fmt(r.measured) if r.measured is not None else "-"
        out.append(f"  {r.quantity:<24} {p:>11}  {g:>11}  {ratio:>6}")
        if r.quantity == "step_time_s" and r.predicted is None and not_modelled:
            out.append(f"  (step time not modelled: {not_modelled})")
    calibration = calibration_line(hardware, now)
    if calibration:
        out.append(calibration)
    return out


def comparison_lines(
    prediction: RunPrediction,
    step_times: Sequence[float],
    last: dict[str, Any],
    now: float | None = None,
) -> list[str]:
    """The end-of-run summary: each predicted figure next to the measured one (step time: the
    median of `step_times` after the first; memory: the `last` row's keys, leaving out those
    both sides report as zero); the calibration's age as of `now` (default: now)."""
    if not step_times:
        return []
    if not prediction.memory_bytes and prediction.step_time_s is None:
        return [f"predicted vs measured: not modelled ({prediction.not_modelled})"]
    return comparison_table(
        compared_rows(prediction, step_times, last),
        prediction.hardware,
        prediction.rank,
        time.time() if now is None else now,
        prediction.not_modelled,
    )


def _age(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "at an unknown time"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def _load(cores: float) -> str:
    return "unknown" if not math.isfinite(cores) else f"{cores:.2f} cores"


def calibration_line(hardware: dict[str, Any], now: float) -> str:
    """The measured device's age and the load other processes put on the machine while it was
    measured (and the ranks' shared-cores figures): one line, '' for a catalog device."""
    cal = hardware.get("calibration")
    if not cal:
        return ""
    text = (
        f"calibration: measured {_age(now - cal['measured_at'])}, other processes' load "
        f"{_load(cal['other_load_cores'])}"
    )
    shared = hardware.get("shared_cores")
    if shared:
        text += (
            f"; ranks sharing cores measured {_age(now - shared['measured_at'])}, load "
            f"{_load(shared['other_load_cores'])} (oversubscription "
            f"x{shared['oversubscription']:.2f}, gloo all-reduce "
            f"{1e6 * shared['allreduce_latency_s']:.0f} us + "
            f"{shared['allreduce_bytes_per_s'] / 1e9:.2f} GB/s, step overhead "
            f"{1e3 * shared['step_overhead_s']:.0f} ms)"
        )
    loads = [cal["other_load_cores"], *([shared["other_load_cores"]] if shared else [])]
    if any(load > BUSY_CORES for load in loads):  # NaN (unknown) is not busy
        text += (
            f"; warning: measured while other processes used more than {BUSY_CORES} cores "
            "(twice, when it was measured): the prediction carries that load"
        )
    return text


SUMMARY = "summary.json"  # in the run folder: what the run printed, as data (bench/demo.py)


def logs_step(step: int, log_every: int, steps: int) -> bool:
    """Whether a run prints step `step`'s line."""
    return step % log_every == 0 or step == steps


def plain(text: str) -> str:
    """A line as a pipe sees it: rich markup removed."""
    return Text.from_markup(text).plain


class StepReporter:
    """Prints on rank 0 only; the bar needs a terminal and metrics.progress = true. At the end
    it writes RUN_DIR/summary.json: the lines it printed around the steps, which steps it
    printed (their rows are metrics.jsonl's) and the end-of-run table's rows (`Compared`), so
    its output can be rendered again (README's demo block)."""

    def __init__(
        self, cfg: JobConfig, enabled: bool, prediction: RunPrediction | None = None
    ) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.prediction = prediction  # printed next to the measured figures at the end
        self.step_times: list[float] = []  # this call's steps
        self.last_row: dict[str, Any] = {}
        self.header: list[str] = []  # printed before the first step, plain
        self.logged_steps: list[int] = []
        self.console = console()
        self.progress: Progress | None = None
        self.task: Any = None

    def _say(self, text: str, to: list[str], **kwargs: Any) -> None:
        self.console.print(text, **kwargs)
        to.append(text if kwargs.get("markup") is False else plain(text))

    def start(self, trainer: Trainer, resumed: bool) -> None:
        if not self.enabled:
            return
        c = self.cfg
        self._say(
            f"[bold]llmscale train[/] {c.job.name}: model {c.model.name} "
            f"({trainer.n_params:,} params) on {trainer.device}, {c.precision.mode}, "
            f"recompute={c.train.recompute}, global batch {c.train.global_batch_size} x "
            f"{c.data.seq_len} tokens = {c.train.micro_batch_size} x {c.n_microbatches} accum"
            + (f" x dp {trainer.dims.dp}" if trainer.dims.dp > 1 else ""),
            self.header,
        )
        if trainer.dims.world_size > 1:
            p = c.parallel
            extras = [
                f"schedule {p.pp_schedule}" + (f" x{p.pp_chunks} chunks" if p.pp_chunks > 1 else "")
                if p.pp > 1
                else "",
                "sequence parallel" if p.sequence_parallel else "",
                f"zero {p.zero_stage}" if p.dp_shard > 1 else "",
            ]
            self._say(
                f"layout: {trainer.dims.describe()}" + "".join(f", {e}" for e in extras if e),
                self.header,
            )
        self._say(f"data: {trainer.corpus_summary}", self.header)
        for w in trainer.memory_warnings:
            self._say(f"[yellow]{w}[/]", self.header, highlight=False)
        if resumed:
            self._say(f"resumed from step {trainer.step}", self.header)
        if c.metrics.progress and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.progress.start()
            self.task = self.progress.add_task(
                "training", total=c.train.steps, completed=trainer.step
            )

    def step(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.step_times.append(row["step_time_s"])
        self.last_row = row
        if logs_step(row["step"], self.cfg.metrics.log_every, self.cfg.train.steps):
            self.console.print(format_row(row))
            self.logged_steps.append(row["step"])
        if self.progress is not None:
            self.progress.update(
                self.task, completed=row["step"], description=f"loss {row['loss']:.3f}"
            )

    def note(self, text: str) -> None:
        """A warning line (rank 0), above the progress bar."""
        if self.enabled:
            self.console.print(f"[yellow]{text}[/]", highlight=False)

    def finish(self, result: TrainResult) -> None:
        if self.progress is not None:
            self.progress.stop()
        if not self.enabled:
            return
        closing: list[str] = []
        # A signal's stop is the one line the CLI prints (JobStopped); checkpoint.stop_after's
        # is printed here.
        if result.interrupted and result.stop_signal is None:
            saved = "checkpoint written, resume with --resume"
            if not self.cfg.checkpoint.enabled:
                saved = "no checkpoint written (checkpoint.enabled = false)"
            self._say(
                f"stopped after step {result.steps_done} (checkpoint.stop_after); {saved}", closing
            )
        elif result.val_loss is not None:
            self._say(f"validation loss {result.val_loss:.4f}", closing)
        now = time.time()
        if self.prediction is not None:
            for line in comparison_lines(self.prediction, self.step_times, self.last_row, now):
                self.console.print(line, markup=False)
        self.console.print(f"run folder: {self.cfg.job.run_dir}")
        self._write_summary(closing, now)

    def _write_summary(self, closing: list[str], now: float) -> None:
        p = self.prediction
        modelled = p is not None and bool(p.memory_bytes or p.step_time_s is not None)
        summary = {
            "header": self.header,
            "logged_steps": self.logged_steps,
            "closing": closing,
            "comparison": {
                "rows": [r._asdict() for r in compared_rows(p, self.step_times, self.last_row)],
                "hardware": p.hardware,
                "rank": p.rank,
                "not_modelled": p.not_modelled,
                "printed_at": now,
            }
            if p is not None and modelled and self.step_times
            else None,
            "run_folder": self.cfg.job.run_dir,
        }
        try:
            (Path(self.cfg.job.run_dir) / SUMMARY).write_text(json.dumps(summary, indent=2))
        except OSError as e:  # the run's own files are written; this one only repeats them
            self.note(f"{SUMMARY} not written: {e}")
