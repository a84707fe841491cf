"""What `llmscale schedule` prints: one simulated pipeline step next to its closed forms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from llmscale.errors import ConfigError
from llmscale.plan.gantt import text_gantt
from llmscale.plan.schedule import (
    Costs,
    SimResult,
    bubble_fraction,
    peak_inflight_closed_form,
)


class ScheduleReport(NamedTuple):
    """The simulated step and the lines that describe it (header, then the text Gantt chart)."""

    result: SimResult
    lines: list[str]


def _costs_text(t: Costs) -> str:
    return ",".join(f"{x:g}" for x in t) if isinstance(t, Sequence) else f"{t:g}"


def schedule_report(
    res: SimResult, *, t_fwd: Costs, t_bwd: Costs, t_p2p: float, width: int = 160
) -> ScheduleReport:
    """Report the step `res` simulated with costs `t_fwd`, `t_bwd` and `t_p2p`: makespan, bubble
    and peak in-flight against the closed forms (which hold for equal stages and free p2p), then
    a Gantt chart at most `width` wide."""
    if not 10 <= width <= 1000:  # the chart is a list of width characters per rank
        raise ConfigError("width", width, "an integer in [10, 1000]")
    job = (res.schedule, res.pp, res.microbatches, res.chunks)
    closed = bubble_fraction(*job)
    closed_peak = peak_inflight_closed_form(*job)
    formula = "(p-1)/(v*m+p-1)" if res.schedule == "interleaved_1f1b" else "(p-1)/(m+p-1)"
    quantum, gantt = text_gantt(res, width)
    peaks = "  ".join(f"rank {r}: {n}" for r, n in enumerate(res.peak_inflight))
    costs = f"t_fwd={_costs_text(t_fwd)}  t_bwd={_costs_text(t_bwd)}  t_p2p={t_p2p:g}"
    lines = [
        f"schedule        {res.schedule}  pp={res.pp}  microbatches={res.microbatches}  "
        f"chunks={res.chunks}",
        f"costs           {costs}",
        f"makespan        {res.makespan:g}",
        f"bubble          {res.bubble_fraction:.4f}  "
        f"(closed form {formula} = {closed:.4f}, for equal stages and free p2p)",
        f"peak in-flight  {peaks}  (microbatch-chunks of activations held; "
        f"closed form {' '.join(map(str, closed_peak))})",
        f"gantt           1 char = {quantum:g}; F/B forward/backward + microbatch, "
        "lower case = odd chunk, . = idle",
        *gantt,
    ]
    return ScheduleReport(res, lines)
