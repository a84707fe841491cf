"""Training samples from a prepared dataset's token shards, memory-mapped.

Each shard is cut into non-overlapping windows of seq_len + 1 tokens (inputs and next-token
targets; a window never crosses a shard's end). The windows of all shards are numbered; each
epoch visits every window once, in an order given by a keyed permutation of (seed, epoch) that
is computed for the indices asked for only (a Feistel network over the next power of four,
cycle-walked into range): no index array over the whole corpus is ever built, so memory does not
grow with the corpus. Rows are read from `np.memmap`s, touching only their pages.

The state is PackedStream's: (epoch, cursor) in a `StreamState`, saved in checkpoints, so a
resumed run reads the same batches as an uninterrupted one. Every data-parallel rank computes
the same global order and takes its slice of each global batch.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from llmscale.data.prepared import PreparedMeta
from llmscale.data.stream import StreamState, WindowStream
from llmscale.errors import ConfigError

_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser of x ^ key: a well-spread 64-bit hash (uint64 arithmetic wraps)."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class IndexPermutation:
    """A pseudo-random bijection of [0, n) for one (seed, epoch), evaluated per index."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        self.half = (bits + 1) // 2  # a domain of 4**half >= n, at most 4n
        self.mask = np.uint64((1 << self.half) - 1)
        rng = np.random.default_rng([seed, epoch])
        self.keys = [np.uint64(k) for k in rng.integers(0, 2**63, size=_ROUNDS, dtype=np.int64)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right, k) & self.mask)
        return (left << h) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        y = self._feistel(np.asarray(idx, dtype=np.uint64))
        out = y >= self.n
        while out.any():  # cycle-walking: at most a few rounds (domain < 4n)
            y[out] = self._feistel(y[out])
            out = y >= self.n
        return y.astype(np.int64)


class ShardStream(WindowStream):
    """Global batches of windows over memory-mapped shards; `next_batch` returns this DP rank's
    rows. Same interface as PackedStream (`state`, `n_windows`, `next_batch`)."""

    def __init__(
        self,
        shards: list[Path],
        dtype: str,
        seq_len: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        field: str = "data.dataset",
    ) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.field = field
        np_dtype = np.dtype(dtype).newbyteorder("<")
        self.paths = [p for p in shards if p.stat().st_size > 0]
        self.shards = [np.memmap(p, dtype=np_dtype, mode="r") for p in self.paths]
        self.sizes = [p.stat().st_size for p in self.paths]
        for m in self.shards:  # windows are read at random: no read-ahead around each one
            mm = getattr(m, "_mmap", None)
            if mm is not None and hasattr(mmap, "MADV_RANDOM"):
                mm.madvise(mmap.MADV_RANDOM)
        counts = [(len(s) - 1) // seq_len for s in self.shards]
        # first window index of each shard (and the total at the end)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.n_windows = int(self.starts[-1])
        if self.n_windows < 1:
            total = sum(len(s) for s in self.shards)
            raise ConfigError(
                field, f"{total} tokens", f"a shard with at least seq_len + 1 = {seq_len + 1}"
            )
        self.state = StreamState()
        self._perm: IndexPermutation | None = None
        self._perm_epoch = -1

    @classmethod
    def from_meta(
        cls,
        meta: PreparedMeta,
        split: str,
        seq_len: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
    ) -> ShardStream:
        return cls(meta.shard_paths(split), meta.dtype, seq_len, seed, dp_rank, dp_size, shuffle)

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    def _ordered(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return positions
        if self._perm is None or self._perm_epoch != epoch:
            self._perm = IndexPermutation(self.n_windows, self.seed, epoch)
            self._perm_epoch = epoch
        return self._perm(positions)

    def rows(self, windows: np.ndarray) -> np.ndarray:
        """Token rows (len(windows), seq_len + 1) as int64, read from the memory maps."""
        out = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        shard = np.searchsorted(self.starts, windows, side="right") - 1
        self._check_sizes(set(shard.tolist()))
        offsets = (windows - self.starts[shard]) * self.seq_len
        for i, (s, o) in enumerate(zip(shard.tolist(), offsets.tolist(), strict=True)):
            out[i] = self.shards[s][o : o + self.seq_len + 1]
        self._unmap(set(shard.tolist()))
        return out

    def _check_sizes(self, shards: set[int]) -> None:
        """A shard cut short under its memory map would kill the process with SIGBUS when a page
        past its new end is read: each shard is stat'ed before its rows are (a few microseconds
        a batch) and a shorter one stops the run with one line. A cut between this check and the
        read still ends in SIGBUS: a shard must not change while a run reads it."""
        for s in shards:
            size = os.stat(self.paths[s]).st_size
            if size < self.sizes[s]:
                raise ConfigError(
                    self.field, str(self.paths[s].parent),
                    f"shards that stay whole while training ({self.paths[s].name} shrank from "
                    f"{self.sizes[s]:,} to {size:,} bytes; the run stops before reading past "
                    "its end)",
                )  # fmt: skip

    def _unmap(self, shards: set[int]) -> None:
        """Drop the pages just read from this process's mappings (they stay in the page cache):
        otherwise every page ever touched counts in the resident set, which then grows with the
        steps and the corpus instead of staying flat."""
        for s in shards:
            mm = getattr(self.shards[s], "_mmap", None)
            if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                mm.madvise(mmap.MADV_DONTNEED)
