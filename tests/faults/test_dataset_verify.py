"""Prepared datasets verified when a run opens them (data/prepared.verify_dataset), each case of
the review (../shared/reviews/usability-2026-12-04.md, DSnn) by its id: a damaged folder is one
line naming data.dataset (or the meta.json key) and exit 2, before any run folder is written; a
missing or empty validation split is a notice. Each case is a row of docs/reliability.md."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from corpus_maker import prepare_small  # noqa: E402

from llmscale.cli import main  # noqa: E402
from llmscale.config import load_config  # noqa: E402
from llmscale.data.prepared import SHARD_CACHE, apply_dataset, load_meta  # noqa: E402
from llmscale.data.shards import ShardStream  # noqa: E402
from llmscale.errors import ConfigError  # noqa: E402
from llmscale.paths import cache_dir  # noqa: E402

TINY = ["--train.steps", "1", "--data.seq_len", "16", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "2", "--metrics.progress", "false"]  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level prepared folder with a validation split (made once, copied per case)."""
    return prepare_small(tmp_path_factory.mktemp("ds"), "bytes", val_fraction=0.2)


def copy_of(prepared: Path, tmp_path: Path, name: str = "ds") -> Path:
    out = tmp_path / name
    shutil.copytree(prepared, out)
    return out


def edit_meta(ds: Path, edit) -> None:
    meta = json.loads((ds / "meta.json").read_text())
    edit(meta)
    (ds / "meta.json").write_text(json.dumps(meta))


def train_refused(capsys, tmp_path: Path, ds: Path, needle: str, *extra: str) -> str:
    """`llmscale train --data.dataset DS`: exit 2, one line holding `needle`, no run folder."""
    run = tmp_path / "run"
    rc = main(["train", "--data.dataset", str(ds), "--job.run_dir", str(run), *TINY, *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err
    assert not run.exists()
    return f"exit {rc}: {err}"


def test_ds08_missing_train_shard(prepared, tmp_path, capsys, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    (ds / "train-00000.bin").unlink()
    seen = train_refused(capsys, tmp_path, ds, "train shard train-00000.bin is missing")
    fault_row(
        fault="DS08: a train shard meta.json lists is missing",
        command="rm DS/train-00000.bin; llmscale train --data.dataset DS",
        expected="one line naming data.dataset and the missing shard, exit 2",
        observed=seen,
    )


def test_ds09_shard_of_an_odd_size(prepared, tmp_path, capsys, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    with open(ds / "train-00000.bin", "r+b") as f:
        f.truncate(1001)
    seen = train_refused(capsys, tmp_path, ds, "holds 1,001 bytes, not a multiple of 2")
    fault_row(
        fault="DS09: a shard truncated to an odd size (not whole uint16 ids)",
        command="truncate -s 1001 DS/train-00000.bin; llmscale train --data.dataset DS",
        expected="one line naming the shard and its size, exit 2",
        observed=seen,
    )


def test_ds11_token_count_not_meta_json(prepared, tmp_path, capsys, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    real = json.loads((ds / "meta.json").read_text())["splits"]["train"]["tokens"]
    assert (ds / "train-00000.bin").stat().st_size == 2 * real
    edit_meta(ds, lambda m: m["splits"]["train"].update(tokens=10**9))
    seen = train_refused(capsys, tmp_path, ds, f"1,000,000,000 train tokens meta.json states "
                         f"(they hold {real:,}")  # fmt: skip
    fault_row(
        fault="DS11: meta.json claims 10^9 train tokens, the shards hold fewer",
        command="edit DS/meta.json splits.train.tokens; llmscale train --data.dataset DS",
        expected="one line with both counts, exit 2",
        observed=seen,
    )


def test_ds12_meta_vocab_below_the_special_ids(prepared, tmp_path, capsys, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    edit_meta(ds, lambda m: m.update(vocab_size=10))
    seen = train_refused(capsys, tmp_path, ds, "meta.json eos_id: got 257; allowed: an id in")
    fault_row(
        fault="DS12: meta.json vocab_size 10, below its own eos_id",
        command="edit DS/meta.json vocab_size; llmscale train --data.dataset DS",
        expected="one line naming meta.json eos_id and the vocabulary, exit 2, no run folder",
        observed=seen,
    )


def test_ds13_missing_tokenizer(prepared, tmp_path, capsys, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    (ds / "tokenizer.json").unlink()
    seen = train_refused(capsys, tmp_path, ds, "with its tokenizer.json (missing")
    fault_row(
        fault="DS13: tokenizer.json missing from the prepared folder",
        command="rm DS/tokenizer.json; llmscale train --data.dataset DS",
        expected="one line naming tokenizer.json, exit 2 (was: trains, export refuses later)",
        observed=seen,
    )


def test_ds14_tokenizer_changed(prepared, tmp_path, capsys, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    with open(ds / "tokenizer.json", "a") as f:
        f.write(" ")
    want = json.loads((ds / "meta.json").read_text())["tokenizer_sha256"][:12]
    seen = train_refused(capsys, tmp_path, ds, f"meta.json's tokenizer_sha256 ({want}...")
    fault_row(
        fault="DS14: tokenizer.json edited after the data was tokenized (sha256 differs)",
        command="edit DS/tokenizer.json; llmscale train --data.dataset DS",
        expected="one line with both sha256 prefixes, exit 2",
        observed=seen,
    )


def test_ds16_data_path_next_to_a_dataset(prepared, tmp_path, capsys, fault_row) -> None:
    seen = train_refused(capsys, tmp_path, prepared, "data.path: got", "--data.path",
                         str(tmp_path))  # fmt: skip
    fault_row(
        fault="DS16: --data.path given next to --data.dataset (was silently ignored)",
        command="llmscale train --data.dataset DS --data.path DIR",
        expected="one line naming data.path, exit 2",
        observed=seen,
    )


def test_ds22_vocab_size_next_to_a_dataset(prepared, tmp_path, capsys, fault_row) -> None:
    seen = train_refused(capsys, tmp_path, prepared, "model.vocab_size: got 300; allowed: unset "
                         "(or 320)", "--model.vocab_size", "300")  # fmt: skip
    # The value the dataset sets anyway is no contradiction: a saved config.toml holds it.
    cfg = load_config(None, ["--data.dataset", str(prepared), "--model.vocab_size", "320"])
    assert apply_dataset(cfg, {"model.vocab_size"}) is not None and cfg.model.vocab_size == 320
    fault_row(
        fault="DS22: --model.vocab_size 300 next to a dataset whose tokenizer sets 264 (padded "
        "320); was silently replaced",
        command="llmscale train --data.dataset DS --model.vocab_size 300",
        expected="one line naming model.vocab_size and the dataset's padded 320, exit 2",
        observed=seen,
    )


def test_raw_data_keys_next_to_a_dataset_are_named(prepared, tmp_path, capsys, fault_row) -> None:
    """data.glob / max_files / val_fraction choose data.path's raw files: next to a prepared
    dataset they are not read, and the run says so with its data notices, before step 1 (was
    silently ignored); a run without them says nothing of the kind."""
    from llmscale.train.data import unread_raw_data_keys

    cfg = load_config(None, ["--data.dataset", str(prepared), "--data.max_files", "40",
                             "--data.glob", "*.py"])  # fmt: skip
    (line,) = unread_raw_data_keys(cfg)
    assert line.startswith("data.glob, data.max_files choose data.path's raw files")
    assert unread_raw_data_keys(load_config(None, ["--data.dataset", str(prepared)])) == []
    run = tmp_path / "run"
    rc = main(["train", "--data.dataset", str(prepared), "--job.run_dir", str(run), *TINY,
               "--data.max_files", "40"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "data.max_files choose data.path's raw files" in out
    fault_row(
        fault="--data.max_files / --data.glob next to --data.dataset (was silently ignored)",
        command="llmscale train --data.dataset DS --data.max_files 40",
        expected="a notice with the run's data line, before step 1; the run goes on",
        observed=line,
    )


def test_ds18_missing_validation_shard_is_a_notice(prepared, tmp_path, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    assert json.loads((ds / "meta.json").read_text())["splits"]["val"]["tokens"] > 0
    (ds / "val-00000.bin").unlink()
    cfg = load_config(None, ["--data.dataset", str(ds)])
    meta = apply_dataset(cfg)
    assert meta is not None and "val" not in meta.splits and "train" in meta.splits
    assert (
        len(meta.notices) == 1 and "validation shard val-00000.bin is missing" in (meta.notices[0])
    )
    fault_row(
        fault="DS18: the validation shard is missing",
        command="rm DS/val-00000.bin; llmscale train --data.dataset DS",
        expected="a notice before step 1, training without validation (was a traceback)",
        observed=meta.notices[0],
    )


def test_ds23_zero_validation_tokens_warn(tmp_path, capsys, fault_row) -> None:
    """The review's own fixture: the stdlib json package (5 documents) prepared with the default
    --val-fraction 0.05, where every document's name hashes into train."""
    corpus = tmp_path / "my_texts"
    shutil.copytree(
        Path(json.__file__).parent, corpus, ignore=shutil.ignore_patterns("__pycache__")
    )
    ds = tmp_path / "mine"
    rc = main(["data", "prepare", "--input", str(corpus), "--tokenizer", "bpe", "--vocab-size",
               "8192", "--out", str(ds)])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    splits = json.loads((ds / "meta.json").read_text())["splits"]
    assert (splits["train"]["documents"], splits["val"]["documents"], splits["val"]["tokens"]) == (
        5, 0, 0,
    )  # fmt: skip
    said = [line for line in err.splitlines() if "fell into the validation split" in line]
    assert said == [
        "llmscale data: note: no document of the 5 fell into the validation split "
        f"(--val-fraction 0.05, decided per document): training on {ds} reports no validation "
        "loss; a larger --val-fraction or more documents gives one"
    ], err
    run = tmp_path / "run"
    rc = main(["train", "--data.dataset", str(ds), "--job.run_dir", str(run), *TINY])
    out, err = capsys.readouterr()
    assert rc == 0, err
    notice = [line for line in (out + err).splitlines() if "validation split holds 0" in line]
    assert len(notice) == 1, out + err
    assert "validation loss" not in out  # nothing evaluated, nothing pretended
    fault_row(
        fault="DS23: a prepared folder with 0 validation tokens (5 documents, --val-fraction "
        "0.05: all hashed into train)",
        command="llmscale data prepare --input JSON_PKG --tokenizer bpe --vocab-size 8192 --out "
        "DS; llmscale train --data.dataset DS",
        expected="a notice from data prepare and from train: no validation loss; trains",
        observed=f"prepare: {said[0].split('note: ')[1][:60]}...; train exit {rc}: "
        f"{notice[0].strip()}",
    )


@pytest.mark.parametrize(
    ("case", "shard"),
    [("DS20", "../../../../etc/passwd"), ("DS20b", "/usr/lib/x86_64-linux-gnu/libc.so.6")],
)
def test_ds20_shard_path_outside_the_folder(
    prepared, tmp_path, capsys, fault_row, case, shard
) -> None:
    ds = copy_of(prepared, tmp_path)
    edit_meta(ds, lambda m: m["splits"]["train"].update(shards=[shard]))
    seen = train_refused(capsys, tmp_path, ds, f"meta.json splits.train.shards: got '{shard}'")
    fault_row(
        fault=f"{case}: a shard path in meta.json outside the folder ({shard})",
        command="edit DS/meta.json splits.train.shards; llmscale train --data.dataset DS",
        expected="one line naming the path, exit 2, nothing read from it, no run folder",
        observed=seen,
    )


def test_ds20c_a_link_leading_out_of_the_folder(prepared, tmp_path, capsys, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    outside = tmp_path / "elsewhere.bin"
    (ds / "train-00000.bin").rename(outside)
    (ds / "train-00000.bin").symlink_to(outside)
    seen = train_refused(capsys, tmp_path, ds, "train-00000.bin'; allowed: a file inside")
    fault_row(
        fault="DS20c: a shard that is a symbolic link out of the folder",
        command="ln -s ELSEWHERE DS/train-00000.bin; llmscale train --data.dataset DS",
        expected="one line naming the shard, exit 2",
        observed=seen,
    )


def put_id(shard: Path, value: int, at: int = 100) -> None:
    """Write one uint16 id into a shard, keeping its size and modification time."""
    st = shard.stat()
    ids = np.memmap(shard, dtype="<u2", mode="r+")
    ids[at] = value
    ids.flush()
    del ids
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_ids_at_or_above_the_vocabulary(prepared, tmp_path, capsys, fault_row) -> None:
    """Fault G: ids in the padded vocabulary (264..319 of 320) logged a loss of 6.6e35."""
    ds = copy_of(prepared, tmp_path)
    put_id(ds / "train-00000.bin", 300)
    os.utime(ds / "train-00000.bin")  # a new mtime: not a cached shard
    seen = train_refused(capsys, tmp_path, ds, "train-00000.bin holds id 300")
    assert "vocab_size 264" in seen
    fault_row(
        fault="G: a token id (300) in the padded vocabulary, >= the tokenizer's 264",
        command="write id 300 into DS/train-00000.bin; llmscale train --data.dataset DS",
        expected="one line naming the shard, the id and the vocabulary, exit 2 "
        "(was: loss 6.6e35, no warning)",
        observed=seen,
    )


def test_the_id_check_is_cached_by_the_shards_sha256(prepared, tmp_path, fault_row) -> None:
    """A second open of an unchanged shard reads nothing (one stat: the cache gains nothing);
    a shard rewritten in place with its size and mtime kept (ctime moves) is read again, its
    sha256 compared with meta.json's; a copy elsewhere finds its largest id by its sha256."""
    ds = copy_of(prepared, tmp_path)
    cache = cache_dir() / SHARD_CACHE
    cfg = load_config(None, ["--data.dataset", str(ds)])
    apply_dataset(cfg)
    first = json.loads(cache.read_text())
    shas = [load_meta(ds).splits[s].shard_sha256[0] for s in ("train", "val")]
    mine = {k: v for k, v in first["fingerprints"].items() if k.startswith(str(ds.resolve()))}
    assert sorted(mine.values()) == sorted(shas)  # train and val shards, their prepared sha256
    assert all(0 < first["max_ids"][f"{sha}|uint16"] < 264 for sha in shas)
    apply_dataset(cfg)
    assert json.loads(cache.read_text()) == first  # unchanged: nothing read, nothing added
    twin = copy_of(prepared, tmp_path, "twin")
    apply_dataset(load_config(None, ["--data.dataset", str(twin)]))
    assert len(json.loads(cache.read_text())["max_ids"]) == len(first["max_ids"])  # by sha256
    put_id(ds / "train-00000.bin", 263 + 1000)  # size and mtime kept
    with pytest.raises(ConfigError, match="holds id 1,263"):
        apply_dataset(cfg)
    put_id(ds / "train-00000.bin", 7, at=200)  # ids below the vocabulary, other bytes
    put_id(ds / "train-00000.bin", int(np.memmap(twin / "train-00000.bin", "<u2")[100]))
    with pytest.raises(ConfigError, match="train-00000.bin's sha256 is .* meta.json records") as e:
        apply_dataset(cfg)
    fault_row(
        fault="a shard rewritten in place, size and mtime kept (ids below the vocabulary)",
        command="rewrite 2 bytes of DS/train-00000.bin, touch -d its old mtime; "
        "llmscale train --data.dataset DS",
        expected="read again (not a cache hit); one line naming the shard's changed sha256",
        observed=str(e.value),
    )


def test_shard_truncated_while_training(prepared, tmp_path, fault_row) -> None:
    """Fault G: a shard cut short under the memory map was a silent SIGBUS. Each shard is stat'ed
    before its rows are read: the run stops with one line. Not caught: a cut between that stat
    and the read (microseconds), which still ends in SIGBUS."""
    ds = copy_of(prepared, tmp_path)
    meta = load_meta(ds)
    stream = ShardStream.from_meta(meta, "train", 16, seed=0, dp_size=1)
    first = stream.next_batch(4)
    assert first.shape == (4, 17)
    with open(ds / "train-00000.bin", "r+b") as f:
        f.truncate(64)
    with pytest.raises(ConfigError, match="shrank from") as e:
        for _ in range(4):
            stream.next_batch(4)
    fault_row(
        fault="G: a shard truncated (to 64 bytes) while a run reads it",
        command="truncate -s 64 DS/train-00000.bin during llmscale train --data.dataset DS",
        expected="one line naming the shard and both sizes, exit 2; not a silent SIGBUS",
        observed=str(e.value),
    )


def test_ds19_negative_meta_vocab_is_named_as_such(prepared, tmp_path, capsys, fault_row) -> None:
    ds = copy_of(prepared, tmp_path)
    edit_meta(ds, lambda m: m.update(vocab_size=-5))
    seen = train_refused(capsys, tmp_path, ds, "data.dataset meta.json vocab_size: got -5; "
                         "allowed: >= 1")  # fmt: skip
    fault_row(
        fault="DS19: meta.json vocab_size -5",
        command="edit DS/meta.json vocab_size; llmscale train --data.dataset DS",
        expected="one line naming meta.json vocab_size and -5, exit 2 (was: model.vocab_size: "
        "got 0, the wrong field and value)",
        observed=seen,
    )
