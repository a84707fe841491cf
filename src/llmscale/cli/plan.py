"""The plan: the fastest layouts that fit, searched or fixed."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from llmscale.cli._args import (
    Parser,
    add_model_arg,
    add_stack_option_args,
    one_of,
    stack_options_given,
)
from llmscale.cli.schedule import SCHEDULE_ALIASES
from llmscale.config import (
    FLOAT8_RECIPES,
    PP_SCHEDULES,
    PRECISIONS,
    RECOMPUTE_MODES,
    ZERO_STAGES,
    float8_recipe_needs_fp8,
)
from llmscale.errors import ConfigError
from llmscale.paths import check_image_file
from llmscale.stack import (
    STACK_NAMES,
    float8_recipe_help,
    offload_help,
    precision_help,
    stacks_help,
)

if TYPE_CHECKING:
    from rich.console import RenderableType

    from llmscale.report.search_report import PlanReport

# ---- plan ---------------------------------------------------------------------------------


def _add_plan(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "plan",
        help="search parallel layouts: the fastest plans that fit, with memory and step time",
        description=(
            "Enumerate tp x pp x dp (replicated, FSDP-sharded or hybrid) with micro-batch size, "
            "recompute mode, ZeRO stage, pipeline schedule and chunks, sequence parallelism, "
            "optimizer offload and activation offload (the fewest blocks that fit); keep those "
            "whose divisibility holds (tp <= GPUs per node and divides the "
            "heads, kv heads and ffn_dim; pp divides the layers; the global batch divides by "
            "micro-batch x dp) and whose fullest GPU fits (its allocated peak; a plan that fits "
            "only without the caching allocator's share over it is marked ~ and ranked after "
            "the others); rank by predicted step time. Memory "
            "is per GPU (docs/memory-model.md), time from plan/time.py (docs/planner.md). "
            "Each layout flag given (--tp ... --offload) fixes that dimension and the search "
            "runs over the rest; with all fixed it evaluates exactly that plan. When nothing "
            "fits, the closest plans are shown flagged (#!) with why, and the exit code is 1."
        ),
        epilog="Examples: llmscale plan --model llama2-70b --gpu h200 --gpus 64 --seq 4096 "
        "--global-batch 1024 --top 10 --png plans.png; one fixed layout: llmscale plan --gpus 64 "
        "--tp 8 --pp 2 --dp-shard 4 --dp-replicate 1 --mbs 1 --recompute selective "
        "--schedule 1f1b --zero-stage 3 --sp --offload none",
    )
    add_model_arg(p, "llama2-70b")
    p.add_argument("--gpu", default="h200", help="GPU name (llmscale hw; default h200)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument(
        "--seq",
        type=int,
        default=4096,
        help="sequence length (default 4096), at most the model's max_seq_len (a preset's: its "
        "released context; a FILE.toml [model] table may set a longer one)",
    )
    p.add_argument(
        "--global-batch", type=int, default=1024, help="sequences per step (default 1024)"
    )
    p.add_argument("--precision", default="bf16", help=precision_help(PRECISIONS))
    p.add_argument(
        "--float8-recipe",
        default="tensorwise",
        help=float8_recipe_help(),
    )
    p.add_argument("--node", help="node shape (default: the GPU's; llmscale hw)")
    p.add_argument("--nic", help="NIC link (default: the node's; e.g. ib-xdr)")
    p.add_argument("--top", type=int, default=10, help="plans to show (default 10)")
    p.add_argument("--png", help="also draw the top plans' memory as stacked bars to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON on standard output, only")
    p.add_argument("--wide", action="store_true", help="every column (default: 100 columns)")
    p.add_argument(
        "--stack",
        choices=STACK_NAMES,
        default="llmscale",
        metavar="NAME",
        help="the training software whose kernels, gathers, overlaps and overheads are modelled "
        f"(default llmscale). {stacks_help()}",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="the blocks compiled with torch.compile (train.compile): fused element-wise kernels",
    )
    add_stack_option_args(p)
    fix = p.add_argument_group("fix a dimension (default: searched)")
    for flag, name in (
        ("--tp", "tensor-parallel degree"),
        ("--pp", "pipeline-parallel degree"),
        ("--dp-shard", "FSDP shards"),
        ("--dp-replicate", "data-parallel replicas"),
        (
            "--cp",
            "context-parallel degree (ring attention; gpus = pp x dp x cp x tp). Default: "
            "searched over 1 and each power of two keeping >= 4,096 tokens of a sequence per "
            "rank, each cp > 1 at micro-batch size 1 (cp 1 only under --stack megatron-2021)",
        ),
        ("--mbs", "micro-batch size"),
        ("--every-k", "recompute one block in k (implies --recompute every_k)"),
        ("--chunks", "model chunks per pp rank (> 1: interleaved_1f1b, zero_bubble; V: 2)"),
    ):
        fix.add_argument(flag, type=int, help=name)  # fmt: skip
    fix.add_argument("--recompute", help=" | ".join(RECOMPUTE_MODES))
    fix.add_argument("--schedule", help=" | ".join(PP_SCHEDULES) + " (alias: interleaved)")
    fix.add_argument(
        "--pp-layers",
        help="layers per pipeline stage, e.g. 31,32,32,31 (sets --pp; summing to "
        "the model's layers; the first or last may be 0: the embedding or the head alone). "
        "Unset: even, the first and last stages the lighter; over n_layers + 2 stages the "
        "embedding and the head alone at the ends (Megatron's "
        "account_for_embedding/loss_in_pipeline_split)",
    )
    fix.add_argument("--zero-stage", type=int, help=" | ".join(map(str, ZERO_STAGES)))
    fix.add_argument(
        "--sp", action=argparse.BooleanOptionalAction, help="sequence parallelism on or off"
    )
    fix.add_argument("--offload", help=offload_help())
    fix.add_argument(
        "--offload-activations",
        type=int,
        metavar="N",
        help="the first N blocks keep their saved activations in host memory between forward "
        "and backward (train.offload_activations; Megatron-Core's --cpu-offloading-num-layers); "
        "sets --pp 1 and --recompute none; 0: none. Default: searched where the stack offloads "
        "activations (llmscale, megatron-core): a plan without a pipeline or recompute that does "
        "not fit is tried with the fewest blocks offloaded that make it fit",
    )
    p.set_defaults(func=_cmd_plan)


def plan_output(rep: PlanReport, wide: bool = False) -> list[RenderableType]:
    """What `llmscale plan` prints (without --json), in order: the headline, the table, the
    best plan's command, the legend, the unfit plans. `make docs` renders README's example
    with it."""
    from llmscale.report import report
    from llmscale.report.search_report import memory_legend

    out: list[RenderableType] = [rep.headline()]
    if rep.result.shown:
        out.append(report.search_table(rep.result, wide=wide))
    if rep.result.candidates:
        out.append(rep.best_command())
    if rep.result.shown:
        out.append(memory_legend(rep.result, wide))
    out += rep.unfit_lines()
    return out


def _cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from llmscale.report import report
    from llmscale.report.search_report import FIXABLE, fixed_space, plan_report
    from llmscale.ui import console

    if args.precision in FLOAT8_RECIPES and args.precision != "tensorwise":  # mxfp8, rowwise
        raise ConfigError(
            "precision", args.precision, f"{' | '.join(PRECISIONS)} ({args.precision} is a float8 "
            f"recipe: --precision fp8 --float8-recipe {args.precision})",
        )  # fmt: skip
    one_of("precision", args.precision, PRECISIONS)
    one_of("float8_recipe", args.float8_recipe, FLOAT8_RECIPES)
    needs = float8_recipe_needs_fp8(args.precision, args.float8_recipe, "--precision")
    if needs:
        raise ConfigError("float8_recipe", args.float8_recipe, needs)
    png = check_image_file("--png", args.png) if args.png else None
    given = {k: getattr(args, k) for k in FIXABLE}
    if given["schedule"] is not None:
        given["schedule"] = SCHEDULE_ALIASES.get(given["schedule"], given["schedule"])
    space, fixed = fixed_space(args.gpus, given)
    if given["zero_stage"] in (1, 2, 3) and given["dp_shard"] == 1:
        sys.stderr.write(
            f"llmscale plan: note: --zero-stage {given['zero_stage']} shards over the dp_shard "
            "ranks; with --dp-shard 1 nothing is sharded (plain data parallelism)\n"
        )
    rep = plan_report(
        args.model, args.gpus, args.gpu, args.seq, args.global_batch, args.precision, args.top,
        node=args.node, nic=args.nic, space=space, fixed=fixed, stack=args.stack,
        compiled=args.compile, float8_recipe=args.float8_recipe,
        stack_options=stack_options_given(args),
    )  # fmt: skip
    why = rep.result.why_none()
    if png and rep.result.shown:
        report.memory_png(rep.result, png)
    if args.json:
        print(json.dumps(rep.json(), indent=2))
    else:
        out = console()
        for part in plan_output(rep, wide=args.wide):
            out.print(part)
        if png and rep.result.shown:
            out.print(f"wrote {png}")
    if why:
        sys.stderr.write(f"llmscale plan: {why}\n")
        return 1
    return 0


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_plan(sub)
