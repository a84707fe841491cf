"""Command line: parse, validate, call. Bad input exits with code 2 and one line naming the field."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from llmscale.errors import ConfigError, UsageError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line on stderr and exit code 2 (its own default code)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"llmscale {self.prog.split()[-1]}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


# ---- train --------------------------------------------------------------------------------


def _add_train(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (one process, or many under torchrun)",
        description=(
            "Train a decoder LLM from a TOML config. Any config key can be overridden as "
            "--section.key value (e.g. --train.steps 20 --precision.mode bf16). "
            "Run under `torchrun --nproc-per-node N` for N processes."
        ),
        epilog="Sections: [job] [model] [data] [train] [precision] [optimizer] [lr_scheduler] "
        "[checkpoint] [metrics] [parallel]; see configs/default.toml for every key.",
    )
    p.add_argument("--config", help="TOML config file (default: built-in defaults)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.set_defaults(func=_cmd_train, accepts_overrides=True)


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.config import load_config

    if args.resume:
        overrides = [*overrides, "--checkpoint.resume", "true"]
    cfg = load_config(args.config, overrides)
    from llmscale.train.trainer import run_training

    run_training(cfg)
    return 0


# ---- plot ---------------------------------------------------------------------------------


def _add_plot(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "plot",
        help="draw a run's loss curve and throughput to PNG",
        description="Read RUN_DIR/metrics.jsonl and write RUN_DIR/loss.png (or --out). With "
        "--timeline, draw the CPU-offload pipeline of RUN_DIR/timeline-rank0.json to "
        "RUN_DIR/timeline.png instead.",
    )
    p.add_argument("run_dir", help="folder a `llmscale train` run wrote")
    p.add_argument("--out", help="PNG path (default: RUN_DIR/loss.png or RUN_DIR/timeline.png)")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="draw the offload pipeline timeline (runs with optimizer.offload = 'optimizer')",
    )
    p.add_argument(
        "--step",
        type=int,
        action="append",
        help="with --timeline: an optimizer step to draw (1-based; repeatable; default the last two)",
    )
    p.set_defaults(func=_cmd_plot)


def _cmd_plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.train.plot import plot_run, plot_timeline

    if args.step and not args.timeline:
        raise UsageError("--step only applies with --timeline")
    if args.timeline:
        steps = [s - 1 for s in args.step] if args.step else None
        out = plot_timeline(args.run_dir, args.out, steps)
    else:
        out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0


# ---- models -------------------------------------------------------------------------------


def _add_models(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "models",
        help="list the model presets with their parameter counts",
        description="Table of model presets: shape, parameter count, and the published count.",
    )
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.table import Table

    from llmscale.model.config import PRESETS
    from llmscale.ui import console

    t = Table(title="llmscale model presets")
    for col in ("name", "layers", "dim", "heads", "kv", "ffn", "vocab", "params", "published"):
        t.add_column(col, justify="left" if col == "name" else "right")
    for m in PRESETS.values():
        pub = f"{m.published_params:,}" if m.published_params else "-"
        t.add_row(
            m.name,
            str(m.n_layers),
            str(m.dim),
            str(m.n_heads),
            str(m.n_kv_heads),
            str(m.ffn_dim),
            str(m.vocab_size),
            f"{m.num_params():,}",
            pub,
        )
    console().print(t)
    return 0


# ---- schedule -----------------------------------------------------------------------------

_SCHEDULE_ALIASES = {"interleaved": "interleaved_1f1b"}


def _add_schedule(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "schedule",
        help="simulate a pipeline schedule: bubble, activations held, Gantt chart",
        description=(
            "Simulate one training step of a pipeline-parallel schedule and print its bubble "
            "fraction, makespan, peak activations held per rank and a text Gantt chart. "
            "Costs are per microbatch through one rank's whole model slice (a chunk op costs "
            "t/chunks); give a comma-separated list for one cost per stage (pp*chunks)."
        ),
    )
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument(
        "--schedule",
        default="1f1b",
        help="gpipe | 1f1b | interleaved_1f1b (alias: interleaved); default 1f1b",
    )
    p.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("--t-fwd", default="1", help="forward time, or per-stage list (default 1)")
    p.add_argument("--t-bwd", default="2", help="backward time, or per-stage list (default 2)")
    p.add_argument("--t-p2p", default="0", help="latency of each cross-rank send (default 0)")
    p.add_argument("--width", type=int, default=160, help="most characters of text Gantt")
    p.add_argument("--png", help="also draw the Gantt chart to this PNG")
    p.set_defaults(func=_cmd_schedule)


def _parse_costs(field: str, text: str) -> float | list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(field, text, "a number, or comma-separated numbers per stage") from None
    return values[0] if len(values) == 1 and "," not in text else values


def _cmd_schedule(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.plan.gantt import draw_gantt_png, text_gantt
    from llmscale.plan.schedule import bubble_fraction, peak_inflight_closed_form, simulate

    schedule = _SCHEDULE_ALIASES.get(args.schedule, args.schedule)
    t_p2p = _parse_costs("t_p2p", args.t_p2p)
    if isinstance(t_p2p, list):
        raise ConfigError("t_p2p", args.t_p2p, "one number >= 0")
    res = simulate(
        schedule,
        args.pp,
        args.microbatches,
        args.chunks,
        t_fwd=_parse_costs("t_fwd", args.t_fwd),
        t_bwd=_parse_costs("t_bwd", args.t_bwd),
        t_p2p=t_p2p,
    )
    closed = bubble_fraction(schedule, args.pp, args.microbatches, args.chunks)
    closed_peak = peak_inflight_closed_form(schedule, args.pp, args.microbatches, args.chunks)
    formula = "(p-1)/(v*m+p-1)" if schedule == "interleaved_1f1b" else "(p-1)/(m+p-1)"
    if args.width < 10:
        raise ConfigError("width", args.width, "an integer >= 10")
    quantum, lines = text_gantt(res, args.width)
    peaks = "  ".join(f"rank {r}: {n}" for r, n in enumerate(res.peak_inflight))
    print(
        f"schedule        {schedule}  pp={res.pp}  microbatches={res.microbatches}  "
        f"chunks={res.chunks}"
    )
    print(f"costs           t_fwd={args.t_fwd}  t_bwd={args.t_bwd}  t_p2p={args.t_p2p}")
    print(f"makespan        {res.makespan:g}")
    print(
        f"bubble          {res.bubble_fraction:.4f}  "
        f"(closed form {formula} = {closed:.4f}, for equal stages and free p2p)"
    )
    print(
        f"peak in-flight  {peaks}  (microbatch-chunks of activations held; "
        f"closed form {' '.join(map(str, closed_peak))})"
    )
    print(
        f"gantt           1 char = {quantum:g}; F/B forward/backward + microbatch, "
        "lower case = odd chunk, . = idle"
    )
    for line in lines:
        print(line)
    if args.png:
        print(f"wrote {draw_gantt_png(res, args.png)}")
    return 0


# ---- entry point --------------------------------------------------------------------------

_COMMANDS: list[Callable[[argparse._SubParsersAction[_Parser]], None]] = [
    _add_train,
    _add_plot,
    _add_models,
    _add_schedule,
]


def build_parser() -> _Parser:
    parser = _Parser(
        prog="llmscale",
        allow_abbrev=False,
        description="Train GPT-style decoder LLMs past the memory wall, and plan how to scale them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in _COMMANDS:
        add(sub)
    return parser


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `--section.key value` / `--section.key=value` overrides from the other arguments."""
    plain: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            overrides.append(a)
            if "=" not in a and i + 1 < len(argv):
                overrides.append(argv[i + 1])
                i += 1
        else:
            plain.append(a)
        i += 1
    return plain, overrides


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    plain, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(plain)
    if overrides and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
        return int(args.func(args, overrides))
    except (ConfigError, UsageError) as e:
        sys.stderr.write(f"llmscale {args.command}: error: {e}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write(f"llmscale {args.command}: interrupted\n")
        return 130
