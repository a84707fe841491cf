"""What `llmscale schedule` prints: one simulated pipeline step next to its closed forms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from llmscale.errors import ConfigError
from llmscale.plan.schedule import (
    Costs,
    SimResult,
    bubble_fraction,
    peak_inflight_closed_form,
)
from llmscale.report.gantt import text_gantt

# The closed form of each schedule's bubble (plan.schedule.bubble_fraction), as printed; the
# zero-bubble ones give idle time per rank with chunk costs F, B (input gradient), W.
FORMULAS = {
    "gpipe": "(p-1)/(m+p-1)",
    "1f1b": "(p-1)/(m+p-1)",
    "interleaved_1f1b": "(p-1)/(v*m+p-1)",
    "zero_bubble": "idle (p-1)(F+B-W) (ZB-H1)",
    "zbv": "idle (p-1)(F+B-2W) + (p-1)F skew (ZB-V)",
    "dualpipev": "idle (p-1)(F&B+B_full-3W), F&B = F+B_full (DualPipeV)",
}
# Where a closed form holds (the simulator's equal stages and free p2p aside).
CONDITIONS = {
    "zero_bubble": "W <= F and W <= B",
    "zbv": "F = B = W, m >= 2p-1",
    "dualpipev": "F = B = W",
}


class ScheduleReport(NamedTuple):
    """The simulated step and the lines that describe it (header, then the text Gantt chart)."""

    result: SimResult
    lines: list[str]
    closed_bubble: float | None  # the closed form, when the costs are scalars
    closed_peak: list[int]

    def json(self) -> dict[str, Any]:
        """`llmscale schedule --json`: the step's figures and every op, per rank."""
        res = self.result
        ops: list[list[dict[str, Any]]] = [[] for _ in range(res.pp)]
        for t in sorted(res.timeline, key=lambda t: (t.rank, t.start)):
            ops[t.rank].append(
                {
                    "kind": t.op.kind,
                    "stage": t.op.stage,
                    "chunk": t.op.chunk,
                    "microbatch": t.op.microbatch,
                    "start": t.start,
                    "end": t.end,
                }
            )
        return {
            "schedule": res.schedule,
            "pp": res.pp,
            "microbatches": res.microbatches,
            "chunks": res.chunks,
            "split_backward": res.split_backward,
            "makespan": res.makespan,
            "bubble_fraction": res.bubble_fraction,
            "closed_form_bubble": self.closed_bubble,
            "closed_form": FORMULAS.get(res.schedule),
            "peak_inflight": list(res.peak_inflight),
            "closed_form_peak_inflight": self.closed_peak,
            "busy": list(res.busy),
            "ops": ops,
        }


def _costs_text(t: Costs) -> str:
    return ",".join(f"{x:g}" for x in t) if isinstance(t, Sequence) else f"{t:g}"


def schedule_report(
    res: SimResult,
    *,
    t_fwd: Costs,
    t_bwd: Costs,
    t_p2p: float,
    width: int = 160,
    t_w: Costs | None = None,
) -> ScheduleReport:
    """Report the step `res` simulated with costs `t_fwd`, `t_bwd` (`t_w` of it the weight
    gradient, for the split schedules) and `t_p2p`: makespan, bubble and peak in-flight against
    the closed forms (which hold for equal stages and free p2p), then a Gantt chart at most
    `width` wide."""
    if not 10 <= width <= 1000:  # the chart is a list of width characters per rank
        raise ConfigError("width", width, "an integer in [10, 1000]")
    job = (res.schedule, res.pp, res.microbatches, res.chunks)
    scalar = all(isinstance(t, int | float) for t in (t_fwd, t_bwd)) and (
        t_w is None or isinstance(t_w, int | float)
    )
    closed: float | None = None
    if scalar:
        closed = bubble_fraction(*job, float(t_fwd), float(t_bwd), t_w)  # type: ignore[arg-type]
    elif not res.split_backward:  # a ratio of counts: the costs do not enter it
        closed = bubble_fraction(*job)
    closed_peak = peak_inflight_closed_form(*job)
    formula = FORMULAS.get(res.schedule, "")
    quantum, gantt = text_gantt(res, width)
    peaks = "  ".join(f"rank {r}: {n}" for r, n in enumerate(res.peak_inflight))
    costs = f"t_fwd={_costs_text(t_fwd)}  t_bwd={_costs_text(t_bwd)}"
    if res.split_backward:
        w_text = "t_bwd/2" if t_w is None else _costs_text(t_w)
        costs += f" (W: t_w={w_text}, B: the rest)"
    costs += f"  t_p2p={t_p2p:g}"
    cond = ", ".join(["equal stages", "free p2p", *filter(None, [CONDITIONS.get(res.schedule)])])
    closed_text = (
        f"closed form {formula} = {closed:.4f}, for {cond}"
        if closed is not None
        else f"closed form {formula}: for {cond} only"
    )
    held = "F to W" if res.split_backward else "F to B"
    kinds = "F/B/W forward/backward(input)/weight" if res.split_backward else "F/B forward/backward"
    lines = [
        f"schedule        {res.schedule}  pp={res.pp}  microbatches={res.microbatches}  "
        f"chunks={res.chunks}",
        f"costs           {costs}",
        f"makespan        {res.makespan:g}",
        f"bubble          {res.bubble_fraction:.4f}  ({closed_text})",
        f"peak in-flight  {peaks}  (microbatch-chunks of activations held, {held}; "
        f"closed form {' '.join(map(str, closed_peak))})",
        f"gantt           1 char = {quantum:g}; {kinds} + microbatch, "
        "lower case = odd chunk, . = idle",
        *gantt,
    ]
    return ScheduleReport(res, lines, closed, closed_peak)
