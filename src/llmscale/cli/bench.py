"""The bench: measured next to predicted on this machine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from llmscale.cli._args import (
    Parser,
    one_of,
)
from llmscale.config import (
    DEVICES,
)
from llmscale.errors import ConfigError, UsageError
from llmscale.paths import check_output_file, check_output_folder
from llmscale.stack import STACK_NAMES, stacks_help

# ---- bench --------------------------------------------------------------------------------


def _add_bench(sub: argparse._SubParsersAction[Parser]) -> None:
    from llmscale.bench.suites import SUITES

    p = sub.add_parser(
        "bench",
        help="measure what the planner predicts: short real trainings, predicted vs measured",
        description=(
            "Run short real trainings on this machine and print, for each configuration, what "
            "the planner predicts, what was measured, and their ratio (predicted / measured). "
            "Suites: memory (parameters, gradients, optimizer, activations per recompute mode and "
            "micro-batch), time (step time against a device calibrated by micro-benchmarks), "
            "recompute (time overhead of each mode), accum (micro-batch x accumulation pairs), "
            "precision (fp32/bf16/fp16 and the fp16 underflow report), pipeline (measured bubble "
            "of real pp runs vs the schedule simulator), loader (tokens/s and resident memory of the "
            "memory-mapped shard loader from 100 MB to 4 GB of tokens, next to a training step), "
            "compile (step time eager vs train.compile, the compile time apart). "
            "`all` runs every suite."
        ),
    )
    p.add_argument("--model", default="small", help="model preset (default: small)")
    p.add_argument(
        "--what",
        default="all",
        help="comma-separated suites: " + ", ".join(SUITES) + ", or all (default: all)",
    )
    p.add_argument("--seq", type=int, default=128, help="sequence length (default: 128)")
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps per configuration (default: 3)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: 1)")
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="independent runs for figures that vary from run to run, e.g. the fp16 underflow "
        "share (default: 3)",
    )
    p.add_argument(
        "--stack",
        choices=STACK_NAMES,
        metavar="NAME",
        help="with --what published: only the published runs of this training stack (default: "
        "every stack). " + stacks_help(),
    )
    p.add_argument("--device", default="auto", help=" | ".join(DEVICES) + " (default: auto)")
    p.add_argument("--png", metavar="DIR", help="write the suites' plots into DIR")
    p.add_argument("--json-out", metavar="FILE", help="write every row as JSON to FILE")
    p.add_argument(
        "--markdown", metavar="FILE", help="write the results as Markdown (docs/results.md)"
    )
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace, overrides: list[str]) -> int:
    import tempfile

    from llmscale.bench.report import write_json
    from llmscale.bench.results_page import write_results_page
    from llmscale.bench.suites import SUITES
    from llmscale.model.config import get_preset

    names = list(SUITES) if args.what == "all" else [w.strip() for w in args.what.split(",")]
    for n in names:
        if n not in SUITES:
            raise ConfigError("--what", n, " | ".join([*SUITES, "all"]))
    get_preset(args.model)
    for name in ("seq", "steps", "seeds"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name}", getattr(args, name), "a positive integer")
    if args.warmup < 0:
        raise ConfigError("--warmup", args.warmup, ">= 0")
    one_of("--device", args.device, DEVICES)
    if args.stack is not None and names != ["published"]:
        raise UsageError("--stack applies to --what published (the other suites run llmscale)")
    # Where the results go, checked before minutes of measuring.
    if args.json_out:
        check_output_file("--json-out", args.json_out)
    if args.markdown:
        check_output_file("--markdown", args.markdown)
    if args.png:
        check_output_folder("--png", args.png)
    with tempfile.TemporaryDirectory(prefix="llmscale-bench-") as work:
        results = _run_suites(names, args, Path(work))
    if args.json_out:
        write_json(results, Path(args.json_out))
    if args.markdown:
        command = (
            f"llmscale bench --model {args.model} --what {args.what} --seq {args.seq} "
            f"--steps {args.steps} --seeds {args.seeds}"
        )
        write_results_page(results, Path(args.markdown), command)
    return 0


def _run_suites(names: list[str], args: argparse.Namespace, work: Path) -> list[Any]:
    """Each suite in turn, its jobs' folders under `work` (removed afterwards, errors included)."""
    from llmscale.bench.report import print_suite
    from llmscale.bench.runner import BenchOptions
    from llmscale.bench.suites import get_suite
    from llmscale.train.memcheck import OVERRIDE_HINT

    opts = BenchOptions(
        model=args.model,
        seq_len=args.seq,
        steps=args.steps,
        warmup=args.warmup,
        device=args.device,
        seeds=args.seeds,
        png_dir=Path(args.png) if args.png else None,
        work_dir=work,
        stack=args.stack,
    )
    results = []
    try:
        for n in names:
            res = get_suite(n)(opts)
            print_suite(res)
            results.append(res)
    except UsageError as e:  # the memory check's advice names a key bench does not take
        if OVERRIDE_HINT not in str(e):
            raise
        raise UsageError(
            str(e).replace(OVERRIDE_HINT, "a smaller --model or --seq fits this machine")
        ) from None
    return results


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_bench(sub)
