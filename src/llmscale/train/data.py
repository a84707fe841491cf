"""What the trainer reads: the raw byte-level corpus (data.path) or a prepared dataset
(data.dataset), the tokenizer identity kept in checkpoints, and the padded vocabulary's mask.

A prepared dataset trains through memory-mapped shards (`data/shards.py`); its model vocabulary
is the tokenizer's padded to a multiple of 64 x tp (`data.prepared.apply_dataset`), and the
padded ids are masked out of the loss (`mask_padded_vocab`). The tokenizer's sha256 is saved in
every checkpoint: resuming or evaluating a checkpoint on data from another tokenizer is a
one-line ConfigError.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from llmscale.config import DataSection, JobConfig
from llmscale.data.corpus import load_corpus
from llmscale.data.prepared import PreparedMeta, byte_tokenizer
from llmscale.data.shards import ShardStream
from llmscale.data.stream import PackedStream
from llmscale.errors import ConfigError
from llmscale.train.checkpoint import Checkpointer

# Where the checkpoint keeps the tokenizer's sha256 (in _AppState's "trainer" entry).
TOKENIZER_KEY = "tokenizer_sha256"
_FQN = f"app.trainer.{TOKENIZER_KEY}"
_EMBEDDING_FQN = "app.model.tok_embeddings.weight"


@functools.cache
def byte_tokenizer_sha256() -> str:
    """The identity of the raw byte-level data: the sha256 of the byte tokenizer's file, the same
    as `data prepare --tokenizer bytes` writes (both encode alike)."""
    return hashlib.sha256(byte_tokenizer().to_str(pretty=True).encode()).hexdigest()


@dataclass
class TrainData:
    """The training stream (this DP rank's rows), the validation tokens and what they are."""

    train_stream: PackedStream | ShardStream
    val_tokens: np.ndarray  # a memory map of the first validation shard for a prepared dataset
    summary: str  # the `data:` line a run prints
    tokenizer_sha256: str
    n_valid_vocab: int | None  # ids at and above it are padding, masked out of the loss
    warnings: list[str] = field(default_factory=list)  # about the corpus, printed before step 1


def build_data(cfg: JobConfig, dp_rank: int, dp_size: int, meta: PreparedMeta | None) -> TrainData:
    """The data of `cfg`: `meta` is what `apply_dataset(cfg)` returned (None: data.path)."""
    seq, seed = cfg.data.seq_len, cfg.job.seed
    if meta is None:
        corpus = load_corpus(
            cfg.data.path, cfg.data.glob, cfg.data.val_fraction, cfg.data.max_files
        )
        return TrainData(
            train_stream=PackedStream(corpus.train, seq, seed, dp_rank=dp_rank, dp_size=dp_size),
            val_tokens=corpus.val,
            summary=(
                f"{corpus.root} ({corpus.n_train_files} train / {corpus.n_val_files} val files, "
                f"{len(corpus.train):,} train tokens)"
            ),
            tokenizer_sha256=byte_tokenizer_sha256(),
            n_valid_vocab=None,
            warnings=list(corpus.warnings),
        )
    if meta.vocab_size > cfg.model.vocab_size:  # a model from checkpoint.init_from, or eval's
        raise ConfigError(
            "data.dataset", cfg.data.dataset,
            f"data whose ids fit the model's vocabulary of {cfg.model.vocab_size:,} (this "
            f"tokenizer has {meta.vocab_size:,} ids: data from another tokenizer than the model's)",
        )  # fmt: skip
    stream = ShardStream.from_meta(meta, "train", seq, seed, dp_rank=dp_rank, dp_size=dp_size)
    val_paths = [p for p in meta.shard_paths("val") if p.stat().st_size > 0]
    val = (
        np.memmap(val_paths[0], dtype=np.dtype(meta.dtype).newbyteorder("<"), mode="r")
        if val_paths
        else np.zeros(0, np.uint16)
    )
    tr, va = meta.splits["train"], meta.splits.get("val")
    return TrainData(
        train_stream=stream,
        val_tokens=val,
        summary=(
            f"{meta.root} (prepared: {tr.tokens:,} train / {va.tokens if va else 0:,} val tokens, "
            f"{len(tr.shards)} train shards, tokenizer vocabulary {meta.vocab_size:,} padded to "
            f"{cfg.model.vocab_size:,})"
        ),
        tokenizer_sha256=meta.tokenizer_sha256,
        n_valid_vocab=meta.vocab_size if meta.vocab_size < cfg.model.vocab_size else None,
        # a missing or empty validation split (verify_dataset); raw-data keys it does not read
        warnings=[*meta.notices, *unread_raw_data_keys(cfg)],
    )


# data.* keys that choose data.path's raw files; a prepared dataset chose its own.
RAW_DATA_KEYS = ("glob", "val_fraction", "max_files")


def unread_raw_data_keys(cfg: JobConfig) -> list[str]:
    """With data.dataset: one notice naming the raw-data keys set to other than their defaults
    (printed with the run's data notices, before step 1, after every refusal): they choose
    data.path's files, and `data prepare` chose the dataset's."""
    default = DataSection()
    unread = [f"data.{k}" for k in RAW_DATA_KEYS if getattr(cfg.data, k) != getattr(default, k)]
    if not unread:
        return []
    return [
        f"{', '.join(unread)} choose data.path's raw files; data.dataset's files and validation "
        "split were chosen by `data prepare` (its --glob, --val-fraction): not read"
    ]


def checkpoint_tokenizer_sha256(path: str | Path) -> str | None:
    """The tokenizer sha256 a checkpoint was trained with (None: a checkpoint without one)."""
    reader = dcp.FileSystemReader(str(path))
    if _FQN not in reader.read_metadata().state_dict_metadata:
        return None
    state: dict[str, Any] = {"app": {"trainer": {TOKENIZER_KEY: ""}}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader)
    return str(state["app"]["trainer"][TOKENIZER_KEY])


def check_checkpoint_tokenizer(
    path: str | Path, sha256: str, data: str, field: str = "data.dataset"
) -> bool:
    """A ConfigError (one line, exit 2) when the checkpoint at `path` was trained on data from
    another tokenizer than the one of `data` (its sha256 given). False when the checkpoint keeps
    no tokenizer (written before it did): nothing to compare."""
    stored = checkpoint_tokenizer_sha256(path)
    if stored is not None and stored != sha256:
        raise ConfigError(
            field,
            data or "(raw byte-level data.path)",
            f"data from the tokenizer that checkpoint {Path(path).name} was trained with (sha256 "
            f"{stored[:12]}...; this data's tokenizer is {sha256[:12]}...)",
        )
    return stored is not None


def adopt_checkpoint_vocab(cfg: JobConfig, meta: PreparedMeta | None) -> None:
    """Resuming on a prepared dataset: keep the vocabulary the checkpoint was trained with.

    The padding depends on tp (a multiple of 64 x tp), so a run resumed under another tp could
    ask for another size than its checkpoint holds; the checkpoint's size is kept whenever it
    covers the tokenizer and splits over this tp, and otherwise the resume stops with one line.
    """
    if meta is None or not cfg.checkpoint.resume:
        return
    found = Checkpointer(Path(cfg.job.run_dir) / cfg.checkpoint.folder).latest()
    if found is None:
        return
    entry = (
        dcp.FileSystemReader(str(found[1])).read_metadata().state_dict_metadata.get(_EMBEDDING_FQN)
    )
    size = getattr(entry, "size", None)
    if not size or int(size[0]) == cfg.model.vocab_size:
        return
    vocab, tp = int(size[0]), cfg.parallel.tp
    if vocab < meta.vocab_size:
        return  # another tokenizer: the sha256 check at resume names it
    if vocab % tp:
        raise ConfigError(
            "parallel.tp", tp, f"a divisor of the vocabulary {vocab} of checkpoint {found[1].name}"
        )
    cfg.model = cfg.model.with_overrides(vocab_size=vocab)


def mask_padded_vocab(logits: torch.Tensor, n_valid: int | None) -> torch.Tensor:
    """Logits with the padded ids (>= n_valid) set to the dtype's lowest value, so they take no
    probability in the loss or in sampling. Works on logits split over the vocabulary (a DTensor
    sharded on its last dim under tensor parallelism): each rank masks its own columns."""
    if n_valid is None or n_valid >= logits.shape[-1]:
        return logits
    if isinstance(logits, DTensor):
        local = logits.to_local()
        offset = 0
        for mesh_dim, p in enumerate(logits.placements):
            if p.is_shard() and p.dim in (-1, logits.ndim - 1):  # type: ignore[attr-defined]
                offset = logits.device_mesh.get_local_rank(mesh_dim) * local.shape[-1]
        masked = _mask_columns(local, n_valid - offset)
        return DTensor.from_local(
            masked, logits.device_mesh, logits.placements, shape=logits.shape,
            stride=logits.stride(),
        )  # fmt: skip
    return _mask_columns(logits, n_valid)


def _mask_columns(x: torch.Tensor, n_valid: int) -> torch.Tensor:
    if n_valid >= x.shape[-1]:
        return x
    padded = torch.arange(x.shape[-1], device=x.device) >= max(n_valid, 0)
    return x.masked_fill(padded, torch.finfo(x.dtype).min)
