"""The schedule: a pipeline schedule simulated, as a table or a Gantt chart."""

from __future__ import annotations

import argparse

from llmscale.cli._args import (
    Parser,
)
from llmscale.config import (
    PP_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
)
from llmscale.errors import ConfigError
from llmscale.paths import check_image_file
from llmscale.plan.schedule import MAX_STAGE_MICROBATCHES

# ---- schedule -----------------------------------------------------------------------------

SCHEDULE_ALIASES = {"interleaved": "interleaved_1f1b"}


def _add_schedule(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "schedule",
        help="simulate a pipeline schedule: bubble, activations held, Gantt chart",
        description=(
            "Simulate one training step of a pipeline-parallel schedule and print its bubble "
            "fraction, makespan, peak activations held per rank and a text Gantt chart. "
            "Costs are per microbatch through one rank's whole model slice (a chunk op costs "
            "t/chunks); give a comma-separated list for one cost per stage (pp*chunks). "
            f"Sizes are capped at pp x chunks x microbatches <= {MAX_STAGE_MICROBATCHES:,} "
            "(about 2 s of simulation)."
        ),
    )
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument(
        "--schedule",
        default="1f1b",
        help=" | ".join(PP_SCHEDULES) + " (alias: interleaved); default 1f1b",
    )
    p.add_argument(
        "--chunks",
        type=int,
        help="model chunks per rank (interleaved, zero_bubble: >= 2, required; zbv, dualpipev: "
        "2, may be left out; else 1)",
    )
    p.add_argument("--t-fwd", default="1", help="forward time, or per-stage list (default 1)")
    p.add_argument(
        "--t-bwd", default="2", help="whole backward time, or per-stage list (default 2)"
    )
    p.add_argument(
        "--t-w",
        help="weight-gradient part of --t-bwd, or per-stage list (zero_bubble, zbv, dualpipev; "
        "default: half of --t-bwd; B gets the rest)",
    )
    p.add_argument("--t-p2p", default="0", help="latency of each cross-rank send (default 0)")
    p.add_argument(
        "--width", type=int, default=160, help="most characters of text Gantt (10 to 1000)"
    )
    p.add_argument("--png", help="also draw the Gantt chart to this PNG")
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON only: makespan, bubble_fraction, peak_inflight, ops per rank",
    )
    p.set_defaults(func=_cmd_schedule)


def _parse_costs(field: str, text: str) -> float | list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(field, text, "a number, or comma-separated numbers per stage") from None
    return values[0] if len(values) == 1 and "," not in text else values


def _cmd_schedule(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.plan.schedule import check_size, simulate
    from llmscale.report.gantt import draw_gantt_png
    from llmscale.report.schedule_report import schedule_report

    t_p2p = _parse_costs("t_p2p", args.t_p2p)
    if isinstance(t_p2p, list):
        raise ConfigError("t_p2p", args.t_p2p, "one number >= 0")
    t_fwd = _parse_costs("t_fwd", args.t_fwd)
    t_bwd = _parse_costs("t_bwd", args.t_bwd)
    t_w = None if args.t_w is None else _parse_costs("t_w", args.t_w)
    schedule = SCHEDULE_ALIASES.get(args.schedule, args.schedule)
    if t_w is not None and schedule not in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(
            "t_w",
            args.t_w,
            f"unset with --schedule {schedule} (its backward is one op: W is timed apart only "
            f"by {', '.join(SPLIT_BACKWARD_SCHEDULES)})",
        )
    chunks = _schedule_chunks(schedule, args.chunks)
    png = check_image_file("--png", args.png) if args.png else None
    check_size(args.pp, args.microbatches, chunks)
    res = simulate(schedule, args.pp, args.microbatches, chunks, t_fwd, t_bwd, t_p2p, t_w)
    rep = schedule_report(res, t_fwd=t_fwd, t_bwd=t_bwd, t_p2p=t_p2p, width=args.width, t_w=t_w)
    if args.json:
        import json

        print(json.dumps(rep.json()))
    else:
        print("\n".join(rep.lines))
    if png:
        wrote = draw_gantt_png(rep.result, png)
        if not args.json:
            print(f"wrote {wrote}")
    return 0


def _schedule_chunks(schedule: str, chunks: int | None) -> int:
    """--chunks: >= 2 for the loop-style multi-chunk schedules (one chunk per rank is plain
    1F1B), unset or 2 for the V schedules, else unset or 1."""
    from llmscale.config import LOOP_MULTI_CHUNK_SCHEDULES, V_SCHEDULES

    shown = "(not given)" if chunks is None else chunks
    if schedule in LOOP_MULTI_CHUNK_SCHEDULES and (chunks is None or chunks < 2):
        raise ConfigError("--chunks", shown, f">= 2 with --schedule {schedule}")
    if schedule in V_SCHEDULES:
        if chunks not in (None, 2):
            raise ConfigError("--chunks", shown, f"unset or 2 with --schedule {schedule}")
        return 2
    return 1 if chunks is None else chunks


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_schedule(sub)
