"""generate and export of a run trained on a prepared dataset read its meta.json and
tokenizer.json as a run does (data/prepared.load_meta, verify_tokenizer) and check that the
tokenizer is the checkpoint's: each fault one line, exit 2, before anything is written
(inference/tokenizer.run_tokenizer). Each case is a row of docs/reliability.md."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from corpus_maker import prepare_small  # noqa: E402

from llmscale.cli import main  # noqa: E402

TINY = ["--train.steps", "1", "--data.seq_len", "16", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "2", "--metrics.progress", "false",
        "--checkpoint.enabled", "true"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(dataset, run): one checkpointed step on a small BPE prepared folder."""
    tmp = tmp_path_factory.mktemp("tok")
    ds = prepare_small(tmp, "bpe", val_fraction=0.2)
    run = tmp / "run"
    assert main(["train", "--data.dataset", str(ds), "--job.run_dir", str(run), *TINY]) == 0
    return ds, run


def damaged(trained: tuple[Path, Path], tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    """A copy of the run whose config.toml names a copy of its dataset, damaged by `damage`."""
    ds, run = trained
    ds2, run2 = tmp_path / "ds", tmp_path / "run"
    shutil.copytree(ds, ds2)
    shutil.copytree(run, run2)
    cfg = run2 / "config.toml"
    assert str(ds) in cfg.read_text()
    cfg.write_text(cfg.read_text().replace(str(ds), str(ds2)))
    damage(ds2)
    return run2


def edit_meta(key: str, value: object) -> Callable[[Path], None]:
    def edit(ds: Path) -> None:
        meta = json.loads((ds / "meta.json").read_text())
        meta[key] = value
        (ds / "meta.json").write_text(json.dumps(meta))

    return edit


def other_tokenizer(ds: Path) -> None:
    """The folder prepared again with another tokenizer (meta.json and tokenizer.json agree)."""
    shutil.rmtree(ds)
    out = prepare_small(ds.parent, "bytes", val_fraction=0.2)
    out.rename(ds)


def changed_tokenizer(ds: Path) -> None:
    p = ds / "tokenizer.json"
    p.write_text(p.read_text() + " ")


CASES = {
    "meta.json vocab_size 'abc' (DS meta_types)": (
        edit_meta("vocab_size", "abc"), "its meta.json is unreadable"),
    "meta.json not JSON (DS meta_garbage)": (
        lambda ds: (ds / "meta.json").write_text("this is not json {"), "meta.json is unreadable"),
    "meta.json eos_id outside the vocabulary": (edit_meta("eos_id", 10**6), "meta.json eos_id"),
    "tokenizer.json missing (DS tok_missing)": (
        lambda ds: (ds / "tokenizer.json").unlink(), "tokenizer.json (missing"),
    "tokenizer.json changed (DS tok_changed)": (changed_tokenizer, "tokenizer_sha256"),
    "the folder prepared again with another tokenizer": (
        other_tokenizer, "data from the tokenizer that checkpoint step-000001 was trained with"),
}  # fmt: skip


@pytest.mark.parametrize("command", ["generate", "export"])
@pytest.mark.parametrize("case", list(CASES))
def test_generate_and_export_check_the_runs_dataset(
    trained, tmp_path, capsys, fault_row, case, command
) -> None:
    damage, needle = CASES[case]
    run = damaged(trained, tmp_path, damage)
    out = tmp_path / "hf"
    args = (
        ["generate", str(run), "--prompt", "def ", "--max-new-tokens", "2"]
        if command == "generate"
        else ["export", str(run), "--format", "hf", "--out", str(out)]
    )
    capsys.readouterr()
    rc = main(args)
    stdout, err = capsys.readouterr()
    lines = err.strip().splitlines()
    fault_row(
        fault=f"{command} of a run whose dataset has {case}",
        command=f"llmscale {' '.join(args[:2])} ... ({case})",
        expected="exit 2, one line naming data.dataset and the fault; nothing written",
        observed=f"exit {rc}: {err.strip()}",
    )
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0] and "data.dataset" in lines[0], lines[0]
    assert stdout == "" and not out.exists()


def test_generate_of_the_intact_run_still_works(trained, capsys) -> None:
    _, run = trained
    rc = main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "3"])
    assert rc == 0
    assert capsys.readouterr().out.startswith("def ")
