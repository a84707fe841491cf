"""[metrics] tensorboard = true: the event files hold the same figures as metrics.jsonl."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from llmscale.train.metrics import read_jsonl
from llmscale.train.trainer import Trainer


def _scalars(folder) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_event_files_hold_every_metric_per_step(cfg_factory) -> None:
    cfg = cfg_factory(
        "--metrics.tensorboard", "true", "--train.steps", "4", "--train.eval_every", "2",
        "--metrics.peak_tflops", "1", "--precision.mode", "fp16",
    )  # fmt: skip
    with Trainer(cfg) as t:
        t.fit()
        run = t.run_dir
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    got = _scalars(run / "tensorboard")
    for key, tag in (
        ("loss", "train/loss"),
        ("lr", "train/lr"),
        ("grad_norm", "train/grad_norm"),
        ("loss_scale", "train/loss_scale"),
        ("tokens_per_s", "train/tokens_per_s"),
        ("mfu", "train/mfu"),
        ("param_bytes", "memory/param_bytes"),
        ("grad_bytes", "memory/grad_bytes"),
        ("optimizer_bytes", "memory/optimizer_bytes"),
        ("activation_bytes", "memory/activation_bytes"),
    ):
        assert sorted(got[tag]) == [1, 2, 3, 4], tag
        for r in rows:  # TensorBoard stores float32
            assert got[tag][r["step"]] == pytest.approx(r[key], rel=1e-6), (tag, r["step"])
    val = got["val/loss"]
    assert sorted(val) == [2, 4]
    assert val[2] == pytest.approx(rows[1]["val_loss"], rel=1e-6)


def test_off_by_default_and_resume_drops_the_redone_steps(cfg_factory) -> None:
    with Trainer(cfg_factory(run="off")) as t:
        t.fit()
        assert not (t.run_dir / "tensorboard").exists()
    common = ("--metrics.tensorboard", "true", "--checkpoint.enabled", "true")
    with Trainer(cfg_factory(*common, "--train.steps", "4", "--checkpoint.interval", "2")) as t:
        t.fit()  # checkpoints at 2 and 4; events for steps 1-4
        run = t.run_dir
    # Back to step 2 (the newest checkpoint removed) and on to 3 steps: step 3 is redone.
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-000004")
    with Trainer(cfg_factory(*common, "--train.steps", "3", "--checkpoint.resume", "true")) as t:
        t.fit()
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    loss = _scalars(run / "tensorboard")["train/loss"]
    assert sorted(loss) == [1, 2, 3]  # step 4 of the first run purged
    assert loss[3] == pytest.approx(rows[-1]["loss"], rel=1e-6)
