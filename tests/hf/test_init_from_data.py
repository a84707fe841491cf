"""`checkpoint.init_from hf:DIR` against the run's data: vocabulary and tokenizer agree, or one
line and exit 2 before anything runs (a folder vocabulary smaller than the data's was an index
error in the first step, a 46-line traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_harness import BASE, save_random_llama

from llmscale.cli import main
from llmscale.data.prepared import byte_tokenizer


def train_args(tmp_path: Path, folder: Path, *extra: str) -> list[str]:
    run = ["--job.run_dir", str(tmp_path / "run"), "--checkpoint.init_from", f"hf:{folder}"]
    return ["train", *BASE, *run, "--train.steps", "1", *extra]


def refused(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    capsys.readouterr()  # transformers' progress bars of save_pretrained
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "checkpoint.init_from: got" in err, err
    return err


def other_tokenizer(path: Path, n: int) -> Path:
    """A byte-level tokenizer of `n` ids whose specials are in another order than llmscale's."""
    tok = byte_tokenizer(n)
    text = tok.to_str().replace("<|bos|>", "<|tmp|>").replace("<|pad|>", "<|bos|>")
    path.write_text(text.replace("<|tmp|>", "<|pad|>"))
    return path


def test_a_vocabulary_smaller_than_the_datas_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = save_random_llama(tmp_path / "hf", vocab_size=200)
    err = refused(capsys, train_args(tmp_path, folder))  # a real run, not only --dry-run
    assert "vocab_size holds the 264 ids" in err and "says 200" in err
    assert not (tmp_path / "run").exists()


def test_without_tokenizer_files_the_vocab_size_must_equal_the_datas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = save_random_llama(tmp_path / "hf", vocab_size=320)
    err = refused(capsys, train_args(tmp_path, folder, "--dry-run"))
    assert "tokenizer.json, or whose vocab_size equals" in err and "says 320" in err
    # The same folder with the data's tokenizer: accepted (its extra rows are never in the data).
    (folder / "tokenizer.json").write_text(byte_tokenizer(264).to_str())
    assert main(train_args(tmp_path, folder, "--dry-run")) == 0
    capsys.readouterr()


def test_another_tokenizer_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = save_random_llama(tmp_path / "hf")
    other_tokenizer(folder / "tokenizer.json", 264)
    err = refused(capsys, train_args(tmp_path, folder, "--dry-run"))
    assert "is the data's tokenizer" in err and "2 tokens differ" in err
    # Same ids for every token (the byte-level file as llmscale writes it): accepted.
    (folder / "tokenizer.json").write_text(byte_tokenizer(264).to_str())
    assert main(train_args(tmp_path, folder, "--dry-run")) == 0


def test_a_prepared_datasets_tokenizer_must_be_the_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On --data.dataset (a 300-id BPE): the folder's vocabulary holds it, and its tokenizer.json
    has the same tokens and encodes as the shards (compared with meta.json's record applied)."""
    import shutil

    from tokenizers import Tokenizer, normalizers

    from llmscale.data.prepare import prepare

    def prepared(name: str, words: str) -> Path:
        texts = tmp_path / f"{name}-texts"
        texts.mkdir()
        for i in range(4):
            (texts / f"{i}.txt").write_text(f"{words} {i} <|endoftext|>\n" * 30)
        return prepare([str(texts)], tmp_path / name, "bpe", 300, val_fraction=0.0,
                       progress=False).out  # fmt: skip

    data = prepared("data", "The quick brown fox jumps over the lazy dog")
    other = prepared("other", "def f(x):\n\treturn x * 2  # a function")
    on_data = ["--data.dataset", str(data), "--dry-run"]
    capsys.readouterr()
    small = save_random_llama(tmp_path / "small", vocab_size=256)
    err = refused(capsys, train_args(tmp_path, small, *on_data))
    assert "vocab_size holds the 300 ids" in err and "says 256" in err

    folder = save_random_llama(tmp_path / "hf", vocab_size=320)
    shutil.copyfile(data / "tokenizer.json", folder / "tokenizer.json")
    capsys.readouterr()
    assert main(train_args(tmp_path, folder, *on_data)) == 0
    shutil.copyfile(other / "tokenizer.json", folder / "tokenizer.json")
    err = refused(capsys, train_args(tmp_path, folder, *on_data))
    assert "is the data's tokenizer" in err and "tokens differ" in err
    # Same tokens and ids, another normalizer: "The" becomes "the".
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    tok.normalizer = normalizers.Lowercase()
    tok.save(str(folder / "tokenizer.json"))
    err = refused(capsys, train_args(tmp_path, folder, *on_data))
    assert "it encodes text differently" in err


@pytest.mark.parametrize("what", ["no config.json", "another tokenizer"])
def test_a_bad_folder_is_refused_before_torch_is_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """The folder's config and tokenizer are checked torch-free (hf/check.py) ahead of the
    trainer's imports: the refusal took 7-12 s on a loaded 2-core machine, ~0.1 s now."""
    import subprocess
    import sys

    folder = save_random_llama(tmp_path / "hf")
    if what == "no config.json":
        (folder / "config.json").unlink()
    else:
        other_tokenizer(folder / "tokenizer.json", 264)
    probe = (
        "import sys\nfrom llmscale.cli import main\n"
        f"rc = main({train_args(tmp_path, folder)!r})\n"
        "print(rc, sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.stdout == "2 []\n", p.stdout + p.stderr
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "checkpoint.init_from: got" in err, err
    assert ("a folder with config.json" if what == "no config.json" else "2 tokens differ") in err
    assert not (tmp_path / "run").exists()


def test_i14_a_bpe_folder_on_byte_level_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """I14: a folder exported from a BPE run (its own tokenizer.json, a larger vocabulary) as
    init_from of a run on byte-level data trained on (loss 11.9), no check; now one line."""
    import json

    from llmscale.data.prepare import prepare

    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"{i}.txt").write_text(f"def f(x):\n\treturn x * {i}  # a function\n" * 30)
    bpe = prepare([str(texts)], tmp_path / "bpe", "bpe", 300, val_fraction=0.0, progress=False)
    folder = save_random_llama(tmp_path / "hf", vocab_size=320)  # holds the 264 byte ids
    (folder / "tokenizer.json").write_text((bpe.out / "tokenizer.json").read_text())
    theirs = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    err = refused(capsys, train_args(tmp_path, folder))  # a real run
    mine = byte_tokenizer(264).get_vocab(with_added_tokens=True)
    differ = sum(theirs.get(t) != i for t, i in mine.items()) + len(theirs.keys() - mine.keys())
    assert err == (
        f"llmscale train: error: checkpoint.init_from: got 'hf:{folder}'; allowed: a folder "
        f"whose tokenizer.json is the data's tokenizer (byte-level, data.path): {differ} tokens "
        "differ"
    )
    assert differ > 0 and not (tmp_path / "run").exists()
