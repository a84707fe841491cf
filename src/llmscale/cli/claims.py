"""The claims: the article's claims checked against the catalog, planner and measurements."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmscale.cli._args import (
    Parser,
)
from llmscale.errors import ConfigError
from llmscale.paths import check_output_file

# ---- claims -------------------------------------------------------------------------------


def _add_claims(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "claims",
        help="the article's claims, each with llmscale's figure and a verdict",
        description=(
            "Check every claim of the article 'Distributed Solutions: Practical Approaches to "
            "Scale LLM Compute, Part 2' against llmscale (validation/claims.py): catalog, planner, "
            "schedule simulator and serving model figures computed on the spot, measured ones "
            "read from --results (written by make results, with when). Verdicts: holds | holds "
            "with a caveat | does not hold here | not measured | restates its source, each from "
            "the row's checks. Trains nothing; about a second."
        ),
        epilog="Example: llmscale claims --markdown docs/claims.md   (make claims)",
    )
    p.add_argument("--json", action="store_true", help='print {"claims": [...]} as JSON')
    p.add_argument("--markdown", metavar="FILE", help="write the table as Markdown to FILE")
    p.add_argument(
        "--results",
        metavar="FILE",
        default=None,
        help="measured results (default: this checkout's docs/results/results.json, found from "
        "the package, not the working directory; when that is missing, measured rows say not measured; a given FILE that is missing is an error)",
    )
    p.set_defaults(func=_cmd_claims)


def _cmd_claims(args: argparse.Namespace, overrides: list[str]) -> int:
    import json
    import sys

    from rich.table import Table

    from llmscale.ui import console
    from llmscale.validation.claims import (
        DEFAULT_RESULTS,
        check_claims,
        results_notice,
        to_json,
        to_markdown,
    )

    results = Path(args.results) if args.results else DEFAULT_RESULTS
    if args.results and not results.is_file():
        # Only a path the user gave is an error; a missing default (a wheel, no make results)
        # stays the notice below: measured rows say "not measured".
        why = "a folder" if results.is_dir() else "missing"
        raise ConfigError(
            "--results", args.results, f"a results JSON file, as make results writes ({why})"
        )
    if args.markdown:
        check_output_file("markdown", args.markdown)
    rows = check_claims(results)
    # A notice, never a verdict: stale or missing results are used (or not) as they are.
    notice = results_notice(results)
    if notice:
        print(f"llmscale claims: note: {notice}", file=sys.stderr)
    if args.markdown:
        label = "docs/results/results.json" if results == DEFAULT_RESULTS else str(results)
        Path(args.markdown).write_text(to_markdown(rows, label))
    if args.json:
        print(json.dumps(to_json(rows), indent=2))
        return 0
    t = Table(title="The article's claims, checked (docs/claims.md)", show_lines=True)
    for col in ("claim", "llmscale's figure", "verdict", "why"):
        t.add_column(col)
    for r in rows:
        t.add_row(r.claim, r.figure, r.verdict, r.why)
    out = console()
    out.print(t)
    if args.markdown:
        out.print(f"wrote {args.markdown}")
    return 0


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_claims(sub)
