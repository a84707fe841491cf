"""Byte-level tokenizer: every byte is a token, plus a few special tokens above 255."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmscale.model.config import BYTE_VOCAB_SIZE


@dataclass(frozen=True)
class ByteTokenizer:
    """Tokens 0..255 are bytes; BOS, EOS and PAD follow; the rest up to vocab_size are reserved."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = BYTE_VOCAB_SIZE

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> np.ndarray:
        """uint16 token ids of the UTF-8 bytes of text."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        parts = ([np.array([self.bos_id], np.uint16)] if bos else []) + [ids]
        if eos:
            parts.append(np.array([self.eos_id], np.uint16))
        return np.concatenate(parts) if len(parts) > 1 else ids

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of the byte tokens; special tokens are dropped, bad UTF-8 replaced."""
        arr = np.asarray(ids)
        return bytes(arr[arr < 256].astype(np.uint8)).decode("utf-8", errors="replace")
