"""The models (the presets) and hw (the hardware catalog)."""

from __future__ import annotations

import argparse

from llmscale.cli._args import (
    Parser,
    show,
)

# ---- models -------------------------------------------------------------------------------


def _add_models(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "models",
        help="list the model presets with their parameter counts",
        description="Table of model presets: shape, parameter count, and the published count.",
    )
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.report.models_report import models_table

    return show(models_table())


# ---- hw -----------------------------------------------------------------------------------


def _add_hw(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "hw",
        help="the hardware catalog: GPUs, links, node shapes, topologies",
        description=(
            "Print the planner's hardware catalog (src/llmscale/hardware/data/*.toml): "
            "accelerators with HBM and dense peak FLOP/s per dtype, links with per-direction "
            "bandwidth and alpha latency, node shapes and network topologies. Every number "
            "carries a source; --sources lists them."
        ),
        epilog="Example: llmscale hw --compare nvlink5 pcie5   (or two GPUs: h200 mi325x)",
    )
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="ratios of two links or two GPUs")
    p.add_argument("--sources", action="store_true", help="list the source of every number")
    p.set_defaults(func=_cmd_hw)


def _cmd_hw(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.hardware.catalog import default_catalog
    from llmscale.report import report
    from llmscale.ui import console

    cat = default_catalog()
    out = console()
    if args.compare:
        a, b = args.compare
        out.print(report.compare_table(cat, a, b))
        return 0
    if args.sources:
        out.print(report.sources_table(cat))
        return 0
    for table in report.hardware_tables(cat):
        out.print(table)
    return 0


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_models(sub)
    _add_hw(sub)
