"""Command line: parse, validate, call. Bad input exits with code 2 and one line naming the field.

One module per command family, each with `add(sub)` registering its commands; `_args` holds what
they share."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Sequence

from llmscale import __version__
from llmscale.cli import bench, claims, data, hardware, plan, run, schedule, studies, train
from llmscale.cli._args import EXIT_USAGE, Parser, one_line
from llmscale.errors import ConfigError, JobStopped, UsageError

__all__ = ["EXIT_USAGE", "build_parser", "main", "one_line", "split_overrides"]

# ---- entry point --------------------------------------------------------------------------


def build_parser() -> Parser:
    parser = Parser(
        prog="llmscale",
        description="Train GPT-style decoder LLMs past the memory wall, and plan how to scale them.",
    )
    parser.add_argument("--version", action="version", version=f"llmscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for family in (train, hardware, schedule, plan, studies, claims, bench, run, data):
        family.add(sub)
    for command_parser in sub.choices.values():
        # Errors found after parsing (arguments no command takes) name the command.
        command_parser.set_defaults(command_parser=command_parser)
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


def _speaks(reporter_rank: int = 0) -> bool:
    """Under torchrun every rank meets the same bad input or stop: one of them (rank 0, or the
    rank a lost-peer error names) prints it, the others only exit with its code."""
    return int(os.environ.get("RANK", "0")) == reporter_rank


def _override_hint(unknown: list[str]) -> str:
    """`train --steps 3`: the keys a flag may have meant, " (did you mean --train.steps?)"."""
    from llmscale.config import JobConfig

    cfg = JobConfig()
    sections = {
        f.name: {k.name for k in dataclasses.fields(getattr(cfg, f.name))}
        for f in dataclasses.fields(cfg)
    }
    meant = [
        f"--{section}.{a[2:].split('=', 1)[0].replace('-', '_')}"
        for a in unknown
        if a.startswith("--")
        for section, keys in sections.items()
        if a[2:].split("=", 1)[0].replace("-", "_") in keys
    ]
    return f" (did you mean {' or '.join(meant)}?)" if meant else ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    plain, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args, unknown = parser.parse_known_args(plain)
    if not getattr(args, "accepts_overrides", False):
        unknown += overrides
    if unknown:
        hint = _override_hint(unknown) if getattr(args, "accepts_overrides", False) else ""
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])  # the command's own arguments
    try:
        return int(args.func(args, overrides))
    except (ConfigError, UsageError) as e:
        if _speaks():
            sys.stderr.write(one_line(f"llmscale {args.command}: error: {e}") + "\n")
        return EXIT_USAGE
    except JobStopped as e:
        if _speaks(getattr(e, "reporter_rank", 0)):
            sys.stderr.write(one_line(f"llmscale {args.command}: {e}") + "\n")
        from llmscale.train.launch import under_launcher

        if int(e.code) == 130 and under_launcher():
            # Stopped by a Ctrl-C with its checkpoint written: under a launcher the same Ctrl-C
            # can still arrive, forwarded, while this process exits; it is not a second one.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return int(e.code)
    except KeyboardInterrupt:
        sys.stderr.write(f"llmscale {args.command}: interrupted\n")
        return 130
