"""A prepared dataset: the folder `llmscale data prepare` writes, and the facts read from it.

    DIR/meta.json        vocab_size, dtype, eos_id, pad_id, tokenizer_sha256, splits, sources
    DIR/tokenizer.json   the tokenizer (a `tokenizers` Tokenizer file)
    DIR/train-00000.bin  raw little-endian token ids, no header (uint16 or uint32), documents
    DIR/val-00000.bin    separated by eos_id

Torch-free: the CLI, the trainer and the Hugging Face export read the same meta. The model's
vocabulary is the tokenizer's, padded (`padded_vocab_size`) so that it splits evenly over tensor
parallel ranks in GEMM-friendly blocks; the padded ids never occur in the data and are masked
out of the loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmscale.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from llmscale.config import JobConfig

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
DTYPES = ("uint16", "uint32")
VOCAB_MULTIPLE = 64  # padded vocabulary: a multiple of this times tp

# The byte-level tokenizer's special tokens, at ids 256.. (data/tokenizer.py: BOS, EOS, PAD, then
# reserved ones up to the byte vocabulary's 264).
BYTE_SPECIALS = ("<|bos|>", "<|endoftext|>", "<|pad|>")
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


@dataclass(frozen=True)
class SplitMeta:
    """One split's shards (file names in the folder, in order) and its token count."""

    tokens: int
    shards: list[str] = field(default_factory=list)
    documents: int = 0


@dataclass(frozen=True)
class PreparedMeta:
    """DIR/meta.json, and the folder it was read from."""

    root: Path
    vocab_size: int  # the tokenizer's real vocabulary (ids >= this never occur)
    dtype: str  # "uint16" | "uint32"
    eos_id: int
    pad_id: int
    tokenizer_sha256: str
    splits: dict[str, SplitMeta]
    sources: list[dict[str, Any]] = field(default_factory=list)

    def shard_paths(self, split: str) -> list[Path]:
        s = self.splits.get(split)
        return [self.root / name for name in s.shards] if s else []

    @property
    def tokenizer_path(self) -> Path:
        return self.root / TOKENIZER_FILE

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["root"]
        return d


def padded_vocab_size(real_vocab: int, tp: int = 1) -> int:
    """The model's vocabulary for a tokenizer of `real_vocab` ids: the next multiple of 64 x tp."""
    m = VOCAB_MULTIPLE * max(1, tp)
    return -(-real_vocab // m) * m


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def load_meta(path: str | Path, field_name: str = "data.dataset") -> PreparedMeta:
    """Read DIR/meta.json; a folder that is not a prepared dataset is a one-line ConfigError."""
    root = Path(path)
    allowed = "a folder written by `llmscale data prepare` (with meta.json)"
    if not is_prepared(root):
        raise ConfigError(field_name, str(path), allowed)
    try:
        raw = json.loads((root / META_FILE).read_text())
        splits = {
            name: SplitMeta(
                tokens=int(s["tokens"]),
                shards=[str(x) for x in s["shards"]],
                documents=int(s.get("documents", 0)),
            )
            for name, s in raw["splits"].items()
        }
        meta = PreparedMeta(
            root=root,
            vocab_size=int(raw["vocab_size"]),
            dtype=str(raw["dtype"]),
            eos_id=int(raw["eos_id"]),
            pad_id=int(raw["pad_id"]),
            tokenizer_sha256=str(raw["tokenizer_sha256"]),
            splits=splits,
            sources=list(raw.get("sources", [])),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            field_name, str(path), f"{allowed}; its meta.json is unreadable: {e}"
        ) from None
    if meta.dtype not in DTYPES:
        raise ConfigError(f"{field_name} meta.json dtype", meta.dtype, " | ".join(DTYPES))
    return meta


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> str:
    """uint16 while every id fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def apply_dataset(cfg: JobConfig) -> PreparedMeta | None:
    """With data.dataset set: read its meta and make the model's vocabulary follow the tokenizer
    (padded for cfg.parallel.tp). The trainer and `train --dry-run` call this before validating,
    so the memory check, the prediction and config.toml see the model that will be built. None
    (and cfg untouched) for the raw byte-level data of data.path."""
    if not cfg.data.dataset:
        return None
    meta = load_meta(cfg.data.dataset)
    vocab = padded_vocab_size(meta.vocab_size, cfg.parallel.tp)
    if cfg.model.vocab_size != vocab:
        cfg.model = cfg.model.with_overrides(vocab_size=vocab)
    return meta


# ---- the byte-level tokenizer as a `tokenizers` file ------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of the ByteLevel pre-tokenizer)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def document_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of `texts` as training data holds them: no special tokens added around a text
    (no BOS, whatever template the tokenizer file has), and special-token text in a text
    encoded as text (`encode_special_tokens`). `data prepare` and generate's prompts use it."""
    tok.encode_special_tokens = True
    return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def byte_tokenizer(vocab_size: int = 264) -> Tokenizer:
    """data/tokenizer.py's ByteTokenizer as a `tokenizers` Tokenizer: ids 0-255 are the bytes of
    the UTF-8 text, 256 <|bos|>, 257 <|endoftext|> (EOS), 258 <|pad|>, and the rest up to
    vocab_size reserved special tokens. Special tokens written in the text are encoded as their
    bytes (`encode_special_tokens`), as ByteTokenizer does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    n_special = vocab_size - 256
    if n_special < len(BYTE_SPECIALS):
        raise ConfigError(
            "--vocab-size", vocab_size, f">= {256 + len(BYTE_SPECIALS)} (256 bytes + BOS, EOS, PAD)"
        )
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = [*BYTE_SPECIALS, *(f"<|reserved_{i}|>" for i in range(len(BYTE_SPECIALS), n_special))]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    tok.encode_special_tokens = True
    return tok
