"""A Hugging Face folder checked as a run's `checkpoint.init_from`, without torch.

Everything that can refuse a folder from its config.json and tokenizer.json alone lives here, so
`llmscale train --checkpoint.init_from hf:DIR` refuses a bad folder in well under a second, before
torch is imported (about 7-11 s on a loaded 2-core machine): no folder, no config.json, not Llama,
no safetensors files, a vocabulary or tokenizer other than the data's. What needs the tensors
(unreadable safetensors, a tensor of the wrong shape) is `hf.folder.read_llama_folder`'s, which
starts from `read_llama_config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from llmscale.errors import ConfigError
from llmscale.model.config import BYTE_VOCAB_SIZE, ModelConfig, from_hf_config

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from llmscale.config import JobConfig

HF_PREFIX = "hf:"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
FIELD = "checkpoint.init_from"

# Encoded by the folder's tokenizer and the data's when both have a tokenizer.json: equal
# vocabularies with other merges or normalisation would still encode differently.
_PROBE = "The quick brown fox <s> </s> <|endoftext|> 12345 def f(x):\n\treturn x  # ünïcode 日本語"


def read_llama_config(folder: str | Path, field: str = FIELD) -> tuple[ModelConfig, list[Path]]:
    """The model shape of a Hugging Face Llama folder and its safetensors files, unread.

    Refused with one line (ConfigError on `field`): a missing folder, no config.json, a config
    that is not JSON or not Llama, no safetensors file.
    """
    src = f"{HF_PREFIX}{folder}"
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(field, src, "hf:DIR with DIR an existing Hugging Face model folder")
    try:
        raw = json.loads((root / CONFIG).read_text())
    except FileNotFoundError:
        raise ConfigError(field, src, f"a folder with {CONFIG}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(field, src, f"a folder whose {CONFIG} is JSON") from None
    if not isinstance(raw, dict):
        raise ConfigError(field, src, f"a folder whose {CONFIG} is a JSON object")
    if raw.get("model_type") != "llama":
        raise ConfigError(field, src, "a Llama folder (config.json model_type 'llama')")
    cfg = from_hf_config(raw, field, src)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(field, src, "a folder with model.safetensors (or its shards)")
    return cfg, files


def check_folder_data(
    folder: str | Path, vocab_size: int, data_tokenizer: Tokenizer, data_name: str
) -> None:
    """That a Hugging Face folder can start a run on data of `data_tokenizer` (`data_name`).

    Its vocabulary must hold every id of the data. With a tokenizer.json, that tokenizer must
    be the data's (same tokens, same ids, same encoding); without one, its vocab_size must equal
    the data tokenizer's size, the one thing to go by. ConfigError on checkpoint.init_from
    otherwise, one line.
    """
    from tokenizers import Tokenizer

    from llmscale.data.prepared import document_ids

    field, src = FIELD, f"{HF_PREFIX}{folder}"
    data_vocab = max(data_tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    if vocab_size < data_vocab:
        raise ConfigError(
            field,
            src,
            f"a folder whose vocab_size holds the {data_vocab} ids of the data's tokenizer "
            f"({data_name}); its config.json says {vocab_size}",
        )
    path = Path(folder) / TOKENIZER
    if not path.is_file():
        if vocab_size != data_vocab:
            raise ConfigError(
                field,
                src,
                f"a folder with {TOKENIZER}, or whose vocab_size equals the data tokenizer's "
                f"{data_vocab} ids ({data_name}); its config.json says {vocab_size}",
            )
        return
    try:
        theirs = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own Exception subclasses for bad files
        raise ConfigError(field, src, f"a readable {TOKENIZER} ({type(e).__name__})") from None
    theirs.encode_special_tokens = data_tokenizer.encode_special_tokens  # compared as the data
    a, b = theirs.get_vocab(with_added_tokens=True), data_tokenizer.get_vocab(True)
    differ = sum(a.get(token) != i for token, i in b.items()) + len(a.keys() - b.keys())
    if differ or document_ids(theirs, [_PROBE]) != document_ids(data_tokenizer, [_PROBE]):
        raise ConfigError(
            field,
            src,
            f"a folder whose {TOKENIZER} is the data's tokenizer ({data_name}): "
            + (f"{differ} tokens differ" if differ else "it encodes text differently"),
        )


def check_hf_init_from(cfg: JobConfig) -> ModelConfig | None:
    """The model shape of `checkpoint.init_from = "hf:DIR"`, its folder checked against the
    run's data (`check_folder_data`); None when init_from is not a Hugging Face folder.
    `cfg.data.dataset`, when set, has been verified (`data.prepared.apply_dataset`)."""
    from llmscale.data.prepared import byte_tokenizer, dataset_tokenizer, load_meta

    init_from = cfg.checkpoint.init_from
    if not init_from or not init_from.startswith(HF_PREFIX):
        return None
    folder = init_from[len(HF_PREFIX) :]
    model, _ = read_llama_config(folder)
    if cfg.data.dataset:
        data_tok = dataset_tokenizer(load_meta(cfg.data.dataset))
        name = f"data.dataset {cfg.data.dataset}"
    else:
        data_tok, name = byte_tokenizer(BYTE_VOCAB_SIZE), "byte-level, data.path"
    check_folder_data(folder, model.vocab_size, data_tok, name)
    return model
