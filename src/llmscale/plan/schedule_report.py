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
    check_size,
    peak_inflight_closed_form,
    simulate,
)


class ScheduleReport(NamedTuple):
    """The simulated step and the lines that describe it (header, then the text Gantt chart)."""

    result: SimResult
    lines: list[str]


def _costs_text(t: Costs) -> str:
    return ",".join(f"{x:g}" for x in t) if isinstance(t, Sequence) else f"{t:g}"


def schedule_report(
    schedule: str,
    pp: int,
    microbatches: int,
    chunks: int = 1,
    *,
    t_fwd: Costs = 1.0,
    t_bwd: Costs = 2.0,
    t_p2p: float = 0.0,
    width: int = 160,
) -> ScheduleReport:
    """Simulate `schedule` and report makespan, bubble and peak in-flight against the closed
    forms (which hold for equal stages and free p2p), then a Gantt chart at most `width` wide."""
    check_size(pp, microbatches, chunks)
    res = simulate(schedule, pp, microbatches, chunks, t_fwd=t_fwd, t_bwd=t_bwd, t_p2p=t_p2p)
    if width < 10:
        raise ConfigError("width", width, "an integer >= 10")
    closed = bubble_fraction(schedule, pp, microbatches, chunks)
    closed_peak = peak_inflight_closed_form(schedule, pp, microbatches, chunks)
    formula = "(p-1)/(v*m+p-1)" if schedule == "interleaved_1f1b" else "(p-1)/(m+p-1)"
    quantum, gantt = text_gantt(res, width)
    peaks = "  ".join(f"rank {r}: {n}" for r, n in enumerate(res.peak_inflight))
    costs = f"t_fwd={_costs_text(t_fwd)}  t_bwd={_costs_text(t_bwd)}  t_p2p={t_p2p:g}"
    lines = [
        f"schedule        {schedule}  pp={res.pp}  microbatches={res.microbatches}  "
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
