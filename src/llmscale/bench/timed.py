"""How long a command takes, recorded: `python -m llmscale.bench.timed NAME -- CMD ...`.

README's timing claims are rendered (`make docs`) from what was measured, never typed: this runs
CMD, passes its output and exit status on, and on success records its wall time in
`docs/results/timings.json`, one suite (`timings`) in results.json's schema with a row per NAME
(the newest replaces an older one): measured = wall seconds, the date, the machine's cores and
its load average before and after in the row's note. `make test-timed` records `make test`;
`make demo` records its own wall time the same way (`wall_row`, in docs/results/demo.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmscale.bench.report import Row
from llmscale.paths import SOURCE_ROOT

RECORD = SOURCE_ROOT / "docs" / "results" / "timings.json"
SUITE = "timings"
WALL = "wall time"


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def wall_row(suite: str, config: str, seconds: float, load: tuple[float, float]) -> dict[str, Any]:
    """A wall-time row (measured only) with the machine's cores and load average around it."""
    note = (
        f"{os.cpu_count()} CPU cores; load average {load[0]:.2f} at the start, {load[1]:.2f} at "
        "the end"
    )
    return Row(suite, config, WALL, "s", seconds, note=note).to_dict()


def run_timed(cmd: list[str], cwd: Path | None = None) -> tuple[int, float, tuple[float, float]]:
    """(exit status, wall seconds, load average before and after) of `cmd`."""
    before = os.getloadavg()[0]
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=cwd)
    return rc, time.perf_counter() - t0, (before, os.getloadavg()[0])


def record(path: Path, row: dict[str, Any], measured_at: str) -> dict[str, Any]:
    """`path`'s suite with `row` in place of an older row of the same config; written back."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    suite = data.get(SUITE) or {
        "title": "Wall time of the project's commands on this machine",
        "rows": [],
        "tables": {},
        "notes": ["Measured by python -m llmscale.bench.timed (make test-timed); make docs "
                  "renders README's timing claims from these rows."],
        "figures": [],
    }  # fmt: skip
    row = {**row, "measured_at": measured_at}
    suite["rows"] = [r for r in suite["rows"] if r["config"] != row["config"]] + [row]
    suite["measured_at"] = measured_at
    data[SUITE] = suite
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.bench.timed",
        description="Run a command, pass its exit status on, and record its wall time in "
        "docs/results/timings.json (README's timing claims are rendered from it)",
    )
    ap.add_argument("name", help='what the row is called, e.g. "make test"')
    ap.add_argument("--out", type=Path, default=RECORD, help="the record (default: %(default)s)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, cmd = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if not cmd:
        ap.error("no command: python -m llmscale.bench.timed NAME -- CMD ...")
    try:
        rc, seconds, load = run_timed(cmd)
    except OSError as e:
        print(f"{args.name}: cannot run {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 2
    if rc != 0:
        print(f"{args.name}: exited {rc}; its time is not recorded", file=sys.stderr)
        return rc
    record(args.out, wall_row(SUITE, args.name, seconds, load), now_iso())
    print(f"recorded {args.out}: {args.name} took {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
