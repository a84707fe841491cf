"""The last tracebacks of the review (../shared/reviews/usability-2026-12-04.md), by case id: each
is now one line on stderr and exit 2, found before any work. Each case is a row of
docs/reliability.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from corpus_maker import prepare_small, write_corpus  # noqa: E402

from llmscale.cli import main  # noqa: E402


def refused(capsys, argv: list[str], needle: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err
    return f"exit {rc}: {err}"


@pytest.mark.parametrize(("case", "value"), [("G06", "nan"), ("G12", "inf")])
def test_generate_temperature_not_finite(tmp_path, capsys, fault_row, case, value) -> None:
    # Checked before the run is read: any RUN_DIR shows it.
    seen = refused(capsys, ["generate", str(tmp_path), "--prompt", "def ", "--temperature", value],
                   f"--temperature: got {value}; allowed: a finite number >= 0")  # fmt: skip
    fault_row(
        fault=f"{case}: generate --temperature {value}",
        command=f'llmscale generate RUN --prompt "def " --temperature {value}',
        expected="one line naming --temperature, exit 2 (was: a RuntimeError from sampling, "
        "or uniform random bytes for inf)",
        observed=seen,
    )


def test_dp14_data_prepare_out_unwritable(tmp_path, capsys, fault_row) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_files=2)
    seen = refused(capsys, ["data", "prepare", "--input", str(corpus), "--out",
                            "/proc/llmscale_data"], "--out: got '/proc/llmscale_data'")  # fmt: skip
    fault_row(
        fault="DP14: data prepare --out in an unwritable place (/proc)",
        command="llmscale data prepare --input DIR --out /proc/llmscale_data",
        expected="one line naming --out, exit 2, before tokenizing (was: FileNotFoundError)",
        observed=seen,
    )


def test_e08_export_out_unwritable(tmp_path, capsys, fault_row) -> None:
    # Checked before the run is read: any RUN_DIR shows it.
    seen = refused(capsys, ["export", str(tmp_path), "--out", "/proc/llmscale_hf"],
                   "--out: got '/proc/llmscale_hf'; allowed: a folder that can be")  # fmt: skip
    fault_row(
        fault="E08: export --out in an unwritable place (/proc)",
        command="llmscale export RUN --format hf --out /proc/llmscale_hf",
        expected="one line naming --out, exit 2, before the weights are read (was: "
        "FileNotFoundError after)",
        observed=seen,
    )


def test_n_toml4_deeply_nested_inline_tables(tmp_path, capsys, fault_row) -> None:
    config = tmp_path / "deep.toml"
    config.write_text("a = " + "{b = " * 400 + "1" + "}" * 400 + "\n")
    # Python's default recursion limit: an earlier test in the session (torch's compiler) may
    # have raised it, and then tomllib reads 400 levels and the section check answers instead.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        seen = refused(capsys, ["train", "--config", str(config), "--job.run_dir",
                                str(tmp_path / "run")], "nests inline tables or arrays too deeply")  # fmt: skip
    finally:
        sys.setrecursionlimit(limit)
    assert not (tmp_path / "run").exists()
    fault_row(
        fault="N_TOML4: a config of 400 nested inline tables",
        command="llmscale train --config DEEP.toml",
        expected="one line naming --config, exit 2 (was: RecursionError in tomllib)",
        observed=seen,
    )


def test_ev08_eval_on_data_of_another_tokenizer(tmp_path, capsys, fault_row) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_files=6)
    bpe = prepare_small(tmp_path, "bpe", 300)
    run = tmp_path / "run"
    assert main(["train", "--data.path", str(corpus), "--data.glob", "**/*.txt",
                 "--job.run_dir", str(run), "--train.steps", "1", "--data.seq_len", "16",
                 "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
                 "--metrics.progress", "false"]) == 0  # fmt: skip
    capsys.readouterr()
    seen = refused(capsys, ["eval", str(run), "--data.dataset", str(bpe)],
                   "data from the tokenizer that checkpoint step-000001 was trained with")  # fmt: skip
    fault_row(
        fault="EV08: eval of a byte-level run on a BPE dataset (ids >= the run's vocabulary)",
        command="llmscale eval RUN --data.dataset BPE_DS",
        expected="one line naming data.dataset and both tokenizers' sha256, exit 2 (was: "
        "IndexError in the embedding)",
        observed=seen,
    )
    # The same data under checkpoint.init_from: the model keeps the run's 264-id vocabulary.
    seen = refused(capsys, ["train", "--checkpoint.init_from", str(run), "--data.dataset",
                            str(bpe), "--job.run_dir", str(tmp_path / "run2"), "--train.steps",
                            "1", "--data.seq_len", "16", "--metrics.progress", "false"],
                   "data whose ids fit the model's vocabulary of 264 (this tokenizer has 300 ids")  # fmt: skip
    fault_row(
        fault="train --checkpoint.init_from a byte-level run on a BPE dataset of 300 ids",
        command="llmscale train --checkpoint.init_from RUN --data.dataset BPE_DS",
        expected="one line naming data.dataset and both vocabularies, exit 2 (was: IndexError "
        "in the embedding)",
        observed=seen,
    )
