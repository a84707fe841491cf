"""`llmscale data prepare`: the tokenizer, the shards and meta.json, on corpora the tests write."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from corpus_maker import prepare_small, write_corpus

from llmscale.cli import main
from llmscale.data import prepare as P
from llmscale.data.prepared import (
    byte_tokenizer,
    dataset_tokenizer,
    document_ids,
    load_meta,
    padded_vocab_size,
    token_dtype,
)
from llmscale.data.tokenizer import ByteTokenizer


def _docs(meta, split: str) -> list[np.ndarray]:
    ids = np.concatenate(
        [
            np.fromfile(p, dtype=np.dtype(meta.dtype).newbyteorder("<"))
            for p in meta.shard_paths(split)
        ]
    )
    cuts = np.flatnonzero(ids == meta.eos_id)
    assert len(ids) and cuts[-1] == len(ids) - 1  # every document ends with EOS
    return np.split(ids, cuts[:-1] + 1)


def _expected_documents(corpus: Path) -> dict[str, str]:
    """Every document's text by its name, as prepare names them (binary file left out)."""
    out = {}
    for f in sorted(corpus.rglob("*")):  # the order prepare reads them in
        name = f"{corpus.name}/{f.relative_to(corpus).as_posix()}"
        if f.suffix == ".txt":
            out[name] = f.read_text()
        elif f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text().splitlines(), start=1):
                out[f"{name}:{i}"] = json.loads(line)["text"]
    return out


def test_bytes_tokenizer_encodes_exactly_like_the_byte_tokenizer() -> None:
    tok = byte_tokenizer()
    text = "def f(x):\n\treturn 'héllo' <|endoftext|> + x  # 日本 \r\n"
    assert tok.encode(text).ids == ByteTokenizer().encode(text).tolist()
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() == ByteTokenizer().vocab_size == 264
    ids = [tok.token_to_id(t) for t in ("<|bos|>", "<|endoftext|>", "<|pad|>")]
    b = ByteTokenizer()
    assert ids == [b.bos_id, b.eos_id, b.pad_id]


def test_prepare_bytes_writes_every_document_once_split_by_document(tmp_path) -> None:
    out = prepare_small(tmp_path, "bytes", val_fraction=0.3)
    meta = load_meta(out)
    assert (meta.vocab_size, meta.dtype, meta.eos_id, meta.pad_id) == (264, "uint16", 257, 258)
    assert (
        meta.tokenizer_sha256 == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    )
    expected = _expected_documents(tmp_path / "corpus")
    raw = json.loads((out / "meta.json").read_text())
    assert raw["skipped_binary_files"] == 1
    assert {Path(s["path"]).name for s in meta.sources} == {
        Path(n.split(":")[0]).name for n in expected
    }
    for s in meta.sources:
        assert s["sha256"] == hashlib.sha256(Path(s["path"]).read_bytes()).hexdigest()
    b = ByteTokenizer()
    for split in ("train", "val"):
        docs = _docs(meta, split)
        names = [n for n in expected if P.is_val_document(n, 0.3) == (split == "val")]
        assert len(docs) == len(names) == meta.splits[split].documents > 0
        assert sum(len(d) for d in docs) == meta.splits[split].tokens
        for d, name in zip(docs, names, strict=True):
            assert d.tolist() == b.encode(expected[name], eos=True).tolist(), name


def test_prepare_bpe_round_trips_and_fits_the_vocabulary(tmp_path) -> None:
    from tokenizers import Tokenizer

    out = prepare_small(tmp_path, "bpe", vocab_size=300, val_fraction=0.0)
    meta = load_meta(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert meta.vocab_size == tok.get_vocab_size() == 300
    assert (
        tok.id_to_token(meta.eos_id) == "<|endoftext|>"
        and tok.id_to_token(meta.pad_id) == "<|pad|>"
    )
    expected = list(_expected_documents(tmp_path / "corpus").values())
    docs = _docs(meta, "train")
    assert meta.splits["val"].tokens == 0 and len(docs) == len(expected)
    assert [tok.decode(d[:-1].tolist()) for d in docs] == expected
    assert max(int(d.max()) for d in docs) < 300
    # BPE compresses: fewer tokens than bytes.
    assert meta.splits["train"].tokens < sum(len(t.encode()) for t in expected) * 0.8
    # The same tokenizer as a file: the same ids, the same sha256.
    again = prepare_small(tmp_path / "again", str(out / "tokenizer.json"), vocab_size=None,
                          val_fraction=0.0)  # fmt: skip
    m2 = load_meta(again)
    assert m2.tokenizer_sha256 == meta.tokenizer_sha256
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    assert (again / "train-00000.bin").read_bytes() != b""


def test_file_tokenizer_gives_the_same_shards(tmp_path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    a = P.prepare([str(corpus)], tmp_path / "a", "bpe", 280, val_fraction=0.2, progress=False)
    b = P.prepare([str(corpus)], tmp_path / "b", str(a.out / "tokenizer.json"), val_fraction=0.2,
                  progress=False)  # fmt: skip
    for name in ("train-00000.bin", "val-00000.bin"):
        assert (a.out / name).read_bytes() == (b.out / name).read_bytes()
    # A file is kept byte for byte: its sha256 is the user's file's (here a compact rewrite).
    from tokenizers import Tokenizer

    compact = tmp_path / "compact.json"
    compact.write_text(Tokenizer.from_file(str(a.out / "tokenizer.json")).to_str())
    c = P.prepare([str(corpus)], tmp_path / "c", str(compact), val_fraction=0.2, progress=False)
    assert c.meta["tokenizer_sha256"] == hashlib.sha256(compact.read_bytes()).hexdigest()
    assert c.meta["tokenizer_sha256"] != a.meta["tokenizer_sha256"]
    assert (c.out / "train-00000.bin").read_bytes() == (a.out / "train-00000.bin").read_bytes()


def test_shards_are_capped_and_concatenate_to_the_same_tokens(tmp_path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    one = P.prepare([str(corpus)], tmp_path / "one", "bytes", val_fraction=0.0, progress=False)
    many = P.prepare([str(corpus)], tmp_path / "many", "bytes", val_fraction=0.0,
                     shard_tokens=1000, progress=False)  # fmt: skip
    shards = many.meta["splits"]["train"]["shards"]
    assert len(shards) > 5 and shards[0] == "train-00000.bin" and shards[1] == "train-00001.bin"
    sizes = [(many.out / s).stat().st_size for s in shards]
    assert all(s == 2000 for s in sizes[:-1]) and 0 < sizes[-1] <= 2000
    joined = b"".join((many.out / s).read_bytes() for s in shards)
    assert joined == (one.out / "train-00000.bin").read_bytes()


def test_glob_and_jsonl_field(tmp_path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    (corpus / "other.jsonl").write_text('{"body": "alpha beta"}\n{"body": "gamma"}\n')
    r = P.prepare([str(corpus / "other.jsonl")], tmp_path / "j", "bytes", jsonl_field="body",
                  val_fraction=0.0, progress=False)  # fmt: skip
    ids = np.fromfile(r.out / "train-00000.bin", dtype="<u2")
    assert ids.tolist() == [*b"alpha beta", 257, *b"gamma", 257]
    r = P.prepare([str(corpus)], tmp_path / "g", "bytes", glob="part1/*.txt", val_fraction=0.0,
                  progress=False)  # fmt: skip
    assert r.meta["splits"]["train"]["documents"] == 8 and r.skipped_binary == 0


def test_a_huge_document_is_read_in_pieces(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(P, "PIECE_BYTES", 64)
    monkeypatch.setattr(P, "BATCH_BYTES", 200)
    text = (
        "".join(f"line {i} héllo 日本\n" for i in range(200))
        + "日本語é" * 50
        + " no newline: pieces cut inside characters"
    )
    (tmp_path / "big.txt").write_text(text)
    r = P.prepare([str(tmp_path / "big.txt")], tmp_path / "o", "bytes", val_fraction=0.0,
                  progress=False)  # fmt: skip
    ids = np.fromfile(r.out / "train-00000.bin", dtype="<u2")
    assert ids.tolist() == ByteTokenizer().encode(text, eos=True).tolist()


def test_an_interrupted_prepare_leaves_no_folder(tmp_path, monkeypatch) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    calls = {"n": 0}
    real = P.ShardWriter.write

    def failing(self, ids):  # the 3rd batch of ids: as if killed half-way
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real(self, ids)

    monkeypatch.setattr(P, "BATCH_BYTES", 2000)
    monkeypatch.setattr(P.ShardWriter, "write", failing)
    with pytest.raises(KeyboardInterrupt):
        P.prepare([str(corpus)], tmp_path / "out", "bytes", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_cli_prepare_prints_a_summary(tmp_path, capsys) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "ds"
    rc = main(["data", "prepare", "--input", str(corpus), "--tokenizer", "bpe", "--vocab-size",
               "290", "--val-fraction", "0.1", "--out", str(out)])  # fmt: skip
    assert rc == 0
    line = capsys.readouterr().out.strip()
    meta = load_meta(out)
    assert line.startswith(f"wrote {out}: {meta.splits['train'].tokens:,} train tokens")
    assert "1 binary skipped" in line and "vocabulary 290 (uint16)" in line


def test_vocab_padding_and_dtype() -> None:
    assert padded_vocab_size(300, 1) == 320 and padded_vocab_size(300, 2) == 384
    assert padded_vocab_size(320, 1) == 320 and padded_vocab_size(50257, 1) == 50304
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"


def test_a_huge_document_gets_the_ids_of_its_whole_text(tmp_path, monkeypatch) -> None:
    """BPE over a regex pre-tokenizer: pieces cut at line ends would split "\\n    " runs that
    the whole text keeps in one token; pieces cut where the pre-tokenizer splits do not."""
    import textwrap

    src = Path(textwrap.__file__).read_text()
    text = (src + "\n\n\n    <|endoftext|> text\n") * 3
    (tmp_path / "big.py").write_text(text)
    bpe = P.prepare([str(tmp_path / "big.py")], tmp_path / "tok", "bpe", vocab_size=400,
                    val_fraction=0.0, progress=False)  # fmt: skip
    whole = document_ids(dataset_tokenizer(load_meta(bpe.out)), [text])[0] + [bpe.meta["eos_id"]]
    monkeypatch.setattr(P, "PIECE_BYTES", 1000)  # ~200 pieces
    r = P.prepare([str(tmp_path / "big.py")], tmp_path / "o", str(bpe.out / "tokenizer.json"),
                  val_fraction=0.0, progress=False)  # fmt: skip
    ids = np.fromfile(r.out / "train-00000.bin", dtype=r.meta["dtype"]).tolist()
    assert len(ids) == len(whole) and ids == whole
