"""Short real trainings for the benchmarks: build a job, run a few steps, keep the medians."""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmscale.bench.jobs import short_job
from llmscale.config import JobConfig, load_config
from llmscale.train.trainer import Trainer


@dataclass
class BenchOptions:
    """What every suite shares: the model, the sequence length, how long to measure."""

    model: str = "small"
    seq_len: int = 128
    steps: int = 3  # timed steps per configuration (after warm-up)
    warmup: int = 1
    device: str = "auto"
    data_files: int = 60
    seeds: int = 3  # independent runs (seeds 0 .. seeds-1) for figures that vary from run to run
    png_dir: Path | None = None
    loader_sizes_mb: tuple[int, ...] = (100, 1000, 4000)  # the loader suite's corpus sizes
    stack: str | None = None  # the published suite: one training stack's runs (None: all)
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="llmscale-bench-")))

    def job(self, *overrides: str, run: str = "run") -> JobConfig:
        """A short job on the stdlib corpus; `overrides` as on the command line."""
        base = short_job(
            model__name=self.model,
            job__device=self.device,
            job__run_dir=self.work_dir / run,
            data__seq_len=self.seq_len,
            data__max_files=self.data_files,
            train__steps=self.steps + self.warmup,
            lr_scheduler__warmup_steps=0,
            lr_scheduler__decay="constant",
        )
        return load_config(None, [*base, *overrides])


@dataclass
class Measurement:
    """Medians over the timed steps, and the last step's full metrics row."""

    step_time_s: float  # median
    min_step_time_s: float  # the fastest step: least disturbed by other work on the machine
    tokens_per_s: float
    last: dict[str, Any]
    losses: list[float]

    def __getitem__(self, key: str) -> Any:
        return self.last[key]


def measure(cfg: JobConfig, warmup: int = 1, trainer: Trainer | None = None) -> Measurement:
    """Run cfg.train.steps steps in this process; time all but the first `warmup`."""
    t = trainer or Trainer(cfg)
    rows = [t.train_step() for _ in range(cfg.train.steps)]
    timed = rows[warmup:] or rows
    return Measurement(
        step_time_s=statistics.median(r["step_time_s"] for r in timed),
        min_step_time_s=min(r["step_time_s"] for r in timed),
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        last=rows[-1],
        losses=[r["loss"] for r in rows],
    )


def png_path(opts: BenchOptions, name: str) -> Path | None:
    if opts.png_dir is None:
        return None
    opts.png_dir.mkdir(parents=True, exist_ok=True)
    return opts.png_dir / name
