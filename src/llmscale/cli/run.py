"""The export, generate, eval and ckpt: a trained run's checkpoints."""

from __future__ import annotations

import argparse
import sys

from llmscale.cli._args import (
    Parser,
    one_of,
)
from llmscale.config import (
    DEVICES,
)

# ---- export, generate, eval: a trained run -------------------------------------------------


def _add_export(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model folder",
        description="Write RUN_DIR's newest checkpoint (or --step's), saved under any parallel "
        "layout, as a folder transformers loads (config.json, model.safetensors or its shards, "
        "generation_config.json, tokenizer.json, tokenizer_config.json, README.md). The "
        "vocabulary is the tokenizer's: padding rows are dropped.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step")
    p.add_argument("--format", default="hf", help="hf (Llama, or GPT-2 for GPT-style models)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    p.add_argument(
        "--dtype", default="fp32", help="the weights' dtype: fp32 or bf16 (half the bytes)"
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="weights past this go in shards with model.safetensors.index.json (5GB = 5e9 "
        "bytes, as transformers counts; 2GiB, or a number of bytes)",
    )
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.inference.export import FORMATS, export_run

    one_of("--format", args.format, FORMATS)
    done = export_run(
        args.run_dir, args.out, args.step, args.format, args.dtype, args.max_shard_size
    )
    suppressed = f", {done.suppressed} ids suppressed" if done.suppressed else ""
    sys.stderr.write(
        f"exported step {done.step} of {args.run_dir} as {done.architecture} to {done.out} "
        f"({args.dtype}, vocabulary {done.vocab_size}{suppressed})\n"
    )
    return 0


def _add_generate(sub: argparse._SubParsersAction[Parser]) -> None:
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
    from llmscale.inference.generate import generate_text

    one_of("--device", args.device, DEVICES)
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


def _add_eval(sub: argparse._SubParsersAction[Parser]) -> None:
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


def _add_ckpt(sub: argparse._SubParsersAction[Parser]) -> None:
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


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_export(sub)
    _add_generate(sub)
    _add_eval(sub)
    _add_ckpt(sub)
