"""Bad input: one line naming the field and what is allowed, exit code 2, no traceback."""

import subprocess
import sys

import pytest

from llmscale.cli import main, split_overrides
from llmscale.config import load_config, to_toml

FAST = ["--data.max_files", "20", "--train.steps", "1", "--metrics.progress", "false"]


def _run(args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "llmscale", *args], capture_output=True, text=True, cwd=tmp_path
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "--train.stepz", "3"], "train.stepz"),
        (["train", "--train.steps", "abc"], "train.steps: got 'abc'; allowed: an integer"),
        (["train", "--train.steps", "-4"], "train.steps: got -4"),
        (["train", "--train.micro_batch_size", "0"], "train.micro_batch_size"),
        (
            ["train", "--train.global_batch_size", "12", "--train.micro_batch_size", "8"],
            "a multiple of micro_batch_size x dp",
        ),
        (
            ["train", "--precision.mode", "fp8"],
            "precision.mode: got 'fp8'; allowed: fp32 | bf16 | fp16",
        ),
        (["train", "--train.recompute", "some"], "none | full | selective | every_k"),
        (["train", "--model.name", "gpt5"], "model.name"),
        (["train", "--data.path", "/no/such/folder"], "data.path"),
        (["train", "--nosuch.key", "1"], "nosuch"),
        (["train", "--config", "missing.toml"], "--config: no such file"),
        (["train", "--train.steps"], "needs a value"),
        (["plot", "/no/such/run"], "run_dir"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path) -> None:
    r = _run(args, tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_config_file_that_does_not_parse(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    r = _run(["train", "--config", str(bad)], tmp_path)
    assert r.returncode == 2 and "not valid TOML" in r.stderr and "Traceback" not in r.stderr


def test_wrong_type_in_config_file(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\nsteps = "many"\n')
    r = _run(["train", "--config", str(bad)], tmp_path)
    assert r.returncode == 2 and "train.steps: got 'many'; allowed: an integer" in r.stderr


def test_overrides_split_and_typed() -> None:
    plain, over = split_overrides(
        ["train", "--config", "x.toml", "--train.steps", "7", "--optimizer.lr=1e-3", "--resume"]
    )
    assert plain == ["train", "--config", "x.toml", "--resume"]
    cfg = load_config(None, over)
    assert cfg.train.steps == 7 and cfg.optimizer.lr == 1e-3


def test_default_config_file_round_trips(tmp_path) -> None:
    cfg = load_config(
        "configs/default.toml"
        if __import__("pathlib").Path("configs/default.toml").exists()
        else None
    )
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg


def test_models_table_lists_every_preset(capsys) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "llama2-70b", "llama3-405b", "gpt3-175b", "68,976,648,192"):
        assert name in out


def test_help_explains_overrides(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    assert "--section.key" in capsys.readouterr().out


def test_train_and_plot_from_the_command_line(tmp_path) -> None:
    r = _run(["train", *FAST, "--job.run_dir", "r"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step     1" in r.stdout
    r = _run(["plot", "r"], tmp_path)
    assert r.returncode == 0 and (tmp_path / "r" / "loss.png").is_file()


def test_planner_commands_do_not_import_torch() -> None:
    """`llmscale hw/plan/schedule` answer in a fraction of a second: no torch import."""
    code = (
        "import sys\n"
        "from llmscale.cli import main\n"
        "for argv in (['hw'], ['models'], ['schedule', '--pp', '2', '--microbatches', '4'],\n"
        "             ['plan', '--model', 'llama2-7b', '--gpu', 'h100', '--gpus', '8', '--seq', '2048', '--global-batch', '64']):\n"
        "    assert main(argv) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
