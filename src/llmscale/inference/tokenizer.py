"""A run's tokenizer: the byte-level one for raw-text runs, the prepared dataset's otherwise.

The dataset folder (`data.dataset`, written by `llmscale data prepare`) holds tokenizer.json and
meta.json (vocab_size, eos_id, pad_id): the model's vocabulary may be padded above the
tokenizer's, and those padded ids must never be generated (`vocab_limit`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from llmscale.config import JobConfig
from llmscale.data.prepared import document_ids, encodes_special_tokens
from llmscale.data.tokenizer import ByteTokenizer
from llmscale.errors import ConfigError
from llmscale.hf.folder import TOKENIZER, TokenizerFiles, byte_tokenizer_files


@dataclass(frozen=True)
class RunTokenizer:
    """Encode and decode as the run's data did; the ids generation may produce."""

    files: TokenizerFiles
    vocab_limit: int  # ids >= this are padding of the model's vocabulary
    byte_level: bool

    @property
    def eos_id(self) -> int:
        return self.files.eos_id

    def encode(self, text: str) -> list[int]:
        """`text` as training data encoded a document (`document_ids`): no BOS the run never
        saw, special-token text kept as text."""
        if self.byte_level:
            return [int(i) for i in ByteTokenizer().encode(text)]
        return document_ids(self.files.tokenizer(), [text])[0]

    def holes(self) -> list[int]:
        """Ids below vocab_limit that no token of the tokenizer has (a file's vocabulary may
        skip ids): never in the data, so never to be generated."""
        if self.byte_level:
            return []
        used = set(Tokenizer.from_str(self.files.json_text).get_vocab(True).values())
        return [i for i in range(self.vocab_limit) if i not in used]

    def decode(self, ids: list[int]) -> str:
        if self.byte_level:
            return ByteTokenizer().decode(ids)
        return Tokenizer.from_str(self.files.json_text).decode(ids, skip_special_tokens=True)


def run_tokenizer(cfg: JobConfig) -> RunTokenizer:
    """The tokenizer of the run `cfg` describes (its data.dataset, or bytes)."""
    dataset = getattr(cfg.data, "dataset", "")
    if not dataset:
        vocab = cfg.model.vocab_size
        files = byte_tokenizer_files(vocab)
        return RunTokenizer(files=files, vocab_limit=vocab, byte_level=True)
    root = Path(dataset)
    try:
        meta = json.loads((root / "meta.json").read_text())
        text = (root / TOKENIZER).read_text()
    except (OSError, json.JSONDecodeError):
        raise ConfigError(
            "data.dataset",
            dataset,
            "the prepared folder the run trained on (meta.json, tokenizer.json)",
        ) from None
    tok = Tokenizer.from_str(text)
    bos = next(
        (
            tok.token_to_id(t)
            for t in ("<|bos|>", "<s>", "<|begin_of_text|>")
            if tok.token_to_id(t) is not None
        ),
        None,
    )
    files = TokenizerFiles(
        text,
        bos_id=bos,
        eos_id=int(meta["eos_id"]),
        pad_id=int(meta["pad_id"]),
        encode_special_tokens=encodes_special_tokens(meta),
    )
    return RunTokenizer(files=files, vocab_limit=int(meta["vocab_size"]), byte_level=False)
