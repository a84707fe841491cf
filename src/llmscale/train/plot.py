"""`llmscale plot RUN_DIR`: loss curve and throughput of a run, as one PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmscale.errors import UsageError
from llmscale.paths import check_image_file


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw train (and validation) loss and tokens/s against step; returns the PNG path."""
    run = Path(run_dir)
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(
            f"run_dir: no metrics.jsonl in {str(run)!r} (is it a `llmscale train` folder?)"
        )
    target = check_image_file("--out", out if out else run / "loss.png")
    rows = read_metrics(path)
    train = {r["step"]: r for r in rows if r.get("kind") == "train"}  # last row per step wins
    if not train:
        raise UsageError(f"run_dir: {path} has no training steps yet")
    steps = sorted(train)
    val = [(r["step"], _number(r["val_loss"])) for r in rows if "val_loss" in r]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [_number(train[s]["loss"]) for s in steps], label="train")
    if val:
        ax_loss.plot(*zip(*val, strict=True), "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_tps.plot(steps, [_number(train[s]["tokens_per_s"]) for s in steps], color="tab:green")
    ax_tps.set(xlabel="step", ylabel="tokens / s", title="throughput")
    ax_tps.grid(alpha=0.3)
    fig.suptitle(run.name)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows, each with an integer step; a damaged line is a one-line error naming
    it (a last line cut short by a killed run is skipped: the rows before it are intact)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):
                continue
            raise UsageError(
                f"run_dir: {path} line {n} is not a JSON object ({e.msg}); allowed: "
                "metrics.jsonl as `llmscale train` writes it, one JSON object per line"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("step", 0), int):
            raise UsageError(
                f"run_dir: {path} line {n} is not a metrics row (a JSON object with an integer "
                "step)"
            )
        rows.append(row)
    return rows


def _number(value: Any) -> float:
    """A metric as a float: metrics.jsonl writes inf and nan as strings (JSON has neither)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


# ---- the offload pipeline's timeline ------------------------------------------------------

PHASE_COLORS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "wait": "tab:red",
    "download": "tab:purple",
    "accumulate": "tab:pink",
    "norm": "tab:olive",
    "update": "tab:green",
    "cast": "tab:cyan",
    "upload": "tab:brown",
    "fetch": "sienna",  # optimizer+params: a unit's parameters up before its forward
    "refetch": "peru",  # ... and again before its backward
    "resident": "lightsteelblue",  # the unit's parameters are on the device
}


def timeline_path(run_dir: str | Path, rank: int = 0) -> Path:
    return Path(run_dir) / f"timeline-rank{rank}.json"


def plot_timeline(
    run_dir: str | Path,
    out: str | Path | None = None,
    steps: list[int] | None = None,
    rank: int = 0,
) -> Path:
    """Draw the offload pipeline's lanes (compute, d2h, cpu, h2d; params) over two optimizer steps.

    By default the last two steps that ran an update; every interval inside their time window
    is drawn, whichever step it belongs to (a step's uploads run under the next one's forward).
    """
    from llmscale.offload.timeline import LANES, PARAMS_LANE, overlap_stats, read_timeline

    path = timeline_path(run_dir, rank)
    if not path.is_file():
        raise UsageError(
            f"run_dir: no {path.name} in {str(run_dir)!r} (written by runs with "
            "optimizer.offload = 'optimizer' or 'optimizer+params')"
        )
    try:
        meta, ivs = read_timeline(path)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is one
        raise UsageError(
            f"run_dir: {path} is not a timeline as `llmscale train` writes it "
            f"({type(e).__name__}: {e})"
        ) from None
    updated = sorted({iv.step for iv in ivs if iv.phase == "update"})
    if not updated:
        raise UsageError(f"run_dir: {path} has no optimizer update yet")
    target = check_image_file("--out", out if out else Path(run_dir) / "timeline.png")
    chosen = steps or updated[-2:]
    missing = [s for s in chosen if s not in {iv.step for iv in ivs}]
    if missing:  # steps are 0-based here, 1-based on the command line and in the chart
        raise UsageError(
            f"--step: {[s + 1 for s in missing]} not in {path} (it keeps steps "
            f"{[s + 1 for s in updated]})"
        )
    mine = [iv for iv in ivs if iv.step in chosen]
    t0 = min(iv.start for iv in mine)
    t1 = max(iv.end for iv in mine)
    shown = [iv for iv in ivs if iv.end > t0 and iv.start < t1]
    stats = overlap_stats(ivs, chosen)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with_params = any(iv.lane == PARAMS_LANE for iv in shown)
    fig, ax = plt.subplots(figsize=(13, 4.4 if with_params else 3.8))
    lanes = [lane for lane in LANES if lane != PARAMS_LANE or with_params][::-1]
    units = list(meta.get("units", []))
    for iv in shown:
        y, h = lanes.index(iv.lane) - 0.4, 0.8
        if iv.lane == PARAMS_LANE:  # consecutive units overlap: alternate two sub-rows
            y += 0.42 if iv.unit in units and units.index(iv.unit) % 2 else 0.0
            h = 0.38
        ax.broken_barh(
            [(1e3 * (iv.start - t0), 1e3 * (iv.end - iv.start))],
            (y, h),
            facecolors=PHASE_COLORS.get(iv.phase, "gray"),
            edgecolor="white" if iv.lane == PARAMS_LANE else None,
            linewidth=0.5 if iv.lane == PARAMS_LANE else 0,
        )
    for s in chosen:
        first = min(iv.start for iv in ivs if iv.step == s and iv.lane == "compute")
        ax.axvline(1e3 * (first - t0), color="black", linestyle=":", linewidth=0.8)
        ax.text(1e3 * (first - t0), len(lanes) - 0.45, f" step {s + 1}", fontsize=8)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("ms")
    ax.set_ylim(-0.6, len(lanes) - 0.2)
    used = [p for p in PHASE_COLORS if any(iv.phase == p for iv in shown)]
    ax.legend(
        handles=[Patch(color=PHASE_COLORS[p], label=p) for p in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22),
        ncol=len(used),
        fontsize=8,
    )
    ax.set_title(
        f"offload pipeline on {meta.get('device', '?')} (overlap={meta.get('overlap')}, "
        f"update in backward={meta.get('update_in_backward')}): "
        f"{stats.hidden_fraction:.0%} of {1e3 * stats.offload_s:.1f} ms transfer+update "
        "time under compute",
        fontsize=10,
    )
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target
