"""Bad data inputs: each is one line on stderr and exit code 2, never a traceback, and leaves
no half-written folder."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from corpus_maker import prepare_small, write_corpus  # noqa: E402

from llmscale.cli import main  # noqa: E402


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    return rc, err


def _observed(rc: int, err: str) -> str:
    return f"exit {rc}: {err}"


def _one_line(rc: int, err: str) -> None:
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_empty_corpus(tmp_path, capsys, fault_row) -> None:
    corpus = tmp_path / "empty"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "sub" / "a.txt").write_text("")
    (corpus / "b.bin").write_bytes(b"\0\1\2")
    out = tmp_path / "out"
    rc, err = _run(capsys, "data", "prepare", "--input", str(corpus), "--out", str(out))
    _one_line(rc, err)
    assert err.startswith("llmscale data: error: --input:") and "skipped 1 binary" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    fault_row(
        fault="empty corpus (an empty text file and a binary one)",
        command="llmscale data prepare --input EMPTY_DIR --out DIR",
        expected="one line naming --input, exit 2, no DIR",
        observed=_observed(rc, err),
    )


def test_vocabulary_too_small_for_the_special_tokens(tmp_path, capsys, fault_row) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_files=2)
    for tok, n in (("bpe", 257), ("bytes", 258)):
        out = tmp_path / f"out-{tok}"
        rc, err = _run(capsys, "data", "prepare", "--input", str(corpus), "--tokenizer", tok,
                       "--vocab-size", str(n), "--out", str(out))  # fmt: skip
        _one_line(rc, err)
        assert f"--vocab-size: got {n}; allowed: >= " in err and not out.exists()
        fault_row(
            fault=f"--tokenizer {tok} --vocab-size {n}: no room for the special tokens",
            command=f"llmscale data prepare --input DIR --tokenizer {tok} --vocab-size {n} --out D",
            expected="one line naming --vocab-size and the least size, exit 2",
            observed=_observed(rc, err),
        )


def test_a_tokenizer_file_that_is_not_one(tmp_path, capsys, fault_row) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_files=2)
    cases = {
        "not JSON": "this is not a tokenizer\n",
        "JSON, not a tokenizer": '{"hello": "world"}\n',
    }
    for what, text in cases.items():
        bad = tmp_path / "tokenizer.json"
        bad.write_text(text)
        out = tmp_path / "out"
        rc, err = _run(capsys, "data", "prepare", "--input", str(corpus), "--tokenizer", str(bad),
                       "--out", str(out))  # fmt: skip
        _one_line(rc, err)
        assert "--tokenizer" in err and "tokenizers file" in err and not out.exists()
        fault_row(
            fault=f"--tokenizer FILE.json that is {what}",
            command="llmscale data prepare --input DIR --tokenizer FILE.json --out D",
            expected="one line naming --tokenizer, exit 2",
            observed=_observed(rc, err),
        )
    # A real tokenizer without an end-of-document token cannot separate documents.
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(bad))
    rc, err = _run(capsys, "data", "prepare", "--input", str(corpus), "--tokenizer", str(bad),
                   "--out", str(tmp_path / "out"))  # fmt: skip
    _one_line(rc, err)
    assert "end-of-document token" in err
    fault_row(
        fault="--tokenizer FILE.json without an end-of-document token",
        command="llmscale data prepare --input DIR --tokenizer FILE.json --out D",
        expected="one line naming --tokenizer and the EOS names looked for, exit 2",
        observed=_observed(rc, err),
    )


def test_not_a_prepared_folder(tmp_path, capsys, fault_row) -> None:
    rc, err = _run(capsys, "train", "--data.dataset", str(tmp_path))
    _one_line(rc, err)
    assert err.startswith("llmscale train: error: data.dataset:")
    fault_row(
        fault="--data.dataset a folder without meta.json",
        command="llmscale train --data.dataset DIR",
        expected="one line naming data.dataset, exit 2",
        observed=_observed(rc, err),
    )


def test_resuming_on_data_from_another_tokenizer(tmp_path, capsys, fault_row) -> None:
    a = prepare_small(tmp_path / "a", "bpe", 300)
    b = prepare_small(tmp_path / "b", "bpe", 290)  # another tokenizer, same padded vocabulary
    run = tmp_path / "run"
    common = ["--job.run_dir", str(run), "--data.seq_len", "16", "--train.micro_batch_size", "2",
              "--train.global_batch_size", "2", "--metrics.progress", "false",
              "--train.eval_sequences", "4"]  # fmt: skip
    assert main(["train", "--data.dataset", str(a), "--train.steps", "2", *common]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    rc, err = _run(capsys, "train", "--resume", "--data.dataset", str(b), "--train.steps", "4",
                   *common)  # fmt: skip
    _one_line(rc, err)
    assert err.startswith("llmscale train: error: data.dataset:") and "tokenizer" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    fault_row(
        fault="resume a run on a prepared folder from another tokenizer",
        command="llmscale train --resume --data.dataset OTHER_DIR",
        expected="one line naming data.dataset and both tokenizers' sha256, exit 2; "
        "checkpoints untouched",
        observed=_observed(rc, err),
    )


def test_dp28_the_same_input_twice(tmp_path, capsys, fault_row) -> None:
    """DP28: a folder given twice (or a file inside a folder also given) tokenized its
    documents twice, with no word; now one line naming the file and both inputs."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    one = sorted(p for p in corpus.rglob("*") if p.is_file())[0]
    out = tmp_path / "out"
    for inputs in ([corpus, corpus], [corpus, one]):
        rc, err = _run(capsys, "data", "prepare", "--input", *map(str, inputs), "--out", str(out))
        _one_line(rc, err)
        assert "each file once" in err and f"also read through --input {corpus}" in err, err
        assert not out.exists()
    rc, _ = _run(capsys, "data", "prepare", "--input", str(corpus), "--out", str(out))
    assert rc == 0
    fault_row(
        fault="DP28: data prepare --input DIR DIR (the same folder twice)",
        command="llmscale data prepare --input DIR DIR --out OUT",
        expected="exit 2, one line naming the file read twice; nothing written",
        observed=_observed(2, err),
    )
