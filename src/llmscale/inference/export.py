"""`llmscale export`: a run's checkpoint as a Hugging Face model folder.

Llama-family models export as `LlamaForCausalLM`, GPT-style ones as `GPT2LMHeadModel` where the
architecture is GPT-2's (tied head, biases, no grouped-query attention); any other mix is
refused with one line (`hf.convert.export_family`).

The folder's vocabulary is the tokenizer's: the rows the run padded its vocabulary with (to a
multiple of 64 x tp, never trained) are dropped, and ids inside it that the tokenizer has no
token for go in generation_config.json `suppress_tokens`. Weights in fp32 or bf16
(`--dtype`), in shards past `--max-shard-size`; a model card README.md says what the run was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from llmscale.config import JobConfig
from llmscale.errors import ConfigError
from llmscale.hf.convert import drop_vocab_padding, export_family, to_hf_state_dict
from llmscale.hf.folder import (
    DEFAULT_MAX_SHARD_SIZE,
    EXPORT_DTYPES,
    parse_shard_size,
    write_folder,
)
from llmscale.inference.tokenizer import RunTokenizer, run_tokenizer
from llmscale.paths import check_output_folder
from llmscale.train.metrics import read_jsonl
from llmscale.train.weights import read_run_config, read_run_weights

Format = Literal["hf"]
FORMATS: tuple[Format, ...] = get_args(Format)


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    architecture: str  # "llama" | "gpt2"
    vocab_size: int  # the folder's: the tokenizer's, padding dropped
    suppressed: int  # ids inside it generation must never produce (no token of the tokenizer)


def export_run(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    fmt: str = "hf",
    dtype: str = "fp32",
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> Exported:
    """Write the folder `out` from the run's newest checkpoint (or that of `step`)."""
    if fmt not in FORMATS:
        raise ConfigError("--format", fmt, " | ".join(FORMATS))
    if dtype not in EXPORT_DTYPES:
        raise ConfigError("--dtype", dtype, " | ".join(EXPORT_DTYPES))
    parse_shard_size(max_shard_size)  # refuse a bad size before reading weights
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError("--out", str(out), "a folder (new, or one to overwrite), not a file")
    check_output_folder("--out", out)  # before the weights are read, not after
    family = export_family(read_run_config(run_dir).model)  # refuse before reading weights
    run = read_run_weights(run_dir, step)
    tokenizer = run_tokenizer(run.cfg, run.path)
    model, sd = drop_vocab_padding(run.cfg.model, run.state_dict, tokenizer.vocab_limit)
    suppress = tokenizer.holes()
    folder = write_folder(
        out,
        model,
        to_hf_state_dict(model, sd),
        tokenizer.files,
        dtype=dtype,
        max_shard_size=max_shard_size,
        suppress_tokens=suppress,
        card=model_card(run_dir, run.cfg, run.step, tokenizer, dtype),
    )
    return Exported(
        out=folder,
        step=run.step,
        architecture=family,
        vocab_size=model.vocab_size,
        suppressed=len(suppress),
    )


def model_card(
    run_dir: str | Path, cfg: JobConfig, step: int, tokenizer: RunTokenizer, dtype: str
) -> str:
    """README.md of the folder: where the weights come from and how far they trained."""
    rows = []
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file():
        rows = [r for r in read_jsonl(metrics) if int(r.get("step", 0)) <= step]
    train = [r["loss"] for r in rows if r.get("kind") == "train" and "loss" in r]
    val = [r["val_loss"] for r in rows if r.get("kind") == "eval" and "val_loss" in r]
    m = cfg.model
    data = cfg.data.dataset or cfg.data.path or "(none recorded)"
    kind = "byte-level" if tokenizer.byte_level else "the prepared dataset's tokenizer.json"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [llmscale]",
        "---",
        "",
        f"# {Path(run_dir).resolve().name}",
        "",
        "Exported by `llmscale export` from a llmscale training run.",
        "",
        f"- source run: `{Path(run_dir).resolve()}`, checkpoint of step {step}"
        f" (of train.steps = {cfg.train.steps})",
        f"- model: {export_family(m)}, {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads"
        f" ({m.n_kv_heads} key/value), ffn {m.ffn_dim}, context {m.max_seq_len},"
        f" {m.num_params():,} parameters as trained; weights {dtype}",
        f"- data: `{data}`, sequences of {cfg.data.seq_len} tokens,"
        f" {cfg.train.global_batch_size} sequences per step",
        f"- tokenizer: {kind}, {tokenizer.vocab_limit} ids (the model's {m.vocab_size} padded"
        " rows dropped past it); no BOS added, special-token text encoded as text, as in"
        " training",
        f"- training loss at step {step}: {train[-1]:.4f}" if train else "- training loss: none",
        f"- validation loss: {val[-1]:.4f}" if val else "- validation loss: not measured",
        "",
    ]
    return "\n".join(lines)
