"""Faults of issue 13, items 3 and 6: NaN/inf input, a diverging run, fp16 overflow, signals.

Bad float input is refused at the edge (exit 2, one line). A run whose loss or gradient norm
stays non-finite for train.max_bad_steps steps stops with exit 3 and leaves no checkpoint of
non-finite weights; fp16's skipped overflow steps do not count. SIGINT/SIGTERM save a checkpoint
at the step reached and exit 130/143 with that step in the message.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from llmscale.cli import main
from llmscale.errors import ExitCode
from llmscale.train.checkpoint import Checkpointer
from llmscale.train.metrics import read_jsonl

SHORT = [
    "--data.max_files", "40", "--data.seq_len", "32", "--metrics.progress", "false",
    "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
]  # fmt: skip


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["train", *SHORT, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _tensors(obj: object):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _nonfinite_checkpoints(run_dir: Path, tmp: Path) -> list[int]:
    """Steps of the checkpoints in run_dir holding any non-finite floating tensor."""
    bad = []
    for step, path in Checkpointer(run_dir / "checkpoints").checkpoints():
        flat = tmp / f"ckpt-{step}.pt"
        dcp_to_torch_save(path, flat)
        state = torch.load(flat, weights_only=False)
        if any(t.is_floating_point() and not torch.isfinite(t).all() for t in _tensors(state)):
            bad.append(step)
    return bad


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("optimizer.lr", "inf", "finite"),
        ("optimizer.lr", "nan", "finite"),
        ("optimizer.lr", "-0.001", "positive"),
        ("optimizer.weight_decay", "inf", "finite"),
        ("optimizer.eps", "nan", "finite"),
        ("optimizer.beta2", "1.0", "[0, 1)"),
        ("train.max_grad_norm", "nan", "finite"),
        ("precision.initial_scale", "inf", "finite"),
        ("model.rope_theta", "nan", "finite"),
        ("lr_scheduler.min_lr_ratio", "-inf", "finite"),
    ],
)
def test_non_finite_or_out_of_range_float_is_refused(
    capsys, fault_row, tmp_path, key, value, allowed
):
    run = tmp_path / "run"
    rc, out, err = _cli(capsys, "--job.run_dir", str(run), f"--{key}", value)
    lines = err.strip().splitlines()
    fault_row(
        fault=f"{key} = {value}",
        command=f"llmscale train --{key} {value}",
        expected="exit 2, one line naming the field and what is allowed; nothing written",
        observed=f"exit {rc}: {lines[-1] if lines else '(no message)'}",
    )
    assert rc == ExitCode.BAD_INPUT
    assert len(lines) == 1 and key in lines[0] and allowed in lines[0], err
    assert not run.exists()


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_diverging_run_stops_and_never_checkpoints_nan(capsys, fault_row, tmp_path, mode):
    run = tmp_path / "run"
    args = (
        "--job.run_dir", str(run), "--precision.mode", mode, "--train.steps", "12",
        "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0",
        "--checkpoint.interval", "1", "--checkpoint.keep_last", "20", "--train.max_bad_steps", "3",
    )  # fmt: skip
    rc, out, err = _cli(capsys, *args)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]
    last = err.strip().splitlines()[-1] if err.strip() else ""
    saved = [s for s, _ in Checkpointer(run / "checkpoints").checkpoints()]
    nonfinite = _nonfinite_checkpoints(run, tmp_path)
    fault_row(
        fault=f"a run that diverges ({mode}, optimizer.lr = 1e30, finite)",
        command=f"llmscale train --precision.mode {mode} --optimizer.lr 1e30 "
        "--checkpoint.interval 1 --train.max_bad_steps 3",
        expected="exit 3 after 3 non-finite steps in a row; no checkpoint of non-finite weights",
        observed=f"exit {rc} after step {rows[-1]['step']}, checkpoints {saved}, "
        f"non-finite ones {nonfinite}: {last}",
        data_lost="none" if not nonfinite else f"NaN checkpoints {nonfinite}",
    )
    assert rc == ExitCode.DIVERGED
    assert last.startswith("llmscale train: diverged:") and "max_bad_steps = 3" in last
    bad = [
        r["step"]
        for r in rows
        if not (math.isfinite(float(r["loss"])) and math.isfinite(float(r["grad_norm"])))
    ]
    assert len(bad) == 3 and bad == list(range(bad[0], bad[0] + 3)) and rows[-1]["step"] == bad[-1]
    assert rows[-1]["step"] < 12 and f"steps {bad[0]}-{bad[-1]}" in last
    assert saved and not nonfinite  # the good steps' checkpoints exist, the bad ones were skipped
    assert not set(saved) & set(bad)


def test_fp16_overflow_skips_do_not_count(capsys, fault_row, tmp_path):
    run = tmp_path / "run"
    rc, out, err = _cli(
        capsys,
        "--job.run_dir", str(run), "--precision.mode", "fp16", "--train.steps", "4",
        "--precision.initial_scale", "1e12", "--precision.max_scale", "1e12",
        "--train.max_bad_steps", "2", "--checkpoint.enabled", "false",
    )  # fmt: skip
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]
    skipped = [r["step"] for r in rows if r["skipped"]]
    fault_row(
        fault="fp16 loss scale far too high: every step's gradients overflow (finite loss)",
        command="llmscale train --precision.mode fp16 --precision.initial_scale 1e12 "
        "--precision.max_scale 1e12 --train.max_bad_steps 2",
        expected="steps skipped by the loss scaler, not counted as divergence: exit 0",
        observed=f"exit {rc}, {len(skipped)} of {len(rows)} steps skipped",
    )
    assert rc == ExitCode.OK, err
    assert len(skipped) == 4 > 2  # more skipped steps in a row than max_bad_steps
    assert all(math.isfinite(float(r["loss"])) for r in rows)


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_signal_saves_a_checkpoint_at_the_step_reached(fault_row, tmp_path, sig, code):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "llmscale", "train", *SHORT, "--job.run_dir", str(run),
           "--train.steps", "100000"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (
        metrics.exists() and metrics.read_text().count("\n") >= 2
    ):
        time.sleep(0.02)
    os.kill(proc.pid, getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1] if err.strip() else ""
    step = max(r["step"] for r in read_jsonl(metrics))
    latest = Checkpointer(run / "checkpoints").latest()
    fault_row(
        fault=f"{sig} during training",
        command=f"kill -{sig[3:]} <pid of llmscale train>",
        expected=f"checkpoint at the step reached, exit {code}, one line naming the signal and step",
        observed=f"exit {proc.returncode}, last step {step}, newest checkpoint "
        f"{latest[0] if latest else None}: {last}",
    )
    assert proc.returncode == code
    assert step >= 2 and latest is not None and latest[0] == step
    assert last.startswith(f"llmscale train: stopped by {sig} after step {step};"), err
    assert "resume with --resume" in last


@pytest.mark.slow
def test_pipeline_ranks_stop_alike_on_divergence(fault_row, tmp_path):
    """Under pp=2 only the last stage computes the loss: both ranks still stop at the same step
    (the loss and gradient norm are reduced over the job) and no checkpoint holds NaN."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
    from parallel_harness import free_port, worker_env

    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "llmscale", "train", *SHORT, "--job.run_dir", str(run),
        "--train.micro_batch_size", "2", "--parallel.pp", "2", "--model.tie_embeddings", "false",
        "--train.steps", "12", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0",
        "--checkpoint.interval", "1", "--train.max_bad_steps", "3",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), timeout=240)
    stops = [line for line in r.stderr.splitlines() if "llmscale train: diverged:" in line]
    saved = [s for s, _ in Checkpointer(run / "checkpoints").checkpoints()]
    nonfinite = _nonfinite_checkpoints(run, tmp_path)
    fault_row(
        fault="a run that diverges under pipeline parallelism (pp=2, optimizer.lr = 1e30)",
        command="torchrun --nproc-per-node 2 -m llmscale train --parallel.pp 2 "
        "--optimizer.lr 1e30 --train.max_bad_steps 3",
        expected="every rank stops at the same step with exit 3; no checkpoint of NaN weights",
        observed=f"rank 0 said: {stops[-1] if stops else r.stderr[-300:]!r}; "
        f"checkpoints {saved}, non-finite ones {nonfinite}",
        data_lost="none" if not nonfinite else f"NaN checkpoints {nonfinite}",
    )
    assert "exitcode: 3" in r.stderr  # torchrun's report of the first worker to fail
    # The ranks decide alike on the job's reduced loss and gradient norm; only rank 0 prints.
    assert len(stops) == 1 and "(steps 2-4" in stops[0], r.stderr[-3000:]
    assert saved and not nonfinite


def test_stop_after_a_resume_names_the_real_step(capsys, fault_row, tmp_path):
    """The stop message once always said the step the run started from ("after step 0")."""
    run = ("--job.run_dir", str(tmp_path / "run"), "--train.steps", "6")
    rc1, out1, _ = _cli(capsys, *run, "--checkpoint.stop_after", "2")
    rc2, out2, _ = _cli(capsys, *run, "--checkpoint.stop_after", "4", "--checkpoint.resume", "true")
    said = [line for line in (out1 + out2).splitlines() if line.startswith("stopped after")]
    fault_row(
        fault="checkpoint.stop_after 2, then --resume with stop_after 4",
        command="llmscale train --checkpoint.stop_after 2; "
        "llmscale train --resume --checkpoint.stop_after 4",
        expected="exit 0 both times; 'stopped after step 2', then 'stopped after step 4'",
        observed=f"exit {rc1}, {rc2}: {said}",
    )
    assert rc1 == rc2 == ExitCode.OK
    assert [line.split(";")[0] for line in said] == [
        "stopped after step 2 (checkpoint.stop_after)",
        "stopped after step 4 (checkpoint.stop_after)",
    ]


def test_second_ctrl_c_stops_at_once(cfg_factory, fault_row, capfd):
    """The first SIGINT asks for a stop after the step (with a checkpoint); a second one, for
    a step or a save that takes too long, raises KeyboardInterrupt at once (exit 130)."""
    from llmscale.train.trainer import Trainer

    t = Trainer(cfg_factory(run="ctrl-c"))
    previous = t._install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in the main thread, between bytecodes
        first = t._stop_signal
        with pytest.raises(KeyboardInterrupt) as e:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        t._restore_signal_handlers(previous)
    notice = capfd.readouterr().err.strip()
    fault_row(
        fault="Ctrl-C twice during training",
        command="llmscale train ..., then Ctrl-C, Ctrl-C",
        expected="the first asks for a stop with a checkpoint (a notice says so), the second "
        "stops at once (exit 130)",
        observed=f"first: stop requested ({signal.Signals(first).name}), notice {notice!r}; "
        f"second: {type(e.value).__name__}",
    )
    assert first == signal.SIGINT and "Ctrl-C again" in notice


def test_a_forwarded_ctrl_c_is_not_a_second_one(
    cfg_factory, fault_row, capfd, monkeypatch, tmp_path
):
    """Under `llmscale train --nproc-per-node N` one Ctrl-C reaches a worker twice, directly
    and forwarded by the launcher, which counts each copy it forwards before sending it
    (launch.FORWARDED_SIGINTS_ENV): the copy is never taken for a second Ctrl-C, however late
    it comes (a backward pass or a save delays a worker's handler by seconds on a loaded
    machine); a second direct one stops at once."""
    from llmscale.train.launch import FORWARDED_SIGINTS_ENV
    from llmscale.train.trainer import Trainer

    count = tmp_path / "forwarded"
    count.write_bytes(b"")
    t = Trainer(cfg_factory(run="ctrl-c-launcher"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv(FORWARDED_SIGINTS_ENV, str(count))
    previous = t._install_signal_handlers()

    def sigint() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in the main thread, between bytecodes

    try:
        sigint()  # the Ctrl-C, directly
        t._stop_time -= 60  # a minute later, as far as a time window could tell
        count.write_bytes(b"1")  # the launcher counts its copy, then forwards it
        sigint()
        forwarded_was_ignored = t._stop_signal == signal.SIGINT
        with pytest.raises(KeyboardInterrupt) as e:
            sigint()  # Ctrl-C again
    finally:
        t._restore_signal_handlers(previous)
    notice = capfd.readouterr().err.strip()
    fault_row(
        fault="one Ctrl-C reaching a worker twice (direct, and forwarded 60 s later), then a "
        "second Ctrl-C",
        command="llmscale train --nproc-per-node 2 ..., then Ctrl-C, Ctrl-C",
        expected="the forwarded copy ignored; the second Ctrl-C stops at once",
        observed=f"forwarded copy ignored: {forwarded_was_ignored}; second: "
        f"{type(e.value).__name__}; notice {notice!r}",
    )
    assert forwarded_was_ignored
    assert "Ctrl-C again to stop at once" in notice  # no waiting time to state


def test_a_forwarded_copy_during_teardown_is_not_a_second_ctrl_c(
    cfg_factory, monkeypatch, tmp_path
):
    """Under a launcher, a rank that stops on a Ctrl-C keeps its handlers past `fit`: the
    launcher's forwarded copy can come while the rank tears down (a barrier, the process
    group), where the default handler would take it for a second Ctrl-C ("interrupted", no
    "stopped by SIGINT" line: the launcher faults' test C failed so in CI)."""
    from llmscale.errors import JobStopped
    from llmscale.train.launch import FORWARDED_SIGINTS_ENV
    from llmscale.train.trainer import Trainer

    count = tmp_path / "forwarded"
    count.write_bytes(b"")
    t = Trainer(cfg_factory("--train.steps", "3", run="ctrl-c-teardown"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv(FORWARDED_SIGINTS_ENV, str(count))
    step = t.train_step

    def ctrl_c_in_step_1() -> dict:
        row = step()
        if t.step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, directly
            time.sleep(0.01)
        return row

    monkeypatch.setattr(t, "train_step", ctrl_c_in_step_1)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(JobStopped) as stopped:
            t.fit()
        count.write_bytes(b"1")  # the launcher counts its copy, then forwards it
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # no KeyboardInterrupt: the copy is known for one
    finally:
        signal.signal(signal.SIGINT, before)
    assert stopped.value.code == 130 and "stopped by SIGINT after step 1" in str(stopped.value)
