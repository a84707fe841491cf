"""What every bench recorder writes around its figures: the record `make docs` renders from
(docs/results/NAME.json, `{suite: {...}}`), stamped with when, by which command, on how many
cores and threads, and under what load average it was measured."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from llmscale.bench.timed import now_iso


def suite_record(
    suite: str,
    title: str,
    module: str,
    argv: Sequence[str],
    load: tuple[float, float],
    **fields: Any,
) -> dict[str, Any]:
    """`{suite: {...}}`: the stamp (`measured_at`, `title`, the `command` as `python -m module
    argv`, `cores`, `threads`, the `load_average` at the start and at the end), then `fields`."""
    return {
        suite: {
            "measured_at": now_iso(),
            "title": title,
            "command": f"python -m {module} " + " ".join(argv),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average": list(load),
            **fields,
        }
    }


def write_record(path: Path, rec: dict[str, Any]) -> None:
    """Write `rec` as indented JSON at `path` (its folder made), and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {path}")
