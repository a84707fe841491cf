"""Hugging Face model folders: write one from llmscale weights, read a Llama one back.

A folder is config.json, model.safetensors (or shards of it with model.safetensors.index.json,
as transformers' `save_pretrained(max_shard_size=...)` writes them), generation_config.json,
tokenizer.json, tokenizer_config.json and a model card README.md: what
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` read.
Weights are written in fp32 as the checkpoint holds them, or in bf16.

The tokenizer encodes as `llmscale data prepare` encoded the training data: no BOS or other
template around a text (tokenizer.json's post-processor is dropped, add_bos_token false) and
special-token text as the dataset's meta.json records (split_special_tokens: tokenizer.json
cannot hold that setting, see data/prepared.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from llmscale.data.prepared import byte_tokenizer, tokenizer_config
from llmscale.data.tokenizer import ByteTokenizer
from llmscale.errors import ConfigError
from llmscale.hf.check import CONFIG, FIELD, TOKENIZER, read_llama_config
from llmscale.hf.convert import from_hf_llama, hf_config
from llmscale.model.config import ModelConfig
from llmscale.model.transformer import build_model

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

ExportDtype = Literal["fp32", "bf16"]
EXPORT_DTYPES: tuple[ExportDtype, ...] = get_args(ExportDtype)
_TORCH_DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(text: str | int, field: str = "--max-shard-size") -> int:
    """Bytes of "5GB" (10^9, as transformers counts), "500MiB" (2^20) or a plain integer."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(field, text, "a size such as 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer a folder gets: its tokenizer.json text, its special ids and whether
    special-token text is encoded as text (meta.json's record; the file cannot hold it)."""

    json_text: str
    bos_id: int | None
    eos_id: int
    pad_id: int
    encode_special_tokens: bool = True

    def tokenizer(self) -> Tokenizer:
        """The tokenizer, set to encode as the data was."""
        tok = Tokenizer.from_str(self.json_text)
        tok.encode_special_tokens = self.encode_special_tokens
        return tok


def byte_tokenizer_files(vocab_size: int) -> TokenizerFiles:
    """The byte-level tokenizer's files, for runs trained on raw bytes (data.path)."""
    t = ByteTokenizer()
    return TokenizerFiles(
        byte_tokenizer(vocab_size).to_str(), bos_id=t.bos_id, eos_id=t.eos_id, pad_id=t.pad_id
    )


def write_weights(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[Path]:
    """model.safetensors, or, when the weights pass `max_shard_bytes`, shards of at most that
    size (a tensor larger than it alone in its shard) named and indexed as transformers does."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    for old in [*out.glob("model*.safetensors"), out / WEIGHTS_INDEX]:
        old.unlink(missing_ok=True)  # an earlier export into the same folder
    if len(shards) == 1:
        save_file(shards[0], str(out / WEIGHTS), metadata={"format": "pt"})
        return [out / WEIGHTS]
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(out / name)
        weight_map |= dict.fromkeys(shard, name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


def write_folder(
    out: str | Path,
    cfg: ModelConfig,
    hf_state_dict: dict[str, torch.Tensor],
    tokenizer: TokenizerFiles,
    dtype: str = "fp32",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    suppress_tokens: list[int] | None = None,
    card: str = "",
) -> Path:
    """Write the folder (created if needed); `hf_state_dict` from `convert.to_hf_state_dict`.

    `suppress_tokens`: ids generation must never produce (padding inside the vocabulary);
    `card`: the model card, README.md.
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError("--dtype", dtype, " | ".join(EXPORT_DTYPES))
    max_shard_bytes = parse_shard_size(max_shard_size)
    torch_dtype, dtype_name = _TORCH_DTYPES[dtype]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    config = hf_config(cfg, bos, tokenizer.eos_id, tokenizer.pad_id, dtype_name)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to("cpu", torch_dtype).contiguous() for k, v in hf_state_dict.items()}
    write_weights(out, tensors, max_shard_bytes)
    generation: dict[str, object] = {
        "bos_token_id": bos,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "do_sample": False,
    }
    if suppress_tokens:
        generation["suppress_tokens"] = sorted(suppress_tokens)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / TOKENIZER).write_text(training_tokenizer_json(tokenizer.json_text))
    if card:
        (out / "README.md").write_text(card)
    tok_config = tokenizer_config(
        tokenizer.tokenizer(),
        tokenizer.eos_id,
        tokenizer.pad_id,
        tokenizer.bos_id,
        encode_special_tokens=tokenizer.encode_special_tokens,
    )
    tok_config |= {
        "model_max_length": cfg.max_seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def training_tokenizer_json(json_text: str) -> str:
    """tokenizer.json as training encoded: its post-processor (a template adding BOS, as
    Llama's files have) dropped, since `data prepare` encodes without special tokens."""
    raw = json.loads(json_text)
    if raw.get("post_processor") is None:
        return json_text
    raw["post_processor"] = None
    return json.dumps(raw, ensure_ascii=False)


def read_llama_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model shape and llmscale state dict of a Hugging Face Llama folder.

    Refused with one line (ConfigError on checkpoint.init_from): what `hf.check.read_llama_config`
    refuses (no folder, no config.json, not Llama, no weights), unreadable weights, a tensor of
    the wrong shape.
    """
    field = FIELD
    src = f"hf:{folder}"
    cfg, files = read_llama_config(folder, field)
    hf_sd: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            hf_sd.update(load_file(str(f)))
    except (SafetensorError, OSError) as e:
        raise ConfigError(field, src, f"readable safetensors files ({e})") from None
    sd = from_hf_llama(cfg, hf_sd, field, src)
    for name, p in build_model(cfg, "meta").named_parameters():
        if tuple(sd[name].shape) != tuple(p.shape):
            raise ConfigError(
                field, src, f"{name} of shape {tuple(p.shape)} (found {tuple(sd[name].shape)})"
            )
    return cfg, sd
