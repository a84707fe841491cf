"""A prepared dataset: the folder `llmscale data prepare` writes, and the facts read from it.

    DIR/meta.json        vocab_size, dtype, eos_id, pad_id, tokenizer_sha256,
                         encode_special_tokens, splits (each: tokens, shards, shard_sha256,
                         documents), sources
    DIR/tokenizer.json   the tokenizer (a `tokenizers` Tokenizer file)
    DIR/tokenizer_config.json  what transformers reads beside it (split_special_tokens)
    DIR/train-00000.bin  raw little-endian token ids, no header (uint16 or uint32), documents
    DIR/val-00000.bin    separated by eos_id

Torch-free: the CLI, the trainer and the Hugging Face export read the same meta. A folder is
verified when a run opens it (`verify_dataset`): every shard inside the folder, present, of a
whole number of ids, adding up to meta.json's counts, holding only ids below the tokenizer's
vocabulary (a max over each memory-mapped shard, cached by the shard's sha256) and with the
sha256 `data prepare` recorded for it, and tokenizer.json present with meta.json's sha256. A missing or empty validation split is a notice, not an error. The model's
vocabulary is the tokenizer's, padded (`padded_vocab_size`) so that it splits evenly over tensor
parallel ranks in GEMM-friendly blocks; the padded ids never occur in the data and are masked
out of the loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmscale.errors import ConfigError
from llmscale.paths import cache_dir, cache_notice, cache_write_problem, os_reason

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from llmscale.config import JobConfig

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DTYPES = ("uint16", "uint32")
DTYPE_BYTES = {"uint16": 2, "uint32": 4}
SHARD_CACHE = "dataset-shards.json"  # in cache_dir(): shards' sha256 and largest ids (_ShardCache)
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
    shard_sha256: list[str] = field(default_factory=list)  # [] in folders prepared before it


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
    encode_special_tokens: bool = True  # special-token text in a document was encoded as text
    notices: tuple[str, ...] = ()  # what `verify_dataset` found worth saying (printed by a run)

    def shard_paths(self, split: str) -> list[Path]:
        s = self.splits.get(split)
        return [self.root / name for name in s.shards] if s else []

    @property
    def tokenizer_path(self) -> Path:
        return self.root / TOKENIZER_FILE

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["root"], d["notices"]
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
                shard_sha256=[str(x) for x in s.get("shard_sha256", [])],
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
            encode_special_tokens=encodes_special_tokens(raw, field_name),
        )
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            field_name, str(path), f"{allowed}; its meta.json is unreadable: {e}"
        ) from None
    if meta.dtype not in DTYPES:
        raise ConfigError(f"{field_name} meta.json dtype", meta.dtype, " | ".join(DTYPES))
    if meta.vocab_size < 1:
        raise ConfigError(f"{field_name} meta.json vocab_size", meta.vocab_size, ">= 1")
    for key in ("eos_id", "pad_id"):
        if not 0 <= getattr(meta, key) < meta.vocab_size:
            raise ConfigError(
                f"{field_name} meta.json {key}",
                getattr(meta, key),
                f"an id in [0, vocab_size {meta.vocab_size})",
            )
    for name, s in meta.splits.items():
        if s.shard_sha256 and len(s.shard_sha256) != len(s.shards):
            raise ConfigError(
                f"{field_name} meta.json splits.{name}.shard_sha256",
                f"{len(s.shard_sha256)} hashes",
                f"one per shard ({len(s.shards)})",
            )
    if "train" not in meta.splits:
        raise ConfigError(f"{field_name} meta.json splits", sorted(meta.splits), "a train split")
    return meta


def verify_dataset(meta: PreparedMeta, field_name: str = "data.dataset") -> PreparedMeta:
    """`meta` checked against its folder, as a run opens it; each fault is a one-line ConfigError
    naming the file. Returned: `meta` with `notices` (a missing or empty validation split: the
    run trains without validation, and says so) and without a validation split whose files are
    missing.

    A shard is read (sha256, then the largest id: np.max over its memory map) when its
    fingerprint is new: its resolved path, size, inode, modification and change time. The
    change time (ctime) moves with every write and every utime, and no call sets it back, so
    a shard rewritten in place with its size and mtime kept is read again. Its sha256 must be
    the one `data prepare` recorded in meta.json (folders prepared before that are not
    compared), and its largest id is cached under that sha256. An unchanged shard's later
    open is one stat (`_ShardCache`)."""
    root = meta.root.resolve()
    data = str(meta.root)
    verify_tokenizer(meta, field_name)
    notices: list[str] = []
    splits = dict(meta.splits)
    width = DTYPE_BYTES[meta.dtype]
    cache = _ShardCache()
    for split, s in meta.splits.items():
        paths = [_inside(root, data, split, name, field_name) for name in s.shards]
        missing = [p for p in paths if not p.is_file()]
        if missing and split == "val":
            notices.append(
                f"{data}: validation shard {missing[0].name} is missing: training without "
                "validation (prepare the folder again to restore it)"
            )
            del splits[split]
            continue
        if missing:
            raise ConfigError(
                field_name, data, f"a prepared folder with every shard meta.json lists "
                f"({split} shard {missing[0].name} is missing: prepare the folder again)"
            )  # fmt: skip
        sizes = [p.stat().st_size for p in paths]
        for p, size in zip(paths, sizes, strict=True):
            if size % width:
                raise ConfigError(
                    field_name, data, f"shards of whole {meta.dtype} ids ({p.name} holds {size:,} "
                    f"bytes, not a multiple of {width}: truncated or damaged)"
                )  # fmt: skip
        tokens = sum(sizes) // width
        if tokens != s.tokens:
            raise ConfigError(
                field_name, data, f"shards holding the {s.tokens:,} {split} tokens meta.json "
                f"states (they hold {tokens:,}: truncated, or not the files it was written with)"
            )  # fmt: skip
        for i, (p, size) in enumerate(zip(paths, sizes, strict=True)):
            sha = cache.sha256(p)
            top = cache.max_id(p, sha, size, meta.dtype)
            if top >= meta.vocab_size:
                cache.save()
                raise ConfigError(
                    field_name, data, f"token ids below meta.json's vocab_size {meta.vocab_size:,}"
                    f" ({p.name} holds id {top:,}: damaged, or tokenized with another tokenizer)"
                )  # fmt: skip
            if s.shard_sha256 and sha != s.shard_sha256[i]:
                cache.save()
                raise ConfigError(
                    field_name, data, f"shards as `data prepare` wrote them ({p.name}'s sha256 is "
                    f"{sha[:12]}..., meta.json records {s.shard_sha256[i][:12]}...: changed or "
                    "damaged since; prepare the folder again)"
                )  # fmt: skip
    cache.save()
    val = splits.get("val")
    if "val" in meta.splits and val is not None and val.tokens == 0:
        notices.append(
            f"{data}: the validation split holds 0 tokens: training without validation "
            "(prepare it again with a larger --val-fraction, or more documents)"
        )
    elif "val" not in meta.splits:
        notices.append(f"{data}: no validation split: training without validation")
    return dataclasses.replace(meta, splits=splits, notices=meta.notices + tuple(notices))


def verify_tokenizer(meta: PreparedMeta, field_name: str = "data.dataset") -> str:
    """The folder's tokenizer.json, present and the one meta.json's sha256 names (what the data
    was tokenized with): its text, or a one-line ConfigError."""
    data = str(meta.root)
    tok = meta.root / TOKENIZER_FILE
    try:
        raw = tok.read_bytes()
    except OSError as e:
        why = "missing" if isinstance(e, FileNotFoundError) else (e.strerror or "unreadable")
        raise ConfigError(
            field_name,
            data,
            f"a prepared folder with its {TOKENIZER_FILE} ({why}: prepare "
            "the folder again, or copy the tokenizer it was prepared with back)",
        ) from None
    sha = hashlib.sha256(raw).hexdigest()
    if sha != meta.tokenizer_sha256:
        raise ConfigError(
            field_name,
            data,
            f"a {TOKENIZER_FILE} whose sha256 is meta.json's tokenizer_sha256 "
            f"({meta.tokenizer_sha256[:12]}...; the file's is {sha[:12]}...: it was changed "
            "after the data was tokenized with it)",
        )
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(field_name, data, f"a {TOKENIZER_FILE} of UTF-8 text") from None


def _inside(root: Path, data: str, split: str, name: str, field_name: str) -> Path:
    """The shard `name` of meta.json, resolved; a ConfigError unless it lies in the folder (an
    absolute path, `..` or a link leading out of it would read another file as tokens)."""
    p = (root / name).resolve()
    if not p.is_relative_to(root):
        raise ConfigError(
            f"{field_name} meta.json splits.{split}.shards", name,
            f"a file inside {data} (this one resolves to {p})",
        )  # fmt: skip
    return p


class _ShardCache:
    """What reading a shard found, in cache_dir()/SHARD_CACHE: `fingerprints` (path, size,
    inode, mtime, ctime -> sha256) and `max_ids` (sha256 and dtype -> the largest id). An
    unreadable or unwritable cache only costs the reads again, and a notice line says so (once per process)."""

    def __init__(self) -> None:
        self.path = cache_dir() / SHARD_CACHE
        self.fingerprints: dict[str, str] = {}
        self.max_ids: dict[str, int] = {}
        self.dirty = False
        try:
            raw = json.loads(self.path.read_text())
            self.fingerprints = {str(k): str(v) for k, v in dict(raw["fingerprints"]).items()}
            self.max_ids = {str(k): int(v) for k, v in dict(raw["max_ids"]).items()}
        except (FileNotFoundError, NotADirectoryError):  # none yet; a file for a folder: save says
            pass
        except OSError as e:
            self._unusable(f"is unreadable ({os_reason(e)})")
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError):
            self._unusable("is unreadable (not the shards' cache)")

    def _unusable(self, why: str) -> None:
        self.fingerprints, self.max_ids = {}, {}
        cache_notice(f"dataset cache {self.path} {why}; rebuilt")

    @staticmethod
    def fingerprint(path: Path) -> str:
        st = path.stat()
        return f"{path}|{st.st_size}|{st.st_dev}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}"

    def sha256(self, path: Path) -> str:
        key = self.fingerprint(path)
        if key not in self.fingerprints:
            self.fingerprints[key] = file_sha256(path)
            self.dirty = True
        return self.fingerprints[key]

    def max_id(self, path: Path, sha: str, size: int, dtype: str) -> int:
        if size == 0:
            return -1
        key = f"{sha}|{dtype}"
        if key not in self.max_ids:
            import numpy as np

            ids = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
            self.max_ids[key] = int(ids.max())
            del ids
            self.dirty = True
        return self.max_ids[key]

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
            body = {"fingerprints": self.fingerprints, "max_ids": self.max_ids}
            tmp.write_text(json.dumps(body, indent=0) + "\n")
            tmp.replace(self.path)  # atomic: ranks opening the same folder write it together
        except OSError as e:
            problem = cache_write_problem(self.path.parent, e)
            cache_notice(f"dataset cache {problem}; each run reads every shard again to check it")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> str:
    """uint16 while every id fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def apply_dataset(cfg: JobConfig, given: Collection[str] = ()) -> PreparedMeta | None:
    """With data.dataset set: read and verify its meta and make the model's vocabulary follow the
    tokenizer (padded for cfg.parallel.tp). The trainer and `train --dry-run` call this before
    validating, so the memory check, the prediction and config.toml see the model that will be
    built. None (and cfg untouched) for the raw byte-level data of data.path.

    `given`: the keys the user set (config.given_keys). Those the dataset decides (data.path,
    model.vocab_size) are refused when set to something else, rather than silently replaced."""
    if not cfg.data.dataset:
        return None
    meta = verify_dataset(load_meta(cfg.data.dataset))
    vocab = padded_vocab_size(meta.vocab_size, cfg.parallel.tp)
    if "data.path" in given and cfg.data.path:
        raise ConfigError(
            "data.path", cfg.data.path,
            "unset with data.dataset, whose shards are what trains (choose one of the two)",
        )  # fmt: skip
    if "model.vocab_size" in given and cfg.model.vocab_size != vocab:
        raise ConfigError(
            "model.vocab_size", cfg.model.vocab_size,
            f"unset (or {vocab}) with data.dataset: its tokenizer's {meta.vocab_size:,} ids, "
            f"padded to a multiple of {VOCAB_MULTIPLE} x tp, set it",
        )  # fmt: skip
    if cfg.model.vocab_size != vocab:
        cfg.model = cfg.model.with_overrides(vocab_size=vocab)
    return meta


# ---- how a document is encoded, and where a folder records it ---------------------------------
#
# Documents are data: a special token's text inside one ("<|endoftext|>", "<s>") is encoded as
# text, not as the special token (`Tokenizer.encode_special_tokens`). `tokenizers` does not save
# that setting in tokenizer.json (0.23: the file's fields are version, truncation, padding,
# added_tokens, normalizer, pre_tokenizer, post_processor, decoder and model; the flag lives on
# the in-memory added vocabulary only), so `Tokenizer.from_file` alone encodes such text as the
# special id. A folder therefore records it where each reader looks:
# - meta.json's ENCODE_SPECIAL_TOKENS: llmscale (`dataset_tokenizer`, generate's tokenizer) and
#   anyone using `tokenizers` directly (`tok.encode_special_tokens = meta[...]`);
# - tokenizer_config.json's split_special_tokens (`tokenizer_config`): transformers' tokenizers
#   (AutoTokenizer, PreTrainedTokenizerFast), on a prepared folder and on an exported one.
# A document is encoded without the file's template (add_special_tokens=False: no BOS).
ENCODE_SPECIAL_TOKENS = "encode_special_tokens"


def encodes_special_tokens(raw_meta: dict[str, Any], field_name: str = "data.dataset") -> bool:
    """meta.json's ENCODE_SPECIAL_TOKENS; true when absent (every `data prepare` encoded so)."""
    value = raw_meta.get(ENCODE_SPECIAL_TOKENS, True)
    if not isinstance(value, bool):
        raise ConfigError(f"{field_name} meta.json {ENCODE_SPECIAL_TOKENS}", value, "true | false")
    return value


def dataset_tokenizer(meta: PreparedMeta) -> Tokenizer:
    """The folder's tokenizer.json, set to encode as its shards were (meta.json's record)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(meta.tokenizer_path))
    tok.encode_special_tokens = meta.encode_special_tokens
    return tok


def tokenizer_config(
    tok: Tokenizer,
    eos_id: int,
    pad_id: int,
    bos_id: int | None = None,
    encode_special_tokens: bool = True,
) -> dict[str, Any]:
    """tokenizer_config.json beside `tok`'s tokenizer.json: transformers' fast tokenizer with
    these special tokens, splitting special-token text as `encode_special_tokens` says (the one
    setting transformers reads from this file and not from tokenizer.json)."""

    def name(i: int | None) -> str | None:
        return None if i is None else tok.id_to_token(i)

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos_id),
        "eos_token": name(eos_id),
        "pad_token": name(pad_id),
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": encode_special_tokens,
    }


def document_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of `texts` as training data holds them: no special tokens added around a text
    (no BOS, whatever template the tokenizer file has), and special-token text encoded as `tok`
    is set to (`encode_special_tokens`: `data prepare` sets it, `dataset_tokenizer` and
    generate's tokenizer apply meta.json's record). `data prepare` and generate's prompts use it."""
    return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


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
