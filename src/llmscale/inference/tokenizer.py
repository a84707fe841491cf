"""A run's tokenizer: the byte-level one for raw-text runs, the prepared dataset's otherwise.

The dataset folder (`data.dataset`, written by `llmscale data prepare`) holds tokenizer.json and
meta.json (vocab_size, eos_id, pad_id): the model's vocabulary may be padded above the
tokenizer's, and those padded ids must never be generated (`vocab_limit`). Both files are read
and checked as a run reads them (`load_meta`, `verify_tokenizer`: meta.json's fields, the
tokenizer's sha256), and the tokenizer is the one the checkpoint was trained with; each fault
is one line (exit 2). The shards are not needed here and not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from llmscale.config import JobConfig
from llmscale.data.prepared import document_ids, load_meta, verify_tokenizer
from llmscale.data.tokenizer import ByteTokenizer
from llmscale.errors import ConfigError
from llmscale.hf.check import TOKENIZER
from llmscale.hf.folder import TokenizerFiles, byte_tokenizer_files
from llmscale.train.data import byte_tokenizer_sha256, check_checkpoint_tokenizer


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


def run_tokenizer(cfg: JobConfig, checkpoint: Path | None = None) -> RunTokenizer:
    """The tokenizer of the run `cfg` describes (its data.dataset, or bytes), checked against
    the `checkpoint` folder it is to decode for (the tokenizer it was trained with)."""
    dataset = getattr(cfg.data, "dataset", "")
    if not dataset:
        if checkpoint is not None:
            check_checkpoint_tokenizer(checkpoint, byte_tokenizer_sha256(), "")
        vocab = cfg.model.vocab_size
        files = byte_tokenizer_files(vocab)
        return RunTokenizer(files=files, vocab_limit=vocab, byte_level=True)
    meta = load_meta(dataset)
    text = verify_tokenizer(meta)
    if checkpoint is not None:
        check_checkpoint_tokenizer(checkpoint, meta.tokenizer_sha256, dataset)
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises its own Exception subclasses
        raise ConfigError(
            "data.dataset", dataset, f"a {TOKENIZER} the tokenizers library reads ({e})"
        ) from None
    if meta.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "data.dataset",
            dataset,
            f"a tokenizer of at most the model's model.vocab_size={cfg.model.vocab_size} ids "
            f"(meta.json's vocab_size is {meta.vocab_size}: not the data this run trained on)",
        )
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
        eos_id=meta.eos_id,
        pad_id=meta.pad_id,
        encode_special_tokens=meta.encode_special_tokens,
    )
    return RunTokenizer(files=files, vocab_limit=meta.vocab_size, byte_level=False)
