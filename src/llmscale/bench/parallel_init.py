"""How fast one core draws a parameter's full initial value, recorded.

    python -m llmscale.bench.parallel_init [--rows 4096] [--cols 4096] [--repeats 5] \
        [--json-out docs/results/parallel-init.json]

Every rank builds its pieces from each parameter's full initial value
(`Transformer.initial_value`: its own generator, a normal draw of the whole tensor on the host)
before it keeps its slice, so the time to build a big model is its parameter count over this
rate. This draws a `rows x cols` matrix `repeats` times on one torch thread and prints the best
rate in values per second; `--json-out` records it with the date, the command and the machine's
load average before and after (docs/parallel.md's limits render from it, `make docs`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from llmscale.bench.timed import now_iso
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.paths import SOURCE_ROOT

RECORD = SOURCE_ROOT / "docs" / "results" / "parallel-init.json"
SUITE = "parallel-init"
NAME = "layers.0.attention.wq.weight"  # a matrix: a normal draw (norms are constants)


def measure(rows: int, cols: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` draws of a `rows x cols` initial value, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(get_preset("tiny"), device="meta")
        out = []
        for i in range(repeats):
            t0 = time.perf_counter()
            model.initial_value(NAME, (rows, cols), seed=i)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        torch.set_num_threads(threads)


def record(
    rows: int, cols: int, seconds: list[float], load: tuple[float, float], command: str
) -> dict[str, Any]:
    """The record docs/parallel.md renders: the best rate and how it was measured."""
    return {
        SUITE: {
            "measured_at": now_iso(),
            "command": command,
            "cpu_count": os.cpu_count(),
            "torch_threads": 1,
            "load_average": list(load),
            "shape": [rows, cols],
            "seconds": seconds,
            "values_per_s": rows * cols / min(seconds),
        }
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.bench.parallel_init",
        description="Time Transformer.initial_value's draw of a full matrix on one core",
    )
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-out", type=Path, default=None, help=f"record here (e.g. {RECORD})")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    for field in ("rows", "cols", "repeats"):
        if getattr(args, field) < 1:
            ap.error(f"--{field}: got {getattr(args, field)}; allowed: a positive integer")
    before = os.getloadavg()[0]
    seconds = measure(args.rows, args.cols, args.repeats)
    load = (before, os.getloadavg()[0])
    argv_shown = sys.argv[1:] if argv is None else argv
    rec = record(args.rows, args.cols, seconds, load, " ".join([ap.prog, *argv_shown]))
    rate = rec[SUITE]["values_per_s"]
    print(
        f"initial values: {rate / 1e9:.3f} G values/s on one thread (best of {args.repeats} "
        f"draws of {args.rows} x {args.cols}; load average {load[0]:.2f} -> {load[1]:.2f})"
    )
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
