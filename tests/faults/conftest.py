"""The fault-injection suite's record: each test states the fault it tried and what it saw.

A test takes the `fault_row` fixture and calls it once per case with the fault or input, the
command that reproduces it, what the user should get, what the test observed and the data lost.
With `LLMSCALE_RELIABILITY_JSON=FILE` in the environment, the rows of the tests that ran are
written to FILE at the end of the session (`make reliability` renders docs/reliability.md from
it); without it nothing is written. Each row also gets its test's outcome (passed, failed).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_ROWS: list[dict[str, Any]] = []


@pytest.fixture
def fault_row(request: pytest.FixtureRequest) -> Callable[..., None]:
    """record(fault, command, expected, observed, data_lost="none")."""

    def record(
        fault: str, command: str, expected: str, observed: str, data_lost: str = "none"
    ) -> None:
        _ROWS.append(
            {
                "test": request.node.nodeid,
                "fault": fault,
                "command": command,
                "expected": expected,
                "observed": observed,
                "data_lost": data_lost,
            }
        )

    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Mark the test's rows with its outcome: the call's, or failed if any phase failed."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or report.failed:
        for row in _ROWS:
            if row["test"] == item.nodeid and row.get("outcome") != "failed":
                row["outcome"] = report.outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("LLMSCALE_RELIABILITY_JSON")
    if out and _ROWS:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(_ROWS, indent=1) + "\n")


# The finished run the checkpoint, reader and resume tests start from (each module its own).
@pytest.fixture(scope="module")
def earlier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished fp32 run of 2 steps (the tiny model: 4 layers, dim 64), checkpoints 1 and 2."""
    from run_helpers import train_args

    from llmscale.cli import main

    run = tmp_path_factory.mktemp("earlier") / "run"
    assert main(train_args(run)) == 0
    return run


@pytest.fixture
def run(earlier: Path, tmp_path: Path) -> Path:
    """A copy of `earlier` a test may damage."""
    out = tmp_path / "run"
    shutil.copytree(earlier, out)
    return out
