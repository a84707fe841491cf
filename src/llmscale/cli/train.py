"""The train (one process, or many under torchrun) and plot (a run's curves)."""

from __future__ import annotations

import argparse
from typing import Any

from llmscale.cli._args import (
    EpilogAsWritten,
    Parser,
    add_model_arg,
    add_stack_option_args,
    config_keys_help,
    stack_options_given,
)
from llmscale.errors import ConfigError, UsageError
from llmscale.stack import STACK_NAMES, stacks_help


def _add_train(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (one process, or many under torchrun)",
        description=(
            "Train a decoder LLM from a TOML config. Any config key can be overridden as "
            "--section.key value (e.g. --train.steps 20 --precision.mode bf16). "
            "Run N processes with --nproc-per-node N (or under torchrun)."
        ),
        formatter_class=EpilogAsWritten,
    )
    p.lazy_epilog = config_keys_help
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
    add_model_arg(
        p,
        None,
        dest="model_spec",
    )
    p.add_argument(
        "--stack",
        choices=STACK_NAMES,
        default="llmscale",
        metavar="NAME",
        help="with --dry-run and --gpu: predict the job as another training stack would run it "
        f"(default llmscale, this runtime; train itself runs llmscale). {stacks_help()}",
    )
    add_stack_option_args(p)
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
    if args.stack != "llmscale" and (not args.dry_run or args.gpu is None):
        raise UsageError(
            f"--stack {args.stack} only applies with --dry-run --gpu NAME (train runs llmscale)"
        )
    stack_options = stack_options_given(args)
    if stack_options:
        from llmscale.stack.options import options_text, validate_options

        if not args.dry_run or args.gpu is None:
            raise UsageError(
                f"{options_text(stack_options)} only applies with --dry-run --gpu NAME --stack "
                "NAME (the stack's own settings; train runs llmscale)"
            )
        validate_options(args.stack, stack_options)
    if args.model_spec is not None and not args.dry_run:
        raise UsageError(
            "--model only applies with --dry-run (train takes --model.name or [model])"
        )
    if args.model_spec is not None:  # the dry run of another shape: a TOML file or HF folder
        from llmscale.config import load_model
        from llmscale.model.config import model_overrides

        shape = [w for o in model_overrides(load_model(args.model_spec)) for w in o.split(" ", 1)]
        overrides = [*shape, *overrides]
    cfg = load_config(args.config, overrides)
    from llmscale.config import given_keys
    from llmscale.data.prepared import apply_dataset

    # data.dataset: verified, and the vocabulary follows its tokenizer (dry run too)
    apply_dataset(cfg, given_keys(args.config, overrides))
    from llmscale.hf.check import check_hf_init_from

    # checkpoint.init_from = "hf:DIR": its config and tokenizer against the data, before torch is
    # imported (a bad folder is refused in a fraction of a second, not after ~10 s)
    check_hf_init_from(cfg)
    if args.nproc_per_node is not None and not args.dry_run:
        return _launch_workers(args, cfg)
    from llmscale.train.trainer import resolve_device, run_training

    if args.dry_run:
        from llmscale.train.prediction import dry_run_lines

        if args.nproc_per_node is not None:  # the layout must fill the ranks a launch would start
            if args.nproc_per_node < 1:
                raise ConfigError("--nproc-per-node", args.nproc_per_node, "a positive integer")
            cfg.validate(world_size=args.nproc_per_node)
        from llmscale.train.weights import with_source_model
        from llmscale.ui import console

        cfg = with_source_model(cfg)  # checkpoint.init_from: predict for the source's shape
        out = console()
        device = None if args.gpu else resolve_device(cfg.job.device)
        for line in dry_run_lines(cfg, device, args.gpu, args.stack, stack_options):
            out.print(line, markup=False)
        return 0
    run_training(cfg)
    return 0


# ---- plot ---------------------------------------------------------------------------------


def _add_plot(sub: argparse._SubParsersAction[Parser]) -> None:
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


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_train(sub)
    _add_plot(sub)
