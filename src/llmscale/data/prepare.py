"""`llmscale data prepare`: text files, folders and JSONL in, a tokenizer and token shards out.

Documents are streamed: a text file is one document (read in pieces of about 1 MiB, so a huge
file never sits in memory whole, each cut where the tokenizer's pre-tokenizer splits the whole
text too, so that the pieces' ids are the whole document's: `piece_cut`), a JSONL line is one. Pieces are encoded in
batches with the library's `encode_batch_fast`, which uses every core; each document ends with
the end-of-document token. The split is by document: a document's name (file path, or
path:line) hashed with CRC32 decides, so it is the same on every machine. Shards are written as
they fill (at most `shard_tokens` ids each) into DIR.tmp-PID, renamed to DIR at the end: an
interrupted prepare leaves no half folder. `bpe` trains a byte-level BPE tokenizer first (one
more pass over the sources, also streamed).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from llmscale.data.prepared import (
    BYTE_SPECIALS,
    ENCODE_SPECIAL_TOKENS,
    EOS_TOKEN,
    META_FILE,
    PAD_TOKEN,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    byte_tokenizer,
    document_ids,
    file_sha256,
    is_prepared,
    token_dtype,
    tokenizer_config,
)
from llmscale.errors import ConfigError, UsageError
from llmscale.paths import folder_problem
from llmscale.ui import console

PIECE_BYTES = 1 << 20  # a document is encoded in pieces of about this size, cut at line ends
BATCH_BYTES = 16 << 20  # text handed to one encode_batch call
SHARD_TOKENS = 100_000_000  # ids per shard file, at most
SNIFF_BYTES = 8192  # bytes read to tell text from binary

# Names tokenizer files give their end-of-document and padding tokens, in order of preference.
EOS_NAMES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")
PAD_NAMES = (PAD_TOKEN, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
BPE_SPECIALS = (EOS_TOKEN, PAD_TOKEN)


@dataclass(frozen=True)
class Source:
    """One input file and how its documents are read."""

    path: Path
    name: str  # shown and hashed for the split: relative to the input folder, or as given
    jsonl: bool


@dataclass
class PrepareResult:
    out: Path
    meta: dict[str, Any]
    skipped_binary: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    notices: list[str] = field(default_factory=list)  # said on stderr by `data prepare`


@dataclass
class _Stats:
    bytes_read: int = 0
    tokens: int = 0
    sources: list[dict[str, Any]] = field(default_factory=list)


def list_sources(inputs: list[str], glob: str = "") -> tuple[list[Source], int]:
    """Every input file (folders recursively, filtered by glob), and how many binary files were
    skipped. A `.jsonl` file holds one JSON document per line."""
    sources: list[Source] = []
    skipped = 0
    seen: dict[Path, str] = {}  # each file once: a folder given twice would double its documents
    for given in inputs:
        p = Path(given)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            if glob:
                files = [f for f in files if _matches(f.relative_to(p).as_posix(), glob)]
            candidates = [(f, f"{p.name}/{f.relative_to(p).as_posix()}") for f in files]
        elif p.is_file():
            candidates = [(p, p.name)]
        else:
            raise ConfigError("--input", given, "an existing file or folder")
        for f, name in candidates:
            real = f.resolve()
            if real in seen:
                raise ConfigError(
                    "--input",
                    given,
                    f"each file once ({f} is also read through --input {seen[real]}: its "
                    "documents would be tokenized twice)",
                )
            seen[real] = given
            if _is_binary(f):
                skipped += 1
            else:
                sources.append(Source(f, name, jsonl=f.suffix == ".jsonl"))
    return sources, skipped


def _matches(rel: str, pattern: str) -> bool:
    """A glob on the path relative to the folder; `**/` also matches files at the top."""
    if fnmatch.fnmatch(rel, pattern):
        return True
    return pattern.startswith("**/") and fnmatch.fnmatch(rel, pattern[3:])


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 4  # a character cut at the end of the sniffed bytes is fine
    return False


def is_val_document(name: str, val_fraction: float) -> bool:
    """The split by document, stable across machines: the CRC32 of its name decides."""
    return (zlib.crc32(name.encode()) % 100_000) < val_fraction * 100_000


# ---- documents --------------------------------------------------------------------------------


class _HashingReader:
    """A binary file whose bytes are hashed (sha256) and counted as they are read."""

    def __init__(self, f: BinaryIO, stats: _Stats) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.stats = stats

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        self.sha.update(b)
        self.stats.bytes_read += len(b)
        return b

    def readline(self) -> bytes:
        b = self.f.readline()
        self.sha.update(b)
        self.stats.bytes_read += len(b)
        return b


def _pieces(r: _HashingReader, cut: PieceCut) -> Iterator[str]:
    """A text file in pieces of about PIECE_BYTES or more, each ending where `cut` says the
    tokenizer splits the whole text too (the rest carried into the next piece)."""
    rest = b""  # the bytes of a UTF-8 character cut at the end of a block
    carry = ""
    while True:
        block = r.read(PIECE_BYTES)
        if not block:
            break
        text, rest = _decode(rest + block)
        text = carry + text
        k = cut(text)
        if k:
            yield text[:k]
        carry = text[k:]
    carry += rest.decode("utf-8", errors="replace")
    if carry:
        yield carry


PieceCut = Callable[[str], int]


def at_line_end(text: str) -> int:
    """After the last newline (anywhere if there is none): pieces of text to train BPE on."""
    return text.rfind("\n") + 1 or len(text)


CUT_WINDOW = 4096  # characters at the end of a piece searched for a safe cut


def piece_cut(tok: Any) -> PieceCut:
    """Where a piece of a long document may end so that encoding the pieces one by one gives
    the ids of the whole text: the length of its text to encode now (0: none, read more).

    - A byte-level BPE without merges (the `bytes` tokenizer): anywhere, every character
      encodes alone.
    - A tokenizer with a pre-tokenizer and no normalizer: at the start of the last pre-token in
      the piece's last CUT_WINDOW characters. The pre-tokenizer splits left to right, so the
      boundaries before the last one are those of the whole text; the model (BPE, ...) encodes
      each pre-token on its own.
    - Otherwise (a normalizer, e.g. SentencePiece-style prepending of "▁", or no
      pre-tokenizer): nowhere; the document is encoded whole.
    """
    model = json.loads(tok.to_str()).get("model", {})
    if tok.normalizer is not None or tok.pre_tokenizer is None:
        return lambda text: 0
    if model.get("type") == "BPE" and not model.get("merges"):
        return len
    pre = tok.pre_tokenizer

    def cut(text: str) -> int:
        start = max(0, len(text) - CUT_WINDOW)
        parts = pre.pre_tokenize_str(text[start:])
        return start + parts[-1][1][0] if len(parts) >= 3 else 0

    return cut


def _decode(piece: bytes) -> tuple[str, bytes]:
    """The text of a piece, and the bytes of a UTF-8 character cut at its end (carried over to
    the next piece); other bad bytes become U+FFFD."""
    try:
        return piece.decode("utf-8"), b""
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data":
            return piece[: e.start].decode("utf-8", errors="replace"), piece[e.start :]
        return piece.decode("utf-8", errors="replace"), b""


def iter_documents(
    sources: list[Source], field_name: str, stats: _Stats, cut: PieceCut | None = None
) -> Iterator[tuple[str, Iterator[str]]]:
    """(document name, its text pieces) for every document of every source, in order; text
    files are cut into pieces where `cut` says (`piece_cut` to encode; `at_line_end` to read)."""
    cut = cut or at_line_end
    for src in sources:
        with open(src.path, "rb") as f:
            r = _HashingReader(f, stats)
            if src.jsonl:
                lineno = 0
                while line := r.readline():
                    lineno += 1
                    if not line.strip():
                        continue
                    yield f"{src.name}:{lineno}", iter([_jsonl_text(src, lineno, line, field_name)])
            else:
                yield src.name, _pieces(r, cut)
            while r.read(PIECE_BYTES):  # a consumer that stopped early: hash the rest
                pass
        stats.sources.append(
            {"path": str(src.path), "sha256": r.sha.hexdigest(), "bytes": src.path.stat().st_size}
        )


def _jsonl_text(src: Source, lineno: int, line: bytes, field_name: str) -> str:
    try:
        obj = json.loads(line)
    except ValueError:
        raise UsageError(f"{src.path}:{lineno}: not a JSON object (JSONL: one per line)") from None
    text = obj.get(field_name) if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise ConfigError(
            "--jsonl-field", field_name, f"a string field of every object in {src.path}:{lineno}"
        )
    return text


# ---- tokenizers -------------------------------------------------------------------------------


@dataclass
class _Specials:
    eos_id: int
    pad_id: int


def _find_specials(tok: Any, where: str) -> _Specials:
    vocab = tok.get_vocab(with_added_tokens=True)
    eos = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
    if eos is None:
        raise ConfigError(
            "--tokenizer",
            where,
            "a tokenizer with an end-of-document token: " + ", ".join(EOS_NAMES),
        )
    pad = next((vocab[n] for n in PAD_NAMES if n in vocab), eos)
    return _Specials(eos, pad)


def load_tokenizer_file(path: str | Path) -> Any:
    """A `tokenizers` file as it is (e.g. one copied from a Hugging Face model)."""
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.is_file():
        raise ConfigError("--tokenizer", str(path), "bytes | bpe | an existing tokenizer.json")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises its own Exception subclasses for bad files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            "--tokenizer", str(path), f"a Hugging Face tokenizers file (tokenizer.json): {first}"
        ) from None


def train_bpe(texts: Iterator[str], vocab_size: int, show_progress: bool = False) -> Any:
    """A byte-level BPE tokenizer (GPT-2's pre-tokenization) with EOS and PAD special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    least = 256 + len(BPE_SPECIALS)
    if vocab_size < least:
        raise ConfigError("--vocab-size", vocab_size, f">= {least} (256 bytes + EOS and PAD)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,  # the library's own bar, on a terminal
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# ---- shards -----------------------------------------------------------------------------------


class ShardWriter:
    """Writes one split's ids into `split-00000.bin`, `split-00001.bin`, ... as they come."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder = folder
        self.split = split
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        self.shards: list[str] = []
        self.sha256: list[Any] = []  # each shard's hash, fed as it is written
        self.tokens = 0
        self.documents = 0
        self._f: BinaryIO | None = None
        self._in_shard = 0

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._f is None or self._in_shard == self.shard_tokens:
                self._open_next()
            assert self._f is not None
            k = min(len(ids), self.shard_tokens - self._in_shard)
            chunk = ids[:k].tobytes()
            self._f.write(chunk)
            self.sha256[-1].update(chunk)
            self._in_shard += k
            self.tokens += k
            ids = ids[k:]

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.shards.append(name)
        self.sha256.append(hashlib.sha256())
        self._f = open(self.folder / name, "wb")  # noqa: SIM115 (closed in close())
        self._in_shard = 0

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def split_meta(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "shards": self.shards,
            "shard_sha256": [h.hexdigest() for h in self.sha256],
            "documents": self.documents,
        }


# ---- the whole job ----------------------------------------------------------------------------


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bytes",
    vocab_size: int | None = None,
    glob: str = "",
    jsonl_field: str = "text",
    val_fraction: float = 0.05,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
) -> PrepareResult:
    """Tokenize `inputs` into a prepared dataset folder `out` (see the module docstring)."""
    t0 = time.perf_counter()
    if not inputs:
        raise UsageError("data prepare needs at least one --input")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError("--val-fraction", val_fraction, "a number in [0, 1)")
    if shard_tokens <= 0:
        raise ConfigError("shard_tokens", shard_tokens, "a positive integer")
    final = Path(out)
    if final.exists() and not (final.is_dir() and (is_prepared(final) or not any(final.iterdir()))):
        raise ConfigError(
            "--out", str(out), "a new folder, an empty one or an earlier prepared one"
        )
    # The folder is written beside itself (DIR.tmp-PID, then renamed): its parent must take it.
    problem = folder_problem(final.absolute().parent)
    if problem:
        raise ConfigError(
            "--out", str(out), f"a folder that can be created and written ({problem})"
        )
    least = {"bpe": 256 + len(BPE_SPECIALS), "bytes": 256 + len(BYTE_SPECIALS)}.get(tokenizer)
    if least is not None and vocab_size is not None and vocab_size < least:
        raise ConfigError(
            "--vocab-size", vocab_size, f">= {least} (256 bytes + the special tokens)"
        )
    sources, skipped = list_sources(inputs, glob)
    total_bytes = sum(s.path.stat().st_size for s in sources)
    if total_bytes == 0:
        raise ConfigError(
            "--input",
            " ".join(inputs),
            "files with text in them (found "
            + (f"{len(sources)} empty text files" if sources else "no text files")
            + (f", skipped {skipped} binary" if skipped else "")
            + ")",
        )
    stderr = console(stderr=True)

    # The tokenizer: a file as is, the byte-level one, or BPE trained on the sources.
    if tokenizer == "bytes":
        tok = byte_tokenizer(vocab_size or 264)
    elif tokenizer == "bpe":
        stderr.print(f"training a byte-level BPE tokenizer ({vocab_size or 8192:,} ids)")
        train_stats = _Stats()

        def texts() -> Iterator[str]:
            for _, pieces in iter_documents(sources, jsonl_field, train_stats):
                yield from pieces

        tok = train_bpe(texts(), vocab_size or 8192, progress and stderr.is_terminal)
    else:
        if vocab_size is not None:
            raise UsageError("--vocab-size applies to --tokenizer bpe or bytes, not a file")
        tok = load_tokenizer_file(tokenizer)
    specials = _find_specials(tok, tokenizer)
    # Documents are data: a special token's name written in the text is encoded as text. The
    # file cannot hold this setting: meta.json and tokenizer_config.json record it (prepared.py).
    tok.encode_special_tokens = True
    # Ids run from 0 to the largest one (a file's vocabulary may have holes).
    real_vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    dtype = token_dtype(real_vocab)

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if tokenizer in ("bytes", "bpe"):
            tok.save(str(tmp / TOKENIZER_FILE))
        else:  # the file as it is: its sha256 is the one a user (or an HF folder) has
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
        tok_config = tokenizer_config(
            tok, specials.eos_id, specials.pad_id, encode_special_tokens=tok.encode_special_tokens
        )
        (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_config, indent=2) + "\n")
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
        stats = _Stats()
        _encode_all(tok, sources, jsonl_field, val_fraction, specials.eos_id, writers, stats,
                    total_bytes, progress and stderr.is_terminal, stderr)  # fmt: skip
        for w in writers.values():
            w.close()
        if writers["train"].tokens == 0:
            raise ConfigError(
                "--input",
                " ".join(inputs),
                "text with at least one training document (all went to validation or were empty:"
                " lower --val-fraction or add documents)"
                if writers["val"].tokens
                else "text with at least one token",
            )
        meta = {
            "vocab_size": real_vocab,
            "dtype": dtype,
            "eos_id": specials.eos_id,
            "pad_id": specials.pad_id,
            "tokenizer_sha256": file_sha256(tmp / TOKENIZER_FILE),
            "tokenizer": tokenizer if tokenizer in ("bytes", "bpe") else "file",
            ENCODE_SPECIAL_TOKENS: tok.encode_special_tokens,
            "splits": {s: w.split_meta() for s, w in writers.items()},
            "val_fraction": val_fraction,
            "skipped_binary_files": skipped,
            "sources": stats.sources,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dt = time.perf_counter() - t0
    notices = []
    val_docs, all_docs = (
        writers["val"].documents,
        writers["val"].documents + writers["train"].documents,
    )
    if val_fraction > 0 and val_docs == 0:
        # Asked for a validation split and got none (DS23): each document's split is a hash of
        # its name, so a few documents may all land in train. Training on it says so again.
        notices.append(
            f"no document of the {all_docs:,} fell into the validation split (--val-fraction "
            f"{val_fraction}, decided per document): training on {final} reports no validation "
            "loss; a larger --val-fraction or more documents gives one"
        )
    return PrepareResult(
        out=final,
        meta=meta,
        skipped_binary=skipped,
        seconds=dt,
        tokens_per_s=stats.tokens / dt if dt > 0 else 0.0,
        notices=notices,
    )


def _encode_all(
    tok: Any,
    sources: list[Source],
    jsonl_field: str,
    val_fraction: float,
    eos_id: int,
    writers: dict[str, ShardWriter],
    stats: _Stats,
    total_bytes: int,
    show_bar: bool,
    stderr: Any,
) -> None:
    """Stream the documents through encode_batch_fast in batches of about BATCH_BYTES."""
    bar = None
    task = None
    t0 = time.perf_counter()
    if show_bar:
        bar = Progress(
            TextColumn("tokenizing"),
            BarColumn(),
            TextColumn(
                "{task.percentage:>3.0f}%  {task.fields[tokens]:,} tokens  {task.fields[rate]}"
            ),
            TimeRemainingColumn(),
            console=stderr,
            transient=True,
        )
        bar.start()
        task = bar.add_task("tokenizing", total=total_bytes, tokens=0, rate="")

    batch: list[str] = []
    owners: list[tuple[str, bool]] = []  # (split, ends its document) per piece
    size = 0

    def flush() -> None:
        nonlocal batch, owners, size
        if not batch:
            return
        for doc, (split, last) in zip(document_ids(tok, batch), owners, strict=True):
            ids = np.asarray(doc, dtype=np.uint32)
            if last:
                ids = np.append(ids, np.uint32(eos_id))
                writers[split].documents += 1
            writers[split].write(ids)
            stats.tokens += len(ids)
        batch, owners, size = [], [], 0
        if bar is not None and task is not None:
            rate = stats.tokens / max(time.perf_counter() - t0, 1e-9)
            bar.update(task, completed=stats.bytes_read, tokens=stats.tokens,
                       rate=f"{rate:,.0f} tok/s")  # fmt: skip

    for name, pieces in iter_documents(sources, jsonl_field, stats, piece_cut(tok)):
        split = "val" if is_val_document(name, val_fraction) else "train"
        pending: str | None = None
        for piece in pieces:
            if pending is not None:
                batch.append(pending)
                owners.append((split, False))
                size += len(pending)
            pending = piece
            if size >= BATCH_BYTES:
                flush()
        # The document's last piece carries its EOS; an empty document is just EOS.
        batch.append(pending or "")
        owners.append((split, True))
        size += len(pending or "")
        if size >= BATCH_BYTES:
            flush()
    flush()
    if bar is not None:
        bar.stop()
