"""Bad input to export, generate, eval and checkpoint.init_from: one line, exit code 2.

Each case runs the command line in process and records what it printed (stderr's one line) and
returned. Runs are made here: one short checkpointed run, and run folders that hold only the
config.toml that `train` writes first (a run stopped before its first checkpoint).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from llmscale.bench.jobs import short_job
from llmscale.cli import main
from llmscale.config import load_config, to_toml
from llmscale.train.trainer import run_training

os.environ["HF_HUB_OFFLINE"] = "1"

BASE = short_job(train__micro_batch_size=4, train__global_batch_size=4, train__steps=1)


def config_only_run(folder: Path, *overrides: str) -> Path:
    """A run folder as train leaves it before its first checkpoint: config.toml alone."""
    cfg = load_config(None, [*BASE, "--job.run_dir", str(folder), *overrides])
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(cfg))
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("faults") / "run"
    run_training(
        load_config(None, [*BASE, "--job.run_dir", str(folder), "--checkpoint.enabled", "true"])
    )
    return folder


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], fault_row: Callable[..., None]):
    def check(fault: str, args: list[str], expect: str) -> str:
        code = main(args)
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        fault_row(
            fault=fault,
            command="llmscale " + " ".join(args),
            expected=f"exit 2, one line naming {expect}",
            observed=f"exit {code}: {err.strip()}",
        )
        assert code == 2, err
        assert len(lines) == 1 and "Traceback" not in err, err
        assert expect in lines[0], lines[0]
        assert out == ""
        return lines[0]

    return check


def test_export_of_a_run_with_no_checkpoint(cli, tmp_path: Path) -> None:
    folder = config_only_run(tmp_path / "run")
    line = cli(
        "export of a run with no checkpoint",
        ["export", str(folder), "--out", str(tmp_path / "hf")],
        "a run with a checkpoint",
    )
    assert str(folder) in line and not (tmp_path / "hf").exists()


def test_export_of_a_folder_that_is_no_run(cli, tmp_path: Path) -> None:
    cli(
        "export of a folder without config.toml",
        ["export", str(tmp_path), "--out", str(tmp_path / "hf")],
        "no config.toml",
    )


def test_unknown_export_format(cli, run: Path, tmp_path: Path) -> None:
    cli(
        "export --format gguf",
        ["export", str(run), "--format", "gguf", "--out", str(tmp_path / "o")],
        "--format",
    )


def test_export_step_without_a_checkpoint(cli, run: Path, tmp_path: Path) -> None:
    line = cli(
        "export --step of a step with no checkpoint",
        ["export", str(run), "--step", "7", "--out", str(tmp_path / "o")],
        "--step",
    )
    assert "allowed: 1" in line  # the steps there are


def test_export_onto_a_file(cli, run: Path, tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    cli("export --out naming a file", ["export", str(run), "--out", str(target)], "--out")


@pytest.mark.parametrize(
    ("what", "overrides", "field"),
    [
        ("GQA", ["--model.n_kv_heads", "2", "--model.n_heads", "4", "--model.dim", "64"],
         "model.n_kv_heads"),
        ("an untied head", ["--model.tie_embeddings", "false"], "model.tie_embeddings"),
        ("RMSNorm with learned positions", ["--model.norm", "rmsnorm"], "model"),
    ],
)  # fmt: skip
def test_gpt_style_model_gpt2_cannot_hold(
    cli, tmp_path: Path, what: str, overrides: list[str], field: str
) -> None:
    small = ["--model.name", "gpt2-124m", "--model.vocab_size", "264", "--model.n_layers", "2"]
    small += ["--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "4"]
    folder = config_only_run(tmp_path / "run", *small, "--model.max_seq_len", "64", *overrides)
    line = cli(
        f"export of a GPT-style model with {what} (not GPT-2's architecture)",
        ["export", str(folder), "--out", str(tmp_path / "hf")],
        field,
    )
    assert "export" in line


def test_init_from_a_missing_folder(cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    for value in (f"hf:{missing}", str(missing)):
        cli(
            "checkpoint.init_from names a folder that does not exist",
            ["train", *BASE, "--job.run_dir", str(tmp_path / "r"), "--checkpoint.init_from", value],
            "checkpoint.init_from",
        )


@pytest.mark.parametrize(
    ("what", "files", "expect"),
    [
        ("a GPT-2 config.json", {"config.json": json.dumps({"model_type": "gpt2"})}, "Llama"),
        ("no config.json", {}, "config.json"),
        ("a config.json that is not JSON", {"config.json": "{nope"}, "JSON"),
        (
            "a Llama config.json without weights",
            {"config.json": json.dumps({
                "model_type": "llama", "vocab_size": 264, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            })},
            "safetensors",
        ),
        (
            "weights that are not safetensors",
            {
                "config.json": json.dumps({
                    "model_type": "llama", "vocab_size": 264, "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                }),
                "model.safetensors": "not a tensor file",
            },
            "safetensors",
        ),
    ],
)  # fmt: skip
def test_init_from_a_folder_that_is_no_llama(
    cli, tmp_path: Path, what: str, files: dict[str, str], expect: str
) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    cli(
        f"checkpoint.init_from hf:DIR with {what}",
        ["train", *BASE, "--job.run_dir", str(tmp_path / "r"), "--checkpoint.init_from",
         f"hf:{folder}"],
        expect,
    )  # fmt: skip
    assert not (tmp_path / "r").exists()  # refused before the run wrote anything


def test_init_from_a_run_with_no_checkpoint(cli, tmp_path: Path) -> None:
    source = config_only_run(tmp_path / "source")
    cli(
        "checkpoint.init_from RUN_DIR with no checkpoint",
        ["train", *BASE, "--job.run_dir", str(tmp_path / "r"), "--checkpoint.init_from",
         str(source)],
        "checkpoint.init_from",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("what", "extra", "expect"),
    [
        ("an empty prompt", ["--prompt", ""], "--prompt"),
        ("a prompt longer than the model's context", ["--prompt", "x" * 200], "max_seq_len"),
        ("a negative temperature", ["--prompt", "a", "--temperature", "-1"], "--temperature"),
        ("a negative top-k", ["--prompt", "a", "--top-k", "-2"], "--top-k"),
        ("a negative token count", ["--prompt", "a", "--max-new-tokens", "-1"], "--max-new-tokens"),
    ],
)
def test_generate_bad_arguments(cli, run: Path, what: str, extra: list[str], expect: str) -> None:
    cli(f"generate with {what}", ["generate", str(run), *extra], expect)


def test_generate_and_eval_of_a_run_with_no_checkpoint(cli, tmp_path: Path) -> None:
    folder = config_only_run(tmp_path / "run")
    for args in (["generate", str(folder), "--prompt", "a"], ["eval", str(folder)]):
        cli(f"{args[0]} of a run with no checkpoint", args, "a run with a checkpoint")
