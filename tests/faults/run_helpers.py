"""Helpers of the run-folder and checkpoint fault tests: tiny in-process `llmscale train` runs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from llmscale.bench.jobs import short_job
from llmscale.cli import main


def train_args(run_dir: Path, *extra: str, steps: int = 2, interval: int = 1) -> list[str]:
    """`llmscale train` of the tiny model, 32-token sequences, checkpoints every `interval`."""
    base = short_job(
        job__run_dir=run_dir,
        train__micro_batch_size=4,
        train__global_batch_size=4,
        train__steps=steps,
        checkpoint__enabled=True,
        checkpoint__interval=interval,
        checkpoint__keep_last=3,
    )
    return ["train", *base, *extra]


def run_cli(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `llmscale ARGS`, in this process."""
    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) with its sha256: to show nothing changed."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def one_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    return lines[0]
