"""Gantt charts of a pipeline step (simulated or measured): text, one line per rank, and PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmscale.plan.schedule import SimResult

IDLE = "."


def _label(kind: str, chunk: int, microbatch: int) -> str:
    # Upper case for even chunks, lower case for odd ones: interleaving stays visible in text.
    letter = kind if chunk % 2 == 0 else kind.lower()
    return f"{letter}{microbatch}"


def text_gantt(result: SimResult, max_width: int = 160) -> tuple[float, list[str]]:
    """Return (time per character, one line per rank); each op box starts with e.g. "F3"/"b3"
    (and "W3"/"w3" for the weight-gradient ops of the zero-bubble schedules).

    The shortest op is as wide as the longest label when that fits in `max_width`; else the
    chart is scaled to `max_width` and boxes too narrow for their label show only its letter.
    """
    shortest = min(t.end - t.start for t in result.timeline)
    quantum = shortest / (1 + len(str(result.microbatches - 1)))
    # quantum is 0 when a short op vanishes in the rounding of a time far larger (t_bwd 1e15 x
    # t_fwd): then the chart is scaled to its width.
    if quantum <= 0 or result.makespan > quantum * max_width:
        quantum = result.makespan / max_width
    width = max(1, round(result.makespan / quantum))
    rows = [[IDLE] * width for _ in range(result.pp)]
    for t in result.timeline:
        a = min(width - 1, round(t.start / quantum))
        b = max(a + 1, min(width, round(t.end / quantum)))
        label = _label(t.op.kind, t.op.chunk, t.op.microbatch)
        # The box is the label, then its kind letter repeated to the box's end; never a cut
        # label, which would name the wrong microbatch.
        box = label + label[0] * (b - a - len(label)) if b - a >= len(label) else label[0] * (b - a)
        rows[t.rank][a:b] = list(box)
    pad = len(str(result.pp - 1))
    return quantum, [f"rank {r:>{pad}} |{''.join(row)}|" for r, row in enumerate(rows)]


# Forward blues, backward (input gradient) oranges, weight gradient greens; later chunks lighter.
_F_COLOURS = ("#1f4e9c", "#4a7fd0", "#86aee6", "#bcd3f3")
_B_COLOURS = ("#b85400", "#e07b24", "#f0a763", "#f7cba0")
_W_COLOURS = ("#2e7d32", "#5aa55e", "#93c995", "#c4e3c5")
_PALETTES = {"F": _F_COLOURS, "B": _B_COLOURS, "W": _W_COLOURS}


def draw_gantt_png(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """Draw the timeline to a PNG: one row per rank, microbatch numbers in the boxes."""
    return draw_gantts_png([result], path, [title])


def _default_title(result: SimResult) -> str:
    return (
        f"{result.schedule}  pp={result.pp}  microbatches={result.microbatches}  "
        f"chunks={result.chunks}  bubble={result.bubble_fraction:.3f}"
    )


def draw_gantts_png(
    results: Sequence[SimResult],
    path: str | Path,
    titles: Sequence[str | None] | None = None,
    time_unit: str = "time",
) -> Path:
    """Several timelines stacked in one PNG on one time axis (e.g. measured above simulated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    out = Path(path)
    titles = list(titles) if titles is not None else [None] * len(results)
    longest = max(len(r.timeline) / max(1, r.pp) for r in results)
    fig_w = min(24.0, max(8.0, 0.22 * longest))
    heights = [1.0 + 0.55 * r.pp for r in results]
    fig, axes = plt.subplots(
        len(results),
        1,
        figsize=(fig_w, sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    xmax = max(r.makespan for r in results)
    for ax, result, title in zip(axes[:, 0], results, titles, strict=True):
        _draw(ax, result, title or _default_title(result), xmax)
        ax.set_xlabel(time_unit)
        chunks = min(result.chunks, len(_F_COLOURS))
        handles = []
        backward = "backward (input)" if result.split_backward else "backward"
        for c in range(chunks):
            suffix = f" chunk {c}" if result.chunks > 1 else ""
            handles.append(Patch(color=_F_COLOURS[c], label=f"forward{suffix}"))
            handles.append(Patch(color=_B_COLOURS[c], label=f"{backward}{suffix}"))
            if result.split_backward:
                handles.append(Patch(color=_W_COLOURS[c], label=f"weight gradient{suffix}"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _draw(ax: Any, result: SimResult, title: str, xmax: float) -> None:
    for t in result.timeline:
        palette = _PALETTES[t.op.kind]
        colour = palette[t.op.chunk % len(palette)]
        ax.broken_barh(
            [(t.start, t.end - t.start)],
            (t.rank - 0.4, 0.8),
            facecolors=colour,
            edgecolors="white",
            linewidth=0.6,
        )
        text_colour = "white" if t.op.chunk % len(palette) < 2 else "black"
        ax.text(
            (t.start + t.end) / 2,
            t.rank,
            str(t.op.microbatch),
            ha="center",
            va="center",
            fontsize=7,
            color=text_colour,
        )
    ax.set_ylim(result.pp - 0.5, -0.5)  # rank 0 on top, as pipeline diagrams are drawn
    ax.set_yticks(range(result.pp), [f"rank {r}" for r in range(result.pp)])
    ax.set_xlim(0, xmax)
    ax.set_title(title)
