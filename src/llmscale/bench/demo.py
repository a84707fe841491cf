"""`make demo`: its commands, run and timed, and its record (the run folder's demo.json; with
`--record`, the project's docs/results/demo.json).

The demo trains the tiny model on 4 CPU processes (FSDP over 2 ranks x tensor parallelism over
2), plots the run, and plans Llama 2 70B on 64 H200s. This module holds those commands (the
Makefile runs it; README's plan block is the last one), runs them in order and times them (wall
seconds from the first to the end of the last; the .venv's creation is not counted), then writes
what the run printed, as data, one suite in results.json's schema. `make demo` writes it into
the run folder (`runs/demo/demo.json`, untracked: a user's checkout stays as it was); `make
demo-record` (`--record`) writes the project's record, docs/results/demo.json, from which `make
docs` renders README's demo blocks:

- `rows`: the end-of-run table (`train/progress.py`'s `Compared` rows: step time, then each
  memory figure, predicted and measured) and the demo's wall time (measured only, with the
  machine's cores and load average);
- `run`: the lines the train command printed before its first step and after its last
  (`RUN_DIR/summary.json`), the metrics rows of the steps it printed (metrics.jsonl), and what
  its calibration line reads (the measured device, and when the table was printed).

`transcript` renders README's demo block from it with the train command's own renderers
(`format_row`, `comparison_table`): `make docs` re-measures nothing.

    python -m llmscale.bench.demo                # run the demo, write runs/demo/demo.json
    python -m llmscale.bench.demo --record       # the same, written to docs/results/demo.json
    python -m llmscale.bench.demo --record-only  # record runs/demo as it is (no run, no wall)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

from llmscale.bench.report import Row
from llmscale.bench.timed import WALL, now_iso, wall_row
from llmscale.instrument import calibrate
from llmscale.paths import SOURCE_ROOT
from llmscale.train.progress import SUMMARY, Compared, comparison_table, format_row, plain

CONFIG = "configs/default.toml"
TRAIN = (
    "torchrun", "--standalone", "--nproc-per-node", "4", "-m", "llmscale", "train",
    "--config", CONFIG, "--parallel.dp_shard", "2", "--parallel.tp", "2", "--overwrite",
)  # fmt: skip
PLAN = (
    "llmscale", "plan", "--model", "llama2-70b", "--gpu", "h200", "--gpus", "64",
    "--seq", "4096", "--global-batch", "1024", "--top", "5",
)  # fmt: skip
RECORD = SOURCE_ROOT / "docs" / "results" / "demo.json"  # the project's (make demo-record)
RUN_RECORD = "demo.json"  # in the run folder (make demo)
LOSS_IMAGE = SOURCE_ROOT / "docs" / "img" / "demo-loss.png"  # README's, from the recorded run
SUITE = "demo"


def run_dir(root: Path = SOURCE_ROOT) -> Path:
    """The demo's run folder: its config's job.run_dir, relative to the checkout."""
    with (root / CONFIG).open("rb") as f:
        run: str = tomllib.load(f)["job"]["run_dir"]
    return root / run


def commands(root: Path = SOURCE_ROOT) -> list[tuple[str, ...]]:
    folder = run_dir(root).relative_to(root)
    return [
        TRAIN,
        ("llmscale", "plot", str(folder)),
        (*PLAN, "--png", str(folder / "plan-llama2-70b-h200.png")),
    ]


class Ran(NamedTuple):
    """What `run` did: the exit status of the first command that failed (or 0), wall seconds
    of all, the command lines, and the cores other processes used on average while the train
    command ran (NaN: unknown)."""

    rc: int
    wall_s: float
    lines: list[str]
    train_other_load_cores: float


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children and theirs (torchrun and its ranks)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(root: Path = SOURCE_ROOT) -> Ran:
    """Each command in turn, echoed as make would, with this Python's scripts (torchrun,
    llmscale) in the checkout. While the train command runs, the machine's busy time less the
    command's own (`children_cpu_seconds`) is the other processes' load: on a shared machine
    the step time measured carries it, and the prediction carries the load of when its
    calibration was measured."""
    scripts = Path(sys.executable).parent
    lines: list[str] = []
    load = math.nan
    t0 = time.perf_counter()
    for i, cmd in enumerate(commands(root)):
        line = " ".join(cmd)
        lines.append(line)
        print(line, flush=True)
        meter, own = calibrate.LoadMeter(), children_cpu_seconds()
        rc = subprocess.call([str(scripts / cmd[0]), *cmd[1:]], cwd=root)
        if i == 0:
            wall, busy, _ = meter.stop()
            load = calibrate.other_load_cores(wall, busy, children_cpu_seconds() - own)
        if rc != 0:
            print(f"make demo: `{line}` exited {rc}", file=sys.stderr)
            return Ran(rc, time.perf_counter() - t0, lines, load)
    return Ran(0, time.perf_counter() - t0, lines, load)


def record(
    folder: Path,
    wall_s: float | None,
    load: tuple[float, float] | None,
    lines: list[str],
    measured_at: str,
    train_load: float | None = None,
) -> dict[str, Any]:
    """The demo's suite from its run folder (summary.json, metrics.jsonl), its wall time and the
    other processes' load while it trained (`train_load`, cores; None: not measured)."""
    summary_path = folder / SUMMARY
    if not summary_path.is_file():
        raise FileNotFoundError(f"{summary_path}: no summary of a finished run (run make demo)")
    summary = json.loads(summary_path.read_text())
    comparison = summary["comparison"]
    if comparison is None:
        raise ValueError(f"{summary_path}: the run printed no predicted-vs-measured table")
    metrics = [json.loads(s) for s in (folder / "metrics.jsonl").read_text().splitlines() if s]
    by_step = {m["step"]: m for m in metrics if m.get("kind") == "train"}
    layout = next(
        (h.removeprefix("layout: ") for h in summary["header"] if h.startswith("layout: ")),
        "1 process",
    )
    config = f"make demo, {layout}"
    rows = [_row(config, r) for r in comparison["rows"]]
    if wall_s is not None and load is not None:
        rows.append(wall_row(SUITE, "make demo", wall_s, load))
    return {
        SUITE: {
            "measured_at": measured_at,
            "title": "make demo: the tiny model on 4 CPU processes, predicted vs measured",
            "rows": rows,
            "tables": {},
            "notes": [
                "Step time: the median after the first step, rank 0; predicted from this "
                "machine's calibration and its ranks' shared-core costs (train/shared_cores.py)."
            ],
            "figures": [],
            "commands": lines,
            "run": {
                "header": summary["header"],
                "steps": [by_step[s] for s in summary["logged_steps"] if s in by_step],
                "closing": summary["closing"],
                "hardware": comparison["hardware"],
                "rank": comparison["rank"],
                "not_modelled": comparison["not_modelled"],
                "printed_at": comparison["printed_at"],
                "run_folder": summary["run_folder"],
                "training_other_load_cores": train_load,
            },
        }
    }


def _row(config: str, r: dict[str, Any]) -> dict[str, Any]:
    """A table row as results.json holds rows (a figure the run did not report: no ratio)."""
    row = Row(SUITE, config, r["quantity"], r["unit"], r["measured"], r["predicted"])
    return {**dataclasses.asdict(row), "ratio": row.ratio if row.measured is not None else None}


def _suite(rec: dict[str, Any]) -> dict[str, Any]:
    suite: dict[str, Any] = rec.get(SUITE, rec)
    return suite


def table_rows(rec: dict[str, Any]) -> list[Compared]:
    """The end-of-run table's rows of a record (every row but the wall time)."""
    return [
        Compared(r["quantity"], r["predicted"], r["measured"], r["unit"])
        for r in _suite(rec)["rows"]
        if r["quantity"] != WALL
    ]


def wall(rec: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in _suite(rec)["rows"] if r["quantity"] == WALL), None)


def step_ratio(rec: dict[str, Any]) -> float | None:
    """Predicted / measured step time of the recorded run."""
    r = next((r for r in table_rows(rec) if r.quantity == "step_time_s"), None)
    return r.predicted / r.measured if r and r.predicted is not None and r.measured else None


def transcript(rec: dict[str, Any]) -> list[str]:
    """What the train command printed (through a pipe), rendered from the record with its own
    renderers: header, the logged steps' lines, validation loss, the end-of-run table and the
    calibration line as of when the table was printed."""
    run = _suite(rec)["run"]
    return [
        *run["header"],
        *(plain(format_row(r)) for r in run["steps"]),
        *run["closing"],
        *comparison_table(
            table_rows(rec), run["hardware"], run["rank"], run["printed_at"], run["not_modelled"]
        ),
        f"run folder: {run['run_folder']}",
    ]


def load_line(rec: dict[str, Any]) -> str:
    """The other processes' load while the run trained next to their load while what predicted
    it was measured (the ranks' shared-core costs, the device's figures): on a shared machine
    the step time measured carries the one, the prediction the other. '' when not measured."""
    run = _suite(rec)["run"]
    during = run.get("training_other_load_cores")
    if during is None or not math.isfinite(during):
        return ""
    hw = run["hardware"]
    then = [
        f"{hw[k]['other_load_cores']:.2f} {what}"
        for k, what in (
            ("shared_cores", "while its ranks' shared-core costs were measured"),
            # one rank's figures, on its threads: the load on the cores they left idle is not
            # counted (train/calibration.py's contending_load)
            ("calibration", "on the cores the device's figures were measured on"),
        )
        if k in hw and math.isfinite(hw[k]["other_load_cores"])
    ]
    return f"other processes used {during:.2f} cores while the run trained" + "".join(
        f"; {t}" for t in then
    )


def write(rec: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1) + "\n")


def record_path(project: bool, out: Path | None = None) -> Path:
    """Where a demo's record goes: `out`, else the project's (`project`, make demo-record),
    else the run folder's (make demo: no tracked file changes)."""
    if out is not None:
        return out
    return RECORD if project else run_dir() / RUN_RECORD


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.bench.demo",
        description="make demo: train on 4 CPU processes, plot, plan; record the run and its "
        f"wall time in the run folder's {RUN_RECORD} (--record: in the project's "
        "docs/results/demo.json, from which make docs renders README's demo blocks)",
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument(
        "--out", type=Path, help=f"the record (default: RUN_DIR/{RUN_RECORD}, untracked)"
    )
    where.add_argument(
        "--record",
        action="store_true",
        help=f"write the project's record, {_shown(RECORD)}, and copy the run's loss curve to "
        f"{_shown(LOSS_IMAGE)} (make demo-record)",
    )
    ap.add_argument(
        "--record-only", action="store_true", help="record the run folder as it is, run nothing"
    )
    args = ap.parse_args(argv)
    out = record_path(args.record, args.out)
    wall_s = load = train_load = None
    lines = [" ".join(c) for c in commands()]
    if not args.record_only:
        before = os.getloadavg()[0]
        ran = run()
        if ran.rc != 0:
            return ran.rc
        wall_s, lines, train_load = ran.wall_s, ran.lines, ran.train_other_load_cores
        load = (before, os.getloadavg()[0])
    try:
        rec = record(run_dir(), wall_s, load, lines, now_iso(), train_load)
    except (OSError, ValueError, KeyError) as e:
        print(f"make demo: not recorded: {e}", file=sys.stderr)
        return 1
    write(rec, out)
    if args.record:  # README's loss curve is the recorded run's (`llmscale plot` drew it)
        plot = run_dir() / "loss.png"
        if plot.is_file():
            LOSS_IMAGE.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plot, LOSS_IMAGE)
            print(f"copied {_shown(plot)} to {_shown(LOSS_IMAGE)}")
    ratio = step_ratio(rec)
    print(
        f"recorded {_shown(out)}: step time predicted/measured "
        + (f"{ratio:.2f}" if ratio is not None else "-")
        + (f", make demo {wall_s:.0f} s" if wall_s is not None else "")
    )
    if line := load_line(rec):
        print(line)
    return 0


def _shown(path: Path) -> str:
    """`path` relative to the checkout where it is inside it."""
    try:
        return str(path.resolve().relative_to(SOURCE_ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
