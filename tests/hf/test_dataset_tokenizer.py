"""A prepared folder's tokenizer, however it is loaded, encodes a document as the shards hold it.

Documents are data: special-token text in one ("<|endoftext|>", "<s>") is encoded as text.
tokenizers does not save that setting in tokenizer.json, so `Tokenizer.from_file` alone turns
such text into the special id; the folder records it in meta.json (encode_special_tokens) and
tokenizer_config.json (split_special_tokens, read by transformers), and the export carries it.
Each way of loading is checked against the shards' ids, for the bytes, bpe and a Llama-style
file tokenizer (whose template adds BOS: a document is encoded without it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hf_harness import llama_style_tokenizer, run_config

from llmscale.cli import main
from llmscale.config import JobConfig
from llmscale.data import prepare as P
from llmscale.data.prepared import (
    dataset_tokenizer,
    document_ids,
    file_sha256,
    load_meta,
    padded_vocab_size,
    verify_dataset,
)
from llmscale.hf.convert import to_hf_state_dict
from llmscale.hf.folder import write_folder
from llmscale.inference.tokenizer import run_tokenizer
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model

DOCS = [
    "x = '<|endoftext|>'  # the end-of-document name, as text\n",
    "<s> opens, </s> closes; <pad> <unk> <|pad|> <|bos|> are names\n",
    "plain words and numbers 12345 with no special text at all\n",
    "<|endoftext|>",
]


def dataset_config(run_dir: Path, data: Path) -> JobConfig:
    """A run on the prepared folder `data`, its model's vocabulary the dataset's padded one (as
    training sets it: generate refuses a tokenizer larger than the model)."""
    cfg = run_config(run_dir)
    cfg.data.dataset = str(data)
    cfg.model = cfg.model.with_overrides(vocab_size=padded_vocab_size(load_meta(data).vocab_size))
    return cfg


def prepared(root: Path, tokenizer: str) -> Path:
    """DOCS (one file each, in order) prepared with `tokenizer`: bytes, bpe or a Llama file."""
    texts = root / "texts"
    texts.mkdir(parents=True)
    for i, d in enumerate(DOCS):
        (texts / f"{i}.txt").write_text(d)
    vocab: int | None = 300 if tokenizer == "bpe" else None
    if tokenizer == "llama":
        tokenizer = str(llama_style_tokenizer(DOCS * 20, root / "llama.json"))
    return P.prepare([str(texts)], root / "data", tokenizer, vocab, val_fraction=0.0,
                     progress=False).out  # fmt: skip


def shard_documents(data: Path) -> list[list[int]]:
    """The train shard cut after each EOS, EOS dropped: one id list per document."""
    meta = load_meta(data)
    ids = np.fromfile(data / "train-00000.bin", dtype=meta.dtype).tolist()
    docs, start = [], 0
    for i, t in enumerate(ids):
        if t == meta.eos_id:
            docs.append(ids[start:i])
            start = i + 1
    assert start == len(ids)
    return docs


def exported(data: Path, out: Path) -> Path:
    """An HF folder of a tiny random model on `data`, with generate's tokenizer files."""
    cfg = dataset_config(out.parent / "run", data)
    model = get_preset("tiny").with_overrides(
        vocab_size=padded_vocab_size(load_meta(data).vocab_size)
    )
    sd = to_hf_state_dict(model, build_model(model, seed=1).state_dict())
    return write_folder(out, model, sd, run_tokenizer(cfg).files)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe", "llama"])
def test_every_way_of_loading_encodes_as_the_shards(tokenizer: str, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    data = prepared(tmp_path, tokenizer)
    meta = verify_dataset(load_meta(data))
    assert meta.tokenizer_sha256 == file_sha256(data / "tokenizer.json")
    raw = json.loads((data / "meta.json").read_text())
    assert raw["encode_special_tokens"] is True
    assert json.loads((data / "tokenizer_config.json").read_text())["split_special_tokens"] is True
    # Cut at each EOS id: the EOS names inside DOCS are text in the shards, not document ends.
    shards = shard_documents(data)
    assert len(shards) == len(DOCS)

    # tokenizers alone cannot hold the setting: the file by itself gives the special ids.
    plain = Tokenizer.from_file(str(data / "tokenizer.json"))
    assert "encode_special_tokens" not in (data / "tokenizer.json").read_text()
    eos_name = plain.id_to_token(meta.eos_id)
    assert plain.encode(eos_name, add_special_tokens=False).ids == [meta.eos_id]
    differ = [
        plain.encode(t, add_special_tokens=False).ids != i
        for t, i in zip(DOCS, shards, strict=True)
    ]
    assert differ == [tokenizer != "llama", True, False, tokenizer != "llama"]

    plain.encode_special_tokens = raw["encode_special_tokens"]  # as meta.json records
    cfg = dataset_config(tmp_path / "run", data)
    generate = run_tokenizer(cfg)
    auto = AutoTokenizer.from_pretrained(data)
    fast = PreTrainedTokenizerFast.from_pretrained(data)
    out = exported(data, tmp_path / "hf")
    auto_out = AutoTokenizer.from_pretrained(out)
    fast_out = PreTrainedTokenizerFast.from_pretrained(out)
    for text, ids in zip(DOCS, shards, strict=True):
        assert document_ids(dataset_tokenizer(meta), [text])[0] == ids, text
        assert plain.encode(text, add_special_tokens=False).ids == ids, text
        assert generate.encode(text) == ids, text
        # The prepared folder keeps its file's template: a document is encoded without it.
        assert auto.encode(text, add_special_tokens=False) == ids, text
        assert fast.encode(text, add_special_tokens=False) == ids, text
        # The export drops the template: the default call is the document's encoding.
        assert auto_out(text)["input_ids"] == ids, text
        assert fast_out.encode(text) == ids, text


def test_readers_follow_what_meta_json_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder whose meta.json says special-token text was encoded as the special id (as
    another tool may have written it): generate's tokenizer and the export follow it."""
    from transformers import AutoTokenizer

    data = prepared(tmp_path, "bpe")
    raw = json.loads((data / "meta.json").read_text())
    eos = raw["eos_id"]
    raw["encode_special_tokens"] = False
    (data / "meta.json").write_text(json.dumps(raw))
    cfg = dataset_config(tmp_path / "run", data)
    assert eos in run_tokenizer(cfg).encode(DOCS[0])
    assert document_ids(dataset_tokenizer(load_meta(data)), [DOCS[3]])[0] == [eos]
    out = exported(data, tmp_path / "hf")
    assert json.loads((out / "tokenizer_config.json").read_text())["split_special_tokens"] is False
    assert AutoTokenizer.from_pretrained(out)(DOCS[3])["input_ids"] == [eos]

    raw["encode_special_tokens"] = "yes"
    (data / "meta.json").write_text(json.dumps(raw))
    args = ["train", "--data.dataset", str(data), "--job.run_dir", str(tmp_path / "r"), "--dry-run"]
    capsys.readouterr()  # prepare's own line
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "meta.json encode_special_tokens: got 'yes'" in err, err
