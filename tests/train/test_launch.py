"""The launcher's SIGINT count file: named after its launcher, removed by the next launch once
that launcher is gone (a SIGKILLed launcher cannot remove its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmscale.train import launch


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_counts_of_dead_launchers_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / f"{launch._COUNT_PREFIX}{_dead_pid()}-abc"
    alive = tmp_path / f"{launch._COUNT_PREFIX}{os.getpid()}-def"
    foreign = tmp_path / f"{launch._COUNT_PREFIX}notapid"  # not this launcher's naming
    for p in (dead, alive, foreign):
        p.write_bytes(b"1")
    launch._remove_stale_counts(tmp_path)
    assert not dead.exists()
    assert alive.exists() and foreign.exists()


def test_the_count_file_carries_the_launcher_pid_and_goes_at_the_end(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(launch.FORWARDED_SIGINTS_ENV, raising=False)
    stale = tmp_path / f"{launch._COUNT_PREFIX}{_dead_pid()}-xyz"
    stale.write_bytes(b"")
    with launch._counted_sigint_forwarding():
        path = Path(os.environ[launch.FORWARDED_SIGINTS_ENV])
        assert path.parent == tmp_path
        assert path.name.startswith(f"{launch._COUNT_PREFIX}{os.getpid()}-")
        assert path.exists() and not stale.exists()
    assert not path.exists()
    assert launch.FORWARDED_SIGINTS_ENV not in os.environ
