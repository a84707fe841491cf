"""The data: prepare and inspect a tokenized dataset."""

from __future__ import annotations

import argparse
import sys

from llmscale.cli._args import (
    Parser,
)

# ---- data ---------------------------------------------------------------------------------


def _add_data(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "data",
        help="prepare a corpus: tokenizer and token shards (llmscale data prepare --help)",
        description="Tokenize your own text into a folder that `llmscale train --data.dataset "
        "DIR` trains on.",
    )
    what = p.add_subparsers(
        dest="data_command", metavar="prepare", required=True, parser_class=Parser
    )
    prep = what.add_parser(
        "prepare",
        help="text files, folders and JSONL in; DIR/tokenizer.json, token shards, meta.json out",
        description=(
            "Read text files, folders (recursively) and .jsonl files (one JSON object per line), "
            "tokenize them on every core and write DIR/tokenizer.json, DIR/train-00000.bin, "
            "DIR/val-00000.bin, ... (raw little-endian token ids, uint16 or uint32, documents "
            "separated by the end-of-document token, split by document), DIR/meta.json and "
            "DIR/tokenizer_config.json (for transformers' AutoTokenizer). A special token's name "
            "inside a document is encoded as text: tokenizer.json cannot hold that setting, "
            "meta.json (encode_special_tokens) and tokenizer_config.json (split_special_tokens) "
            "record it. "
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
    for notice in res.notices:
        print(f"llmscale data: note: {notice}", file=sys.stderr)
    return 0


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_data(sub)
