"""A packed, shuffled, seeded, resumable stream of fixed-length training samples.

The token array is cut into non-overlapping windows of seq_len + 1 tokens (inputs and the
next-token targets). Each epoch visits every window once in an order drawn from
(seed, epoch). The position (epoch, cursor) is all the state there is, so a checkpoint holding
it resumes the exact same sequence of batches. Every data-parallel rank computes the same order
and takes its own slice of each global batch; TP and PP ranks of one replica see the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmscale.errors import ConfigError


@dataclass
class StreamState:
    epoch: int = 0
    cursor: int = 0  # windows of this epoch already handed out

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> StreamState:
        return cls(epoch=int(d["epoch"]), cursor=int(d["cursor"]))


class WindowStream:
    """What every stream of windows shares: the (epoch, cursor) walk over `n_windows` windows
    and this DP rank's slice of each global batch. A subclass orders an epoch's positions
    (`_ordered`) and reads the token rows of window indices (`rows`)."""

    n_windows: int
    dp_rank: int
    dp_size: int
    state: StreamState

    def _ordered(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The window indices at `positions` of epoch `epoch`'s order."""
        raise NotImplementedError

    def rows(self, windows: np.ndarray) -> np.ndarray:
        """Token rows (len(windows), seq_len + 1) as int64."""
        raise NotImplementedError

    def _take(self, n: int) -> np.ndarray:
        """The next n window indices of the global stream, crossing epochs as needed."""
        out = []
        while n > 0:
            k = min(n, self.n_windows - self.state.cursor)
            pos = np.arange(self.state.cursor, self.state.cursor + k, dtype=np.int64)
            out.append(self._ordered(self.state.epoch, pos))
            self.state.cursor += k
            n -= k
            if self.state.cursor == self.n_windows:
                self.state = StreamState(self.state.epoch + 1, 0)
        return np.concatenate(out)

    def next_batch(self, global_batch: int) -> torch.Tensor:
        """This DP rank's share of the next global batch: (global_batch / dp, seq_len + 1) int64."""
        if global_batch % self.dp_size:
            raise ConfigError(
                "train.global_batch_size", global_batch, f"a multiple of dp={self.dp_size}"
            )
        idx = self._take(global_batch)
        local = global_batch // self.dp_size
        mine = idx[self.dp_rank * local : (self.dp_rank + 1) * local]
        return torch.from_numpy(self.rows(mine))


class PackedStream(WindowStream):
    """Global batches of windows; `next_batch` returns this DP rank's rows."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        field: str = "data.path",
    ) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(
                field, f"{len(tokens)} tokens", f"at least seq_len + 1 = {seq_len + 1}"
            )
        self.state = StreamState()
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._order = rng.permutation(self.n_windows)
            else:
                self._order = np.arange(self.n_windows)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def _ordered(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        windows: np.ndarray = self._epoch_order(epoch)[positions]
        return windows

    def rows(self, windows: np.ndarray) -> np.ndarray:
        starts = windows * self.seq_len
        rows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)[None, :]]
        return rows.astype(np.int64)
