"""The learning-rate schedule: linear warm-up, then cosine, linear or no decay to min_lr_ratio.

Every expected value is worked out by hand in the test: the multiplier at 0-based optimizer step
s is (s + 1) / warmup during warm-up, then min + (1 - min) * shape(p) with
p = (s - warmup) / (total - warmup), shape = (1 + cos(pi p)) / 2 (cosine) or 1 - p (linear).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llmscale.config import LRSchedulerSection
from llmscale.train.metrics import read_jsonl
from llmscale.train.optim import build_scheduler, lr_multiplier
from llmscale.train.trainer import Trainer

COS_PI_4 = math.sqrt(2.0) / 2  # cos(pi/4)


def _cfg(warmup: int, decay: str, min_lr_ratio: float) -> LRSchedulerSection:
    cfg = LRSchedulerSection(warmup_steps=warmup, decay=decay, min_lr_ratio=min_lr_ratio)
    cfg.validate()
    return cfg


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.25),  # warm-up: 1/4
        (1, 0.5),
        (3, 1.0),  # last warm-up step reaches the base lr
        (4, 1.0),  # decay starts at progress 0
        (6, 0.1 + 0.9 * 0.5 * (1 + COS_PI_4)),  # progress 2/8 = 1/4
        (8, 0.55),  # progress 1/2: cos = 0, halfway between 1 and 0.1
        (12, 0.1),  # the last step: min_lr_ratio
        (20, 0.1),  # past the end the multiplier stays at the floor
    ],
)
def test_cosine_with_warmup(step: int, expected: float) -> None:
    assert lr_multiplier(step, 12, _cfg(4, "cosine", 0.1)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("min_lr_ratio", "step", "expected"),
    [
        (0.0, 0, 0.25),
        (0.0, 6, 0.75),  # progress 1/4
        (0.0, 10, 0.25),  # progress 3/4
        (0.0, 12, 0.0),
        (0.2, 8, 0.6),  # 0.2 + 0.8 * (1 - 1/2)
        (0.2, 12, 0.2),
    ],
)
def test_linear_with_warmup(min_lr_ratio: float, step: int, expected: float) -> None:
    cfg = _cfg(4, "linear", min_lr_ratio)
    assert lr_multiplier(step, 12, cfg) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_constant_warms_up_then_holds_and_ignores_the_floor() -> None:
    cfg = _cfg(2, "constant", 0.1)
    got = [lr_multiplier(s, 10, cfg) for s in range(12)]
    assert got == [0.5] + [1.0] * 11


def test_no_warmup_starts_at_the_base_lr() -> None:
    assert lr_multiplier(0, 10, _cfg(0, "cosine", 0.0)) == 1.0
    assert lr_multiplier(5, 10, _cfg(0, "cosine", 0.0)) == pytest.approx(0.5, rel=1e-12)
    assert lr_multiplier(5, 10, _cfg(0, "linear", 0.0)) == pytest.approx(0.5, rel=1e-12)
    # warm-up as long as the run: the span after it is clamped to one step, no division by zero
    assert lr_multiplier(9, 10, _cfg(10, "cosine", 0.0)) == 1.0
    assert lr_multiplier(10, 10, _cfg(10, "cosine", 0.0)) == pytest.approx(1.0, rel=1e-12)


def _opt(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, n: int):
    """The lr each of the next n optimizer steps uses (read before the step, as the trainer logs)."""
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_scheduler_sets_the_optimizer_lr_per_step() -> None:
    base, cfg = 0.01, _cfg(4, "cosine", 0.1)
    opt = _opt(base)
    got = _lrs(opt, build_scheduler(opt, 12, cfg), 13)
    expected = [0.0025, 0.005, 0.0075, 0.01, 0.01]  # warm-up, then progress 0
    expected += [base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8))) for k in range(1, 9)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[8] == pytest.approx(0.0055, rel=1e-12) and got[12] == pytest.approx(0.001, rel=1e-12)


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_scheduler_resumed_from_its_state_continues_the_same_values(decay: str) -> None:
    base, total, cfg = 0.01, 12, _cfg(4, decay, 0.1)
    opt = _opt(base)
    uninterrupted = _lrs(opt, build_scheduler(opt, total, cfg), total)

    opt = _opt(base)
    sched = build_scheduler(opt, total, cfg)
    first = _lrs(opt, sched, 6)  # interrupted mid-decay (after warm-up)
    opt_state, sched_state = opt.state_dict(), sched.state_dict()

    # A fresh process: new optimizer and scheduler, then the saved state, as the trainer does.
    opt2 = _opt(base)
    sched2 = build_scheduler(opt2, total, cfg)
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(sched_state)
    assert sched2.last_epoch == 6
    rest = _lrs(opt2, sched2, total - 6)
    assert first + rest == uninterrupted  # exactly, not approximately
    assert rest[0] == pytest.approx(base * lr_multiplier(6, total, cfg), rel=1e-12)


def _logged_lrs(run_dir: Path) -> dict[int, float]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {r["step"]: r["lr"] for r in rows if r.get("kind") == "train"}


@pytest.mark.slow
def test_trainer_resume_logs_the_uninterrupted_lr(cfg_factory) -> None:
    """A real run stopped after step 4 and resumed logs the same lr at steps 5-8 as one run."""
    common = (
        "--checkpoint.enabled", "true", "--train.steps", "8",
        "--optimizer.lr", "0.002",
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay", "cosine",
        "--lr_scheduler.min_lr_ratio", "0.1",
    )  # fmt: skip
    full = Trainer(cfg_factory(*common, run="full"))
    full.fit()
    Trainer(cfg_factory(*common, "--checkpoint.stop_after", "4", run="resumed")).fit()
    second = Trainer(cfg_factory(*common, "--checkpoint.resume", "true", run="resumed"))
    second.fit()
    lrs, resumed = _logged_lrs(full.run_dir), _logged_lrs(second.run_dir)
    assert sorted(lrs) == list(range(1, 9))
    assert {s: resumed[s] for s in range(5, 9)} == {s: lrs[s] for s in range(5, 9)}
    # Row s logs the lr of 0-based optimizer step s - 1: warm-up 1/2, 2/2, then cosine over 6
    # steps, progress (s - 3) / 6.
    expected = [0.001, 0.002] + [
        0.002 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 6))) for k in range(6)
    ]
    assert [lrs[s] for s in range(1, 9)] == pytest.approx(expected, rel=1e-6)
    assert lrs[5] == pytest.approx(0.002 * (0.1 + 0.9 * 0.75), rel=1e-6)  # progress 1/3
    assert lrs[6] == pytest.approx(0.0011, rel=1e-6)  # progress 1/2: halfway to the floor
