"""Command line: parse, validate, call. Bad input exits with code 2 and one line naming the field."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmscale import __version__
from llmscale.config import (
    DEVICES,
    OFFLOAD_MODES,
    PP_SCHEDULES,
    PRECISIONS,
    RECOMPUTE_MODES,
    ZERO_STAGES,
)
from llmscale.errors import ConfigError, ExitCode, JobStopped, UsageError
from llmscale.paths import check_image_file, check_output_file, check_output_folder
from llmscale.plan.profiles import PROFILE_NAMES
from llmscale.plan.schedule import MAX_STAGE_MICROBATCHES

EXIT_USAGE = int(ExitCode.BAD_INPUT)


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line on stderr and exit code 2 (its own default code).

    `lazy_epilog`, when set, builds the epilog only when help is asked for (the train command's
    list of config keys parses the config's source).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: `bench --json` must not silently mean `--json-out`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.lazy_epilog: Callable[[], str] | None = None

    def error(self, message: str) -> None:  # type: ignore[override]
        # prog is "llmscale" or "llmscale <command>": the program name once.
        sys.stderr.write(one_line(f"{self.prog}: error: {message}") + "\n")
        raise SystemExit(EXIT_USAGE)

    def format_help(self) -> str:
        if self.lazy_epilog is not None:
            self.epilog = self.lazy_epilog()
        return super().format_help()


class _EpilogAsWritten(argparse.HelpFormatter):
    """Wraps the description as usual, but keeps a multi-line text (the key list) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


# What str.splitlines() breaks a line at: echoed from an argument, it would split the message.
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(message: str) -> str:
    """An error message as one line: the line breaks a user's argument brought in, escaped."""
    return message.translate(_LINE_BREAKS)


def _one_of(field: str, value: str, allowed: Sequence[str]) -> None:
    """A choice-valued flag: the same one-line error as a config field."""
    if value not in allowed:
        raise ConfigError(field, value, " | ".join(allowed))


# ---- train --------------------------------------------------------------------------------


def _show(*parts: object) -> int:
    """Print a report's parts (title, rich table, the sentences that read it) in order; exit 0."""
    from llmscale.ui import console

    out = console()
    for part in parts:
        out.print(part)
    return 0


def _config_keys_help() -> str:
    from llmscale.config_docs import help_text

    return help_text()


def _add_train(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (one process, or many under torchrun)",
        description=(
            "Train a decoder LLM from a TOML config. Any config key can be overridden as "
            "--section.key value (e.g. --train.steps 20 --precision.mode bf16). "
            "Run N processes with --nproc-per-node N (or under torchrun)."
        ),
        formatter_class=_EpilogAsWritten,
    )
    p.lazy_epilog = _config_keys_help
    p.add_argument("--config", help="TOML config file (default: built-in defaults)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in job.run_dir from its newest intact checkpoint (from step 0 "
        "when it has none)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start fresh in a job.run_dir that holds an earlier run (deletes its metrics and "
        "checkpoints); without --resume or --overwrite such a folder is refused",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and print each rank's predicted memory and the predicted step "
        "time, without training (any world size, no torchrun needed)",
    )
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="with --dry-run: predict for this catalog GPU (llmscale hw) instead of this "
        "machine's device",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start N local worker processes (torchrun's launcher, standalone) after checking "
        "the config once here; exits with the workers' code",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --nproc-per-node: restart the workers up to K times after a failure "
        "(add --resume to continue from the newest checkpoint)",
    )
    p.set_defaults(func=_cmd_train, accepts_overrides=True)


def _launch_workers(args: argparse.Namespace, cfg: Any) -> int:
    """--nproc-per-node N: validate the job for N ranks here (one line, exit 2, before any worker
    starts), then run N workers and return their exit code."""
    n = args.nproc_per_node
    if n < 1:
        raise ConfigError("--nproc-per-node", n, "a positive integer")
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", args.max_restarts, ">= 0")
    cfg.validate(world_size=n)
    from llmscale.parallel.parallelize import check_runtime_support
    from llmscale.train.launch import launch_local, worker_argv
    from llmscale.train.memcheck import check_memory
    from llmscale.train.trainer import resolve_device

    device = resolve_device(cfg.job.device)
    check_runtime_support(cfg, device)
    check_memory(cfg, device)  # raises when it cannot fit; the workers print the warnings
    argv = worker_argv(args.argv, ("--nproc-per-node", "--max-restarts"))
    return launch_local(n, ["train", *argv], args.max_restarts)


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.config import load_config

    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other: choose one")
    if args.resume:
        overrides = [*overrides, "--checkpoint.resume", "true"]
    if args.overwrite:
        overrides = [*overrides, "--job.overwrite", "true"]
    if args.gpu is not None and not args.dry_run:
        raise UsageError("--gpu only applies with --dry-run")
    cfg = load_config(args.config, overrides)
    from llmscale.config import given_keys
    from llmscale.data.prepared import apply_dataset

    # data.dataset: verified, and the vocabulary follows its tokenizer (dry run too)
    apply_dataset(cfg, given_keys(args.config, overrides))
    if args.nproc_per_node is not None and not args.dry_run:
        return _launch_workers(args, cfg)
    from llmscale.train.trainer import resolve_device, run_training

    if args.dry_run:
        from llmscale.train.prediction import dry_run_lines
        from llmscale.train.weights import with_source_model
        from llmscale.ui import console

        cfg = with_source_model(cfg)  # checkpoint.init_from: predict for the source's shape
        out = console()
        device = None if args.gpu else resolve_device(cfg.job.device)
        for line in dry_run_lines(cfg, device, args.gpu):
            out.print(line, markup=False)
        return 0
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
    from llmscale.plan.models_report import models_table

    return _show(models_table())


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
    from llmscale.plan.gantt import draw_gantt_png
    from llmscale.plan.schedule import check_size, simulate
    from llmscale.plan.schedule_report import schedule_report

    t_p2p = _parse_costs("t_p2p", args.t_p2p)
    if isinstance(t_p2p, list):
        raise ConfigError("t_p2p", args.t_p2p, "one number >= 0")
    t_fwd = _parse_costs("t_fwd", args.t_fwd)
    t_bwd = _parse_costs("t_bwd", args.t_bwd)
    t_w = None if args.t_w is None else _parse_costs("t_w", args.t_w)
    schedule = _SCHEDULE_ALIASES.get(args.schedule, args.schedule)
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


# ---- hw -----------------------------------------------------------------------------------


def _add_hw(sub: argparse._SubParsersAction[_Parser]) -> None:
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
    from llmscale.plan import report
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


# ---- plan ---------------------------------------------------------------------------------


def _add_plan(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "plan",
        help="search parallel layouts: the fastest plans that fit, with memory and step time",
        description=(
            "Enumerate tp x pp x dp (replicated, FSDP-sharded or hybrid) with micro-batch size, "
            "recompute mode, ZeRO stage, pipeline schedule and chunks, sequence parallelism and "
            "offload; keep those whose divisibility holds (tp <= GPUs per node and divides the "
            "heads, kv heads and ffn_dim; pp divides the layers; the global batch divides by "
            "micro-batch x dp) and whose fullest GPU fits; rank by predicted step time. Memory "
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
    p.add_argument(
        "--model", default="llama2-70b", help="model preset (llmscale models; default llama2-70b)"
    )
    p.add_argument("--gpu", default="h200", help="GPU name (llmscale hw; default h200)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument(
        "--global-batch", type=int, default=1024, help="sequences per step (default 1024)"
    )
    p.add_argument("--precision", default="bf16", help=" | ".join(PRECISIONS) + " (default bf16)")
    p.add_argument("--node", help="node shape (default: the GPU's; llmscale hw)")
    p.add_argument("--nic", help="NIC link (default: the node's; e.g. ib-xdr)")
    p.add_argument("--top", type=int, default=10, help="plans to show (default 10)")
    p.add_argument("--png", help="also draw the top plans' memory as stacked bars to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON on standard output, only")
    p.add_argument("--wide", action="store_true", help="every column (default: 100 columns)")
    p.add_argument(
        "--profile",
        choices=PROFILE_NAMES,
        default="llmscale",
        help="whose kernels and memory behaviour to model: llmscale (this runtime, the "
        "default), megatron (Megatron-LM as Narayanan 2021 and Korthikanti 2022 ran it: "
        "vocab-parallel loss, selective recompute of the attention core) or torchtitan "
        "(FSDP2, flash SDPA, op-level selective checkpointing)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="the blocks compiled with torch.compile (train.compile): fused element-wise kernels",
    )
    fix = p.add_argument_group("fix a dimension (default: searched)")
    for flag, name in (
        ("--tp", "tensor-parallel degree"),
        ("--pp", "pipeline-parallel degree"),
        ("--dp-shard", "FSDP shards"),
        ("--dp-replicate", "data-parallel replicas"),
        ("--cp", "context-parallel degree (ring attention; gpus = pp x dp x cp x tp)"),
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
        "the model's layers)",
    )
    fix.add_argument("--zero-stage", type=int, help=" | ".join(map(str, ZERO_STAGES)))
    fix.add_argument(
        "--sp", action=argparse.BooleanOptionalAction, help="sequence parallelism on or off"
    )
    fix.add_argument("--offload", help=" | ".join(OFFLOAD_MODES))
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from llmscale.plan import report
    from llmscale.plan.search_report import (
        FIXABLE,
        MEMORY_LEGEND,
        NARROW_LEGEND,
        fixed_space,
        plan_report,
    )
    from llmscale.ui import console

    _one_of("precision", args.precision, PRECISIONS)
    png = check_image_file("--png", args.png) if args.png else None
    given = {k: getattr(args, k) for k in FIXABLE}
    if given["schedule"] is not None:
        given["schedule"] = _SCHEDULE_ALIASES.get(given["schedule"], given["schedule"])
    space, fixed = fixed_space(args.gpus, given)
    rep = plan_report(
        args.model, args.gpus, args.gpu, args.seq, args.global_batch, args.precision, args.top,
        node=args.node, nic=args.nic, space=space, fixed=fixed, profile=args.profile,
        compiled=args.compile,
    )  # fmt: skip
    why = rep.result.why_none()
    if png and rep.result.shown:
        report.memory_png(rep.result, png)
    if args.json:
        print(json.dumps(rep.json(), indent=2))
    else:
        out = console()
        out.print(rep.headline())
        if rep.result.shown:
            out.print(report.search_table(rep.result, wide=args.wide))
        if rep.result.candidates:
            out.print(rep.best_command())
        if rep.result.shown:
            out.print(MEMORY_LEGEND if args.wide else NARROW_LEGEND)
        for line in rep.unfit_lines():
            out.print(line)
        if png and rep.result.shown:
            out.print(f"wrote {png}")
    if why:
        sys.stderr.write(f"llmscale plan: {why}\n")
        return 1
    return 0


# ---- roofline -----------------------------------------------------------------------------


def _add_roofline(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "roofline",
        help="arithmetic intensity of training and decoding vs the GPU's ridge point",
        description=(
            "FLOPs per byte of HBM traffic for a training step (batch x seq tokens) and for "
            "decoding one token for each of `batch` sequences with `seq` tokens of KV cache, "
            "compared with the GPU's ridge point (dense peak / HBM bandwidth): above it the "
            "work is compute-bound, below it memory-bound."
        ),
        epilog="Example: llmscale roofline --gpu h200 --model llama2-70b --batch 1 --seq 4096",
    )
    p.add_argument("--gpu", default="h200", help="GPU name (llmscale hw; default h200)")
    p.add_argument(
        "--model", default="llama2-70b", help="model preset (llmscale models; default llama2-70b)"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's maximum)")
    p.add_argument("--precision", default="bf16", help=" | ".join(PRECISIONS) + " (default bf16)")
    p.set_defaults(func=_cmd_roofline)


def _cmd_roofline(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.hardware.catalog import get_gpu
    from llmscale.model.config import get_preset
    from llmscale.plan.roofline_report import roofline_report

    model, gpu = get_preset(args.model), get_gpu(args.gpu)
    _one_of("precision", args.precision, PRECISIONS)
    rep = roofline_report(
        model, gpu, args.batch, model.max_seq_len if args.seq is None else args.seq, args.precision
    )
    return _show(rep.title, rep.table, rep.conclusion)


# ---- network ------------------------------------------------------------------------------


def _add_network(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "network",
        help="rail-optimized fat-tree vs rail-only (and optics): switches, cost, step time",
        description=(
            "Size a non-blocking rail-optimized fat-tree and a rail-only network (Wang et al. "
            "2023) for the GPUs: tiers, switches, links, transceivers and cost (assumed prices "
            "in hardware/data/network.toml), plus a co-packaged-optics fat-tree; then the step "
            "time of the best plan for --model on each, and an all-to-all (MoE-style) time, "
            "where rail-only forwards cross-rail bytes over NVLink. --gpus is capped at what a "
            "3-tier non-blocking Clos of the NIC's switches connects (65,536 for h100 and h200: "
            "radix 64, 8 NICs per node, answered in about 2 s; 16,000 for the a100s: radix 40)."
        ),
        epilog="Example: llmscale network --gpus 1024 --gpu h100",
    )
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (whole nodes)")
    p.add_argument("--gpu", default="h100", help="GPU name (default h100)")
    p.add_argument(
        "--model", default="llama2-70b", help="model preset for the plan (default llama2-70b)"
    )
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: GPUs)")
    p.add_argument(
        "--a2a-mb", type=float, default=256.0, help="all-to-all MB per GPU (default 256)"
    )
    p.set_defaults(func=_cmd_network)


def _cmd_network(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.model.config import get_preset
    from llmscale.plan.network_report import network_report

    rep = network_report(
        get_preset(args.model), args.gpus, args.gpu, args.seq, args.global_batch, args.a2a_mb
    )
    return _show(rep.table, *rep.lines)


# ---- infer --------------------------------------------------------------------------------


def _add_infer(sub: argparse._SubParsersAction[_Parser]) -> None:
    from llmscale.plan.inference import ASSUMPTIONS, DEFAULT_RESERVE, INFER_PRECISIONS

    p = sub.add_parser(
        "infer",
        help="serving throughput: prefill, decode, KV-cache batch bound, tensor parallelism",
        description=(
            "Predict offline serving throughput of a model on catalog GPUs (torch-free, "
            "plan/inference.py): prefill of the prompt tokens (compute: FLOPs at the GPU's "
            "calibrated GEMM efficiency), decode of one token per step (memory: the weight "
            "shard and the KV caches read at the calibrated HBM bandwidth), the batch bounded "
            "by the HBM left for KV caches after the weights and a reserve (grouped-query "
            "attention counted through n_kv_heads), tensor parallelism inside one node with "
            "two all-reduces per block over its scale-up link, and each phase's roofline "
            "regime against the GPU's ridge point. Assumptions: " + "; ".join(ASSUMPTIONS) + "."
        ),
        epilog=(
            "Example: llmscale infer --model llama2-70b --gpu h200 --gpus 1 --input-len 2048 "
            "--output-len 128 --precision fp8   (NVIDIA's 1.9x H200/H100 case; docs/inference.md)"
        ),
    )
    p.add_argument("--model", required=True, help="model preset (llmscale models)")
    p.add_argument("--gpu", required=True, help="GPU name (llmscale hw)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs serving (replicas x tp)")
    p.add_argument("--input-len", type=int, required=True, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, required=True, help="generated tokens per sequence")
    p.add_argument(
        "--precision",
        default="bf16",
        help=" | ".join(INFER_PRECISIONS) + " (weights and KV cache; default bf16)",
    )
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default: the fastest)")
    p.add_argument("--batch", type=int, help="sequences per batch (default: the most that fit)")
    p.add_argument(
        "--reserve",
        type=float,
        default=DEFAULT_RESERVE,
        help=f"fraction of HBM held back (default {DEFAULT_RESERVE}: vLLM's 0.9 utilisation)",
    )
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=_cmd_infer)


def _cmd_infer(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from llmscale.model.config import get_preset
    from llmscale.plan.inference import INFER_PRECISIONS, predict
    from llmscale.plan.inference_report import inference_report

    _one_of("precision", args.precision, INFER_PRECISIONS)
    pred = predict(
        get_preset(args.model), args.gpu, args.gpus, args.input_len, args.output_len,
        args.precision, tp=args.tp, batch=args.batch, reserve=args.reserve, model_name=args.model,
    )  # fmt: skip
    if args.json:
        print(json.dumps(pred.to_dict(), indent=2))
        return 0
    rep = inference_report(pred)
    return _show(rep.title, rep.table, *rep.lines)


# ---- claims -------------------------------------------------------------------------------


def _add_claims(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "claims",
        help="the article's claims, each with llmscale's figure and a verdict",
        description=(
            "Check every claim of the article 'Distributed Solutions: Practical Approaches to "
            "Scale LLM Compute, Part 2' against llmscale (plan/claims.py): catalog, planner, "
            "schedule simulator and serving model figures computed on the spot, measured ones "
            "read from --results (written by make results, with when). Verdicts: holds | holds "
            "with a caveat | does not hold here. Trains nothing; about a second."
        ),
        epilog="Example: llmscale claims --markdown docs/claims.md   (make claims)",
    )
    p.add_argument("--json", action="store_true", help='print {"claims": [...]} as JSON')
    p.add_argument("--markdown", metavar="FILE", help="write the table as Markdown to FILE")
    p.add_argument(
        "--results",
        default="docs/results/results.json",
        help="measured results (default docs/results/results.json; missing: not measured yet)",
    )
    p.set_defaults(func=_cmd_claims)


def _cmd_claims(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from rich.table import Table

    from llmscale.plan.claims import check_claims, to_json, to_markdown
    from llmscale.ui import console

    results = Path(args.results)
    if args.markdown:
        check_output_file("markdown", args.markdown)
    rows = check_claims(results)
    if args.markdown:
        Path(args.markdown).write_text(to_markdown(rows, results))
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


# ---- bench --------------------------------------------------------------------------------


def _add_bench(sub: argparse._SubParsersAction[_Parser]) -> None:
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
    _one_of("--device", args.device, DEVICES)
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


# ---- export, generate, eval: a trained run -------------------------------------------------


def _add_export(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model folder",
        description="Write RUN_DIR's newest checkpoint (or --step's), saved under any parallel "
        "layout, as a folder transformers loads (config.json, model.safetensors, "
        "generation_config.json, tokenizer.json, tokenizer_config.json).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step")
    p.add_argument("--format", default="hf", help="hf (Llama, or GPT-2 for GPT-style models)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.inference.export import FORMATS, export_run

    _one_of("--format", args.format, FORMATS)
    done = export_run(args.run_dir, args.out, args.step, args.format)
    sys.stderr.write(
        f"exported step {done.step} of {args.run_dir} as {done.architecture} to {done.out}\n"
    )
    return 0


def _add_generate(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a prompt with a run's newest checkpoint",
        description="Print the prompt followed by its continuation on stdout (nothing else "
        "there; notices go to stderr). Decoding keeps a key/value cache.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to add at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.config import DEVICES
    from llmscale.inference.generate import generate_text

    _one_of("--device", args.device, DEVICES)
    out = generate_text(
        args.run_dir,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        step=args.step,
        device=args.device,
    )
    sys.stderr.write(f"step {out.step}: {len(out.new_ids)} new tokens\n")
    sys.stdout.write(out.text + "\n")
    return 0


def _add_eval(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "eval",
        help="validation loss and perplexity of a run's newest checkpoint",
        description="Evaluate RUN_DIR's newest checkpoint on its validation data (as the "
        "trainer does), in one process. Config keys can be overridden, e.g. --data.dataset DIR.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_eval, accepts_overrides=True)


def _cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from llmscale.inference.evaluate import evaluate_run

    res = evaluate_run(args.run_dir, overrides)
    if args.json:
        sys.stdout.write(json.dumps({"run_dir": args.run_dir, **res.to_dict()}) + "\n")
    else:
        sys.stdout.write(
            f"step {res.step}: val_loss {res.val_loss:.4f}  perplexity {res.perplexity:.3f}\n"
        )
    return 0


# ---- ckpt ---------------------------------------------------------------------------------


def _add_ckpt(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "ckpt",
        help="list or verify a run's checkpoints",
        description="`list`: each checkpoint under RUN_DIR/checkpoints with its step, the "
        "parallel layout it was saved under, its size and whether its files match its "
        "manifest. `verify`: the same, exit 1 if any is damaged.",
    )
    p.add_argument("action", choices=("list", "verify"), help="list | verify")
    p.add_argument("run_dir", help="folder a `llmscale train` run wrote")
    p.add_argument("--folder", default="checkpoints", help="checkpoint folder under RUN_DIR")
    p.set_defaults(func=_cmd_ckpt)


def _cmd_ckpt(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.train.ckpt_report import checkpoint_rows, print_rows

    rows = checkpoint_rows(args.run_dir, args.folder)
    print_rows(rows, f"checkpoints in {args.run_dir}")
    if args.action == "verify":
        damaged = [r for r in rows if r.damaged]
        intact = sum(r.ok for r in rows)
        print(f"{intact} intact, {len(damaged)} damaged")
        return 1 if damaged else 0
    return 0


# ---- data ---------------------------------------------------------------------------------


def _add_data(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "data",
        help="prepare a corpus: tokenizer and token shards (llmscale data prepare --help)",
        description="Tokenize your own text into a folder that `llmscale train --data.dataset "
        "DIR` trains on.",
    )
    what = p.add_subparsers(
        dest="data_command", metavar="prepare", required=True, parser_class=_Parser
    )
    prep = what.add_parser(
        "prepare",
        help="text files, folders and JSONL in; DIR/tokenizer.json, token shards, meta.json out",
        description=(
            "Read text files, folders (recursively) and .jsonl files (one JSON object per line), "
            "tokenize them on every core and write DIR/tokenizer.json, DIR/train-00000.bin, "
            "DIR/val-00000.bin, ... (raw little-endian token ids, uint16 or uint32, documents "
            "separated by the end-of-document token, split by document) and DIR/meta.json. "
            "--tokenizer bytes: byte-level (ids 0-255 are the bytes, as the default data); bpe: "
            "trains a byte-level BPE tokenizer on the corpus; FILE.json: a tokenizers file used "
            "as is (e.g. a Hugging Face model's tokenizer.json)."
        ),
        epilog="Example: llmscale data prepare --input docs/ --glob '**/*.md' --tokenizer bpe "
        "--vocab-size 4096 --out data/docs",
    )
    prep.add_argument(
        "--input", nargs="+", required=True, metavar="PATH", help="text and .jsonl files, folders"
    )
    prep.add_argument(
        "--glob",
        default="",
        help="in folders, only files matching this (e.g. '**/*.txt'); "
        "default every file, binary ones skipped",
    )
    prep.add_argument(
        "--jsonl-field", default="text", help="the text field of .jsonl objects (default text)"
    )
    prep.add_argument(
        "--tokenizer", default="bytes", metavar="bytes|bpe|FILE.json", help="default bytes"
    )
    prep.add_argument(
        "--vocab-size", type=int, help="bpe: ids to train (default 8192); bytes: default 264"
    )
    prep.add_argument(
        "--val-fraction", type=float, default=0.05, help="share of documents held out (0.05)"
    )
    prep.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.set_defaults(func=_cmd_data)


def _cmd_data(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.data.prepare import prepare

    res = prepare(
        args.input,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        glob=args.glob,
        jsonl_field=args.jsonl_field,
        val_fraction=args.val_fraction,
    )
    m = res.meta
    tr, va = m["splits"]["train"], m["splits"]["val"]
    print(
        f"wrote {res.out}: {tr['tokens']:,} train tokens ({tr['documents']:,} documents, "
        f"{len(tr['shards'])} shards), {va['tokens']:,} val tokens ({va['documents']:,} "
        f"documents); vocabulary {m['vocab_size']:,} ({m['dtype']}); {len(m['sources']):,} "
        f"files"
        + (f", {res.skipped_binary} binary skipped" if res.skipped_binary else "")
        + f"; {res.tokens_per_s:,.0f} tokens/s"
    )
    return 0


# ---- entry point --------------------------------------------------------------------------

_COMMANDS: list[Callable[[argparse._SubParsersAction[_Parser]], None]] = [
    _add_train,
    _add_plot,
    _add_models,
    _add_schedule,
    _add_hw,
    _add_plan,
    _add_roofline,
    _add_network,
    _add_infer,
    _add_claims,
    _add_bench,
    _add_export,
    _add_generate,
    _add_eval,
    _add_ckpt,
    _add_data,
]


def build_parser() -> _Parser:
    parser = _Parser(
        prog="llmscale",
        description="Train GPT-style decoder LLMs past the memory wall, and plan how to scale them.",
    )
    parser.add_argument("--version", action="version", version=f"llmscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in _COMMANDS:
        add(sub)
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
        return int(e.code)
    except KeyboardInterrupt:
        sys.stderr.write(f"llmscale {args.command}: interrupted\n")
        return 130
