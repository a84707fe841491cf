"""Corpus: a folder of text files read as bytes, split into train and validation by file."""

from __future__ import annotations

import functools
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmscale.data.tokenizer import ByteTokenizer
from llmscale.errors import ConfigError


def stdlib_source_dir() -> Path:
    """The Python standard library's own source: a corpus that is always present."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class Corpus:
    """Token arrays of the train and validation files (documents joined with EOS)."""

    root: Path
    train: np.ndarray
    val: np.ndarray
    n_train_files: int
    n_val_files: int
    warnings: tuple[str, ...] = ()  # what a user should know before training on it


def list_files(root: Path, glob: str, max_files: int = 0) -> list[Path]:
    """Sorted matching files under root; site-packages is skipped (installed code, not stdlib)."""
    files = sorted(
        f
        for f in root.glob(glob)
        if f.is_file() and "site-packages" not in f.relative_to(root).parts
    )
    return files[:max_files] if max_files else files


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """A stable, machine-independent split: a file's CRC32 decides, not its position."""
    return (zlib.crc32(rel_path.encode()) % 10_000) < val_fraction * 10_000


@functools.lru_cache(maxsize=8)
def load_corpus(path: str, glob: str, val_fraction: float, max_files: int = 0) -> Corpus:
    """Read and tokenize every file; EOS after each document.

    Cached per process (benchmarks and tests build many trainers over one corpus); the token
    arrays are read-only so that no user of the cache can change another's data.
    """
    root = Path(path) if path else stdlib_source_dir()
    if not root.is_dir():
        raise ConfigError("data.path", path, "an existing folder of text files")
    files = list_files(root, glob, max_files)
    if not files:
        raise ConfigError("data.glob", glob, f"a pattern matching at least one file under {root}")
    tok = ByteTokenizer()
    eos = np.array([tok.eos_id], np.uint16)
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    binary: list[Path] = []
    for f in files:
        data = _read(f)
        if b"\0" in data[:8192]:  # git's test for a binary file
            binary.append(f)
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        (val if is_val_file(str(f.relative_to(root)), val_fraction) else train).extend((ids, eos))
    if not train:
        raise ConfigError(
            "data.val_fraction", val_fraction, "a fraction that leaves training files"
        )
    train_tokens = np.concatenate(train)
    val_tokens = np.concatenate(val) if val else np.zeros(0, np.uint16)
    for arr in (train_tokens, val_tokens):
        arr.setflags(write=False)
    warnings = []
    if binary:
        warnings.append(
            f"data: {len(binary)} of {len(files)} files look binary (NUL bytes), e.g. "
            f"{binary[0]}: they are trained on as bytes; data.glob selects the files"
        )
    if val_fraction > 0 and not val:
        warnings.append(
            f"data: no file of the {len(files)} fell into the validation split (data.val_fraction "
            f"= {val_fraction}, decided per file): no validation loss will be reported"
        )
    return Corpus(
        root=root,
        train=train_tokens,
        val=val_tokens,
        n_train_files=len(train) // 2,
        n_val_files=len(val) // 2,
        warnings=tuple(warnings),
    )


def _read(f: Path) -> bytes:
    """A corpus file's bytes; one that cannot be read is a one-line error, not a traceback."""
    try:
        return f.read_bytes()
    except OSError as e:
        raise ConfigError(
            "data.path", str(f), f"readable files ({e.strerror or e}; data.glob selects the files)"
        ) from None
