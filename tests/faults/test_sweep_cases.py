"""Cases of the usability review's bad-input sweep (../shared/reviews/usability-2026-12-04.md,
re-run by bench/bad_inputs.py) fixed after it, by their ids: one line and exit 2 for bad input,
never a traceback, nothing accepted and ignored. Each case is a row of docs/reliability.md."""

from __future__ import annotations

import pytest

from llmscale.cli import main


def one_line(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (out, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b"])
def test_sn07_t_w_for_a_schedule_without_a_split_backward(capsys, fault_row, schedule) -> None:
    """SN07: --t-w was accepted and ignored by the schedules whose backward is one op."""
    extra = ["--chunks", "2"] if schedule == "interleaved_1f1b" else []
    line = one_line(capsys, ["schedule", "--schedule", schedule, "--t-w", "5", *extra])
    assert f"t_w: got '5'; allowed: unset with --schedule {schedule}" in line
    assert main(["schedule", "--schedule", "zbv", "--t-w", "0.5"]) == 0  # where it applies
    fault_row(
        fault=f"SN07: schedule --t-w with --schedule {schedule} (no split backward)",
        command=f"llmscale schedule --schedule {schedule} --t-w 5",
        expected="exit 2, one line: --t-w applies to zero_bubble, zbv, dualpipev only",
        observed=f"exit 2: {line}",
    )


def test_ev05_eval_with_a_model_override(earlier, capsys, fault_row) -> None:
    """EV05: eval --model.dim 128 was accepted and ignored (the checkpoint's shape is used)."""
    line = one_line(capsys, ["eval", str(earlier), "--model.dim", "128"])
    assert "model.dim: got 128; allowed: the run's own (64)" in line
    assert main(["eval", str(earlier), "--model.n_layers", "4"]) == 0  # the run's own value
    fault_row(
        fault="EV05: eval RUN --model.dim 128 (the run's model has dim 64)",
        command="llmscale eval R --model.dim 128",
        expected="exit 2, one line: eval reads the model from the checkpoint",
        observed=f"exit 2: {line}",
    )


def test_t30_dry_run_with_more_ranks_than_the_layout(tmp_path, capsys, fault_row) -> None:
    """T30: train --dry-run --nproc-per-node 2 with a 1-rank layout predicted one rank, exit 0;
    the launch itself refuses it. The dry run now checks the layout against the ranks too."""
    rd = ["--job.run_dir", str(tmp_path / "r")]
    line = one_line(capsys, ["train", "--dry-run", "--nproc-per-node", "2", *rd])
    assert "allowed: degrees whose product equals the world size 2" in line
    assert "--nproc-per-node: got 0" in one_line(
        capsys, ["train", "--dry-run", "--nproc-per-node", "0", *rd]
    )
    args = ["train", "--dry-run", "--nproc-per-node", "2", "--parallel.dp_shard", "2",
            "--train.global_batch_size", "16", *rd]  # fmt: skip
    assert main(args) == 0
    fault_row(
        fault="T30: train --dry-run --nproc-per-node 2 with a 1-rank layout",
        command="llmscale train --dry-run --nproc-per-node 2 --job.run_dir R",
        expected="exit 2, one line, as the launch (was: a 1-rank prediction, exit 0)",
        observed=f"exit 2: {line}",
    )


def test_rf02_overwrite_with_another_checkpoint_folder(run, capsys, fault_row) -> None:
    """RF02: --overwrite with another checkpoint.folder left the earlier run's checkpoints/
    beside the new run; the folder its config.toml names is the earlier run's too."""
    from run_helpers import run_cli, train_args

    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000001",
        "step-000002",
    ]
    rc, _, err = run_cli(
        capsys, train_args(run, "--overwrite", "--checkpoint.folder", "ckpts2", steps=1)
    )
    assert rc == 0 and "--overwrite: removed the earlier run's files" in err
    assert not (run / "checkpoints").exists()
    assert sorted(p.name for p in (run / "ckpts2").iterdir()) == ["step-000001"]
    fault_row(
        fault="RF02: --overwrite with another --checkpoint.folder than the earlier run's",
        command="llmscale train --job.run_dir R --overwrite --checkpoint.folder ckpts2",
        expected="the earlier run's checkpoints removed with its other files",
        observed="checkpoints/ (steps 1, 2) removed; ckpts2/ holds the new step 1",
    )


def test_i11_init_from_an_hf_folder_with_more_layers_than_tensors(
    earlier, tmp_path, capsys, fault_row
) -> None:
    """I11: config.json with 8 layers over 4 layers' tensors named a tensor as the value of
    checkpoint.init_from; now the folder, and the missing tensor in the allowed part."""
    import json

    hf = tmp_path / "hf"
    assert main(["export", str(earlier), "--format", "hf", "--out", str(hf)]) == 0
    cfg = json.loads((hf / "config.json").read_text())
    cfg["num_hidden_layers"] = 8
    (hf / "config.json").write_text(json.dumps(cfg))
    args = ["train", "--checkpoint.init_from", f"hf:{hf}", "--job.run_dir", str(tmp_path / "r"),
            "--train.steps", "1", "--metrics.progress", "false"]  # fmt: skip
    line = one_line(capsys, args)
    assert f"checkpoint.init_from: got 'hf:{hf}'" in line
    assert "model.layers.4.input_layernorm.weight is missing: 8 layers in config.json" in line
    fault_row(
        fault="I11: init_from an HF folder whose config.json has 8 layers, its weights 4",
        command="llmscale train --checkpoint.init_from hf:DIR",
        expected="exit 2, one line naming the folder and the missing tensor",
        observed=f"exit 2: {line}",
    )


def test_n_toml2_a_config_with_a_byte_order_mark(tmp_path, capsys, fault_row) -> None:
    """N_TOML2: a config saved with a UTF-8 byte-order mark was "not valid TOML: Invalid
    statement (at line 1, column 1)"; now the line says what is wrong with it."""
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")
    line = one_line(capsys, ["train", "--config", str(bom), "--dry-run"])
    assert f"--config: {bom} starts with a byte-order mark (bytes ef bb bf)" in line
    fault_row(
        fault="N_TOML2: a config file starting with a UTF-8 byte-order mark",
        command="llmscale train --config BOM.toml",
        expected="exit 2, one line naming the byte-order mark",
        observed=f"exit 2: {line}",
    )


def test_t03_pl26_context_parallel_with_offload_in_the_dry_run_and_plan(
    tmp_path, capsys, fault_row
) -> None:
    """T03: train --dry-run accepted cp 2 with optimizer offload (a step time printed) that the
    real run refuses (T04); PL26: plan found layouts for it. Both now say why, as the run does."""
    line = one_line(capsys, ["train", "--dry-run", "--parallel.cp", "2", "--optimizer.offload",
                             "optimizer", "--job.run_dir", str(tmp_path / "r")])  # fmt: skip
    assert line == (
        "llmscale train: error: optimizer.offload: got 'optimizer'; allowed: none with "
        "parallel.cp > 1 (not supported yet)"
    )
    assert not (tmp_path / "r").exists()
    capsys.readouterr()
    assert main(["plan", "--gpus", "64", "--cp", "2", "--offload", "optimizer"]) == 1  # no plan
    out, err = capsys.readouterr()
    assert "0 plans costed, 0 fit" in out
    assert "offload with cp 2: none with parallel.cp > 1 (not supported yet)" in out + err
    fault_row(
        fault="T03, PL26: context parallelism with optimizer offload in train --dry-run and plan",
        command="llmscale train --dry-run --parallel.cp 2 --optimizer.offload optimizer; "
        "llmscale plan --gpus 64 --cp 2 --offload optimizer",
        expected="dry run: exit 2, one line as the run (T04); plan: no layout, the reason named",
        observed=f"exit 2: {line}; plan exit 1, 0 plans costed",
    )
