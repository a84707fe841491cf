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
        (
            ["train", "--precision.mode", "nvfp4"],
            "precision.mode: got 'nvfp4'; allowed: fp32 | bf16 | fp16 | fp8 (this runtime has "
            "no NVFP4 training",
        ),
        (
            ["train", "--dry-run", "--precision.mode", "nvfp4"],
            "precision.mode: got 'nvfp4'; allowed: fp32 | bf16 | fp16 | fp8 under --stack "
            "llmscale (nvfp4: --stack megatron-core)",
        ),
        (
            ["train", "--precision.mode", "fp8", "--precision.float8_recipe", "mxfp8"],
            "precision.float8_recipe: got 'mxfp8'; allowed: tensorwise | rowwise | "
            "rowwise_with_gw_hp (this runtime has no MXFP8 training",
        ),
        (
            ["train", "--dry-run", "--precision.mode", "fp8", "--precision.float8_recipe", "mxfp8"],
            "precision.float8_recipe: got 'mxfp8'; allowed: tensorwise | rowwise | "
            "rowwise_with_gw_hp under --stack llmscale (mxfp8: --stack megatron-core)",
        ),
        (
            ["train", "--train.recompute", "some"],
            "none | full | selective | selective_op | every_k",
        ),
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


def test_version(capsys) -> None:
    import tomllib
    from pathlib import Path

    import llmscale

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"llmscale {llmscale.__version__}\n"
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert tomllib.loads(pyproject.read_text())["project"]["version"] == llmscale.__version__


def test_program_name_once_in_errors(tmp_path) -> None:
    """`llmscale: error` at the top level, `llmscale train: error` in a command: never twice."""
    r = _run(["nosuchcommand"], tmp_path)
    assert r.stderr.startswith("llmscale: error: ") and "llmscale llmscale" not in r.stderr
    r = _run(["train", "--nosuch"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("llmscale train: error: "), r.stderr


def test_train_help_lists_every_key_with_default_and_choices(capsys) -> None:
    from llmscale.config_docs import config_keys

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for k in config_keys():
        assert f"--{k.key} " in out
    assert '--precision.mode fp32 | bf16 | fp16 | fp8 | nvfp4  (default "fp32")' in out
    assert (
        '--train.recompute none | full | selective | selective_op | every_k  (default "none")'
        in out
    )
    assert '--optimizer.offload none | optimizer | optimizer+params | lsp  (default "none")' in out
    assert "--parallel.zero_stage 0 | 1 | 2 | 3  (default 3)" in out
    assert "--train.steps int  (default 50)" in out
    assert "Optimizer steps to train." in out  # the field's docstring
    assert '--model.norm rmsnorm | layernorm  (default "rmsnorm")' in out


def test_bench_json_out_writes_rows(tmp_path, monkeypatch, capsys) -> None:
    """`--json-out FILE` writes the rows; `--json` is no longer a bench flag (it prints)."""
    import json

    from llmscale.bench import suites
    from llmscale.bench.report import Row, SuiteResult

    def fake(opts):
        return SuiteResult("memory", "Memory", [Row("memory", "fp32", "params", "B", 100, 100)])

    monkeypatch.setattr(suites, "get_suite", lambda name: fake)
    out, md = tmp_path / "r.json", tmp_path / "docs" / "results.md"
    argv = ["bench", "--what", "memory", "--json-out", str(out), "--markdown", str(md)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["memory"]["rows"][0]["ratio"] == 1.0
    page = md.read_text()
    assert page.startswith("# Measured vs predicted") and "llmscale bench --model small" in page
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["bench", "--json", str(out)])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("llmscale bench: error: ")


# ---- train --nproc-per-node: the launcher; bare torchrun: one rank speaks --------------------


def test_nproc_per_node_zero(tmp_path) -> None:
    r = _run(["train", "--nproc-per-node", "0", *FAST], tmp_path)
    assert r.returncode == 2 and "--nproc-per-node: got 0" in r.stderr


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_only_rank_0_prints_bad_input(rank, monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", rank)
    assert main(["train", "--train.steps", "-4"]) == 2
    err = capsys.readouterr().err
    if rank == "0":
        assert len(err.strip().splitlines()) == 1 and "train.steps: got -4" in err
    else:
        assert err == ""


@pytest.mark.parametrize("rank", ["0", "1", "2"])
def test_a_lost_peer_is_reported_by_the_rank_it_names(rank, monkeypatch, capsys) -> None:
    """Rank 0 lost: the lowest rank still alive (1) prints; every rank exits 4."""
    from llmscale.parallel.heartbeat import PeerLost
    from llmscale.train import trainer

    def lost(cfg):
        raise PeerLost("rank 0 of 3 stopped answering", [0], reporter_rank=1)

    monkeypatch.setattr(trainer, "run_training", lost)
    monkeypatch.setenv("RANK", rank)
    assert main(["train", *FAST]) == 4
    err = capsys.readouterr().err
    assert ("stopped answering" in err) == (rank == "1")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_peer_interrupted_stops_every_rank_quietly(rank, monkeypatch, capsys) -> None:
    """A peer stopped at once by a second Ctrl-C: this rank exits 130 and prints nothing."""
    from llmscale.parallel.heartbeat import PeerInterrupted
    from llmscale.train import trainer

    def interrupted(cfg):
        raise PeerInterrupted([2])

    monkeypatch.setattr(trainer, "run_training", interrupted)
    monkeypatch.setenv("RANK", rank)
    assert main(["train", *FAST]) == 130
    assert capsys.readouterr().err == ""


def test_worker_argv_drops_the_launcher_flags() -> None:
    from llmscale.train.launch import worker_argv

    argv = ["--nproc-per-node", "2", "--resume", "--max-restarts=1", "--train.steps", "3"]
    flags = ("--nproc-per-node", "--max-restarts")
    assert worker_argv(argv, flags) == ["--resume", "--train.steps", "3"]


def test_job_outcome_prefers_the_workers_own_codes() -> None:
    from llmscale.train.launch import WorkerExit, job_outcome

    # Rank 1 killed; rank 0 noticed and exited 4 (it printed the message).
    assert job_outcome({0: WorkerExit(4, 10), 1: WorkerExit(-9, 9)}) == (4, None)
    # Rank 1 killed; the agent stopped rank 0 (SIGTERM) before it could say so.
    code, msg = job_outcome({0: WorkerExit(-15, 9), 1: WorkerExit(-9, 9)})
    assert code == 4 and msg is not None and "rank 1" in msg and "SIGKILL" in msg
    # A crash (a traceback, exit 1) stays 1; a diverged run 3.
    assert job_outcome({0: WorkerExit(1, 5), 1: WorkerExit(-15, 5)}) == (1, None)
    assert job_outcome({0: WorkerExit(3, 5), 1: WorkerExit(3, 5)}) == (3, None)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_nproc_per_node_runs_the_workers() -> None:
    from launch_helpers import STEPS, reference

    r, got = reference()  # `llmscale train --nproc-per-node 2 ...`
    assert r.returncode == 0
    assert len(got.train) == STEPS and got.val is not None
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
    assert r.stdout.count("run folder:") == 1  # rank 0 only
