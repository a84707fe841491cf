"""Rows of (configuration, quantity, predicted, measured) and how they are shown and saved."""

from __future__ import annotations

import datetime
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from llmscale.ui import console, human_bytes


@dataclass
class Row:
    """One comparison. ratio = predicted / measured (1.0 is a perfect prediction)."""

    suite: str
    config: str
    quantity: str
    unit: str  # "B" bytes, "s" seconds, "%" percent, "" a plain number
    measured: float
    predicted: float | None = None
    note: str = ""
    # How far `measured` moves from run to run: half the interquartile range of the samples
    # it is the median of (`half_iqr`), in its unit; None where it is not such a median.
    spread: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or self.measured == 0:
            return None
        return self.predicted / self.measured

    def measured_text(self) -> str:
        """`measured` in its unit, with its spread where one was recorded ("38.3% +/- 0.4%")."""
        text = fmt(self.measured, self.unit)
        return text if self.spread is None else f"{text} +/- {fmt(self.spread, self.unit)}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def half_iqr(samples: Sequence[float]) -> float | None:
    """Half the interquartile range of `samples` (None for fewer than two): the spread a
    median of them is quoted with, robust to the odd slow step a shared host adds."""
    if len(samples) < 2:
        return None
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / 2


@dataclass
class SuiteResult:
    """A suite's rows, the figures it drew, and extra tables (title -> header, rows)."""

    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    tables: dict[str, tuple[list[str], list[list[str]]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "B":
        return human_bytes(value)
    if unit == "s":
        return f"{value * 1000:.1f} ms" if abs(value) < 10 else f"{value:.2f} s"
    if unit == "%":
        return f"{value:.1f}%"
    if unit == "tok/s":
        return f"{value:,.0f}"
    if unit == "x":
        return f"x{value:.3f}"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4g}"
    return f"{value:,.0f}"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None or not math.isfinite(r) else f"{r:.3f}"


def print_suite(result: SuiteResult) -> None:
    out = console()
    if result.rows:
        t = Table(title=result.title)
        for col in ("configuration", "quantity", "predicted", "measured", "pred/meas", "note"):
            t.add_column(
                col, justify="left" if col in ("configuration", "quantity", "note") else "right"
            )
        for r in result.rows:
            t.add_row(
                r.config,
                r.quantity,
                fmt(r.predicted, r.unit),
                r.measured_text(),
                fmt_ratio(r.ratio),
                r.note,
            )
        out.print(t)
    for title, (header, rows) in result.tables.items():
        t = Table(title=title)
        for h in header:
            t.add_column(h, justify="right")
        for row in rows:
            t.add_row(*row)
        out.print(t)
    for note in result.notes:
        out.print(note)
    for fig in result.figures:
        out.print(f"wrote {fig}")


def markdown(results: list[SuiteResult], header: str = "", base: Path | None = None) -> str:
    """The results as Markdown (docs/results.md), figures linked relative to `base`."""
    lines = [header] if header else []
    for res in results:
        lines += [f"## {res.title}", ""]
        if res.rows:
            lines += [
                "| configuration | quantity | predicted | measured | pred/meas | note |",
                "|---|---|---:|---:|---:|---|",
            ]
            lines += [
                f"| {r.config} | {r.quantity} | {fmt(r.predicted, r.unit)} | {r.measured_text()} | {fmt_ratio(r.ratio)} | {r.note} |"
                for r in res.rows
            ]
            lines.append("")
        for title, (head, rows) in res.tables.items():
            lines += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            lines.append("")
        lines += [n + "\n" for n in res.notes]
        for fig in res.figures:
            rel = fig.relative_to(base) if base is not None and fig.is_relative_to(base) else fig
            lines += [f"![{fig.stem}]({rel.as_posix()})", ""]
    return "\n".join(lines)


def write_json(results: list[SuiteResult], path: Path) -> None:
    """Each suite's rows, tables, notes and figures, with `measured_at` (UTC, ISO 8601): when
    this file was written, which `llmscale claims` quotes next to every measured figure."""
    measured_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    data = {
        r.name: {
            "measured_at": measured_at,
            "title": r.title,
            "rows": [row.to_dict() for row in r.rows],
            "tables": {k: {"header": h, "rows": rows} for k, (h, rows) in r.tables.items()},
            "notes": r.notes,
            "figures": [str(f) for f in r.figures],
        }
        for r in results
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def predicted_vs_measured_bars(
    labels: list[str],
    predicted: list[float],
    measured: list[float],
    path: Path,
    title: str,
    ylabel: str,
    measured_label: str = "measured",
) -> Path:
    """One pair of bars (planner, measurement) per configuration, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels)), 4.5))
    ax.bar(x - 0.2, predicted, 0.4, label="predicted (planner)")
    ax.bar(x + 0.2, measured, 0.4, label=measured_label)
    ax.set_xticks(x, labels, fontsize=7 if len(labels) > 8 else 9)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
