"""Hugging Face model folders: write one from llmscale weights, read a Llama one back.

A folder is config.json, model.safetensors, generation_config.json, tokenizer.json and
tokenizer_config.json: what `transformers.AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` read. Weights are written in fp32 as the checkpoint holds them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from llmscale.data.prepared import byte_tokenizer
from llmscale.data.tokenizer import ByteTokenizer
from llmscale.errors import ConfigError
from llmscale.hf.convert import from_hf_llama, hf_config
from llmscale.model.config import ModelConfig, from_hf_config
from llmscale.model.transformer import build_model

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer a folder gets: its tokenizer.json text and its special ids."""

    json_text: str
    bos_id: int | None
    eos_id: int
    pad_id: int


def byte_tokenizer_files(vocab_size: int) -> TokenizerFiles:
    """The byte-level tokenizer's files, for runs trained on raw bytes (data.path)."""
    t = ByteTokenizer()
    return TokenizerFiles(
        byte_tokenizer(vocab_size).to_str(), bos_id=t.bos_id, eos_id=t.eos_id, pad_id=t.pad_id
    )


def write_folder(
    out: str | Path,
    cfg: ModelConfig,
    hf_state_dict: dict[str, torch.Tensor],
    tokenizer: TokenizerFiles,
) -> Path:
    """Write the folder (created if needed); `hf_state_dict` from `convert.to_hf_state_dict`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    config = hf_config(cfg, bos, tokenizer.eos_id, tokenizer.pad_id)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {
        k: v.detach().to("cpu", torch.float32).contiguous() for k, v in hf_state_dict.items()
    }
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    generation = {
        "bos_token_id": bos,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / TOKENIZER).write_text(tokenizer.json_text)
    tok = Tokenizer.from_str(tokenizer.json_text)

    def name(i: int | None) -> str | None:
        return None if i is None else tok.id_to_token(i)

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tokenizer.bos_id),
        "eos_token": name(tokenizer.eos_id),
        "pad_token": name(tokenizer.pad_id),
        "model_max_length": cfg.max_seq_len,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,  # special-token text in the input is encoded as text
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def read_llama_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model shape and llmscale state dict of a Hugging Face Llama folder.

    Refused with one line (ConfigError on checkpoint.init_from): a missing folder, no config.json,
    a config that is not Llama, missing or unreadable weights, a tensor of the wrong shape.
    """
    field = "checkpoint.init_from"
    src = f"hf:{folder}"
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(field, src, "hf:DIR with DIR an existing Hugging Face model folder")
    try:
        raw = json.loads((root / CONFIG).read_text())
    except FileNotFoundError:
        raise ConfigError(field, src, f"a folder with {CONFIG}") from None
    except json.JSONDecodeError:
        raise ConfigError(field, src, f"a folder whose {CONFIG} is JSON") from None
    if not isinstance(raw, dict):
        raise ConfigError(field, src, f"a folder whose {CONFIG} is a JSON object")
    if raw.get("model_type") != "llama":
        raise ConfigError(field, src, "a Llama folder (config.json model_type 'llama')")
    cfg = from_hf_config(raw, field, src)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(field, src, "a folder with model.safetensors (or its shards)")
    hf_sd: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            hf_sd.update(load_file(str(f)))
    except (SafetensorError, OSError) as e:
        raise ConfigError(field, src, f"readable safetensors files ({e})") from None
    sd = from_hf_llama(cfg, hf_sd)
    for name, p in build_model(cfg, "meta").named_parameters():
        if tuple(sd[name].shape) != tuple(p.shape):
            raise ConfigError(
                field, src, f"{name} of shape {tuple(p.shape)} (found {tuple(sd[name].shape)})"
            )
    return cfg, sd
