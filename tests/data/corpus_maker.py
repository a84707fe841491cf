"""Small corpora the data tests write themselves (nothing is downloaded), and prepared folders."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [
    "the",
    "model",
    "reads",
    "tokens",
    "and",
    "learns",
    "which",
    "token",
    "follows",
    "which;",
    "shards",
    "are",
    "memory",
    "mapped,",
    "batches",
    "are",
    "drawn",
    "per",
    "seed,",
    "ranks",
    "take",
    "their",
    "slice,",
    "héllo",
    "ünïcode",
    "日本語",
    "and",
    "digits",
    "0123",
]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_corpus(folder: Path, n_files: int = 24, words: int = 200, seed: int = 0) -> Path:
    """Text files in nested folders, one JSONL file (field "text"), and one binary file."""
    rng = random.Random(seed)
    for i in range(n_files):
        f = folder / f"part{i % 3}" / f"doc{i:03d}.txt"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("\n".join(sentence(rng, 12) for _ in range(words // 12)) + "\n")
    with open(folder / "notes.jsonl", "w") as fh:
        for _ in range(20):
            fh.write(json.dumps({"text": sentence(rng, 30), "id": rng.random()}) + "\n")
    (folder / "image.bin").write_bytes(bytes(range(256)) * 8)
    return folder


def prepare_small(tmp: Path, tokenizer: str = "bpe", vocab_size: int | None = 300, **kw) -> Path:
    """A prepared folder of a fresh corpus under tmp (tmp/corpus, tmp/prepared-<tokenizer>)."""
    from llmscale.data.prepare import prepare

    corpus = tmp / "corpus"
    if not corpus.exists():
        write_corpus(corpus)
    out = tmp / f"prepared-{Path(tokenizer).stem}"
    if tokenizer == "bytes" and vocab_size == 300:
        vocab_size = None
    prepare([str(corpus)], out, tokenizer=tokenizer, vocab_size=vocab_size, progress=False, **kw)
    return out
