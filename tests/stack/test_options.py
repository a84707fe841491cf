"""A stack's own settings (`llmscale.stack.options`): one definition for the command line and for
the facts a published run states, so the command a user types for a run predicts what the
validation page shows for it."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from llmscale.cli import main
from llmscale.errors import ConfigError
from llmscale.stack import EXPANDABLE_SEGMENTS_OVERHEAD, MEGATRON_CORE, STACKS, TORCHTITAN
from llmscale.stack.options import (
    OPTIONS_BY_NAME,
    STACK_OPTIONS,
    in_effect,
    options_text,
    with_options,
)
from llmscale.validation.runs import evaluate, load_runs, plan_command


def test_each_setting_sets_its_fields_on_its_stacks_and_is_refused_elsewhere() -> None:
    # Megatron-Bridge's FP8 recipes and performance scripts: both on unless told
    assert (MEGATRON_CORE.fp8_params, MEGATRON_CORE.main_grad_bytes) == (True, 2)
    off = with_options(MEGATRON_CORE, {"fp8-param-gather": False, "grad-reduce-in-bf16": False})
    assert (off.fp8_params, off.main_grad_bytes) == (False, 4)
    assert in_effect(off) == {
        "fp8-param-gather": False,
        "grad-reduce-in-bf16": False,
        "tp-comm-overlap": True,
        "cross-entropy-fusion": "te",
        "expandable-segments": False,
    }
    assert in_effect(MEGATRON_CORE)["grad-reduce-in-bf16"]
    assert in_effect(STACKS["llmscale"]) == {}
    # Megatron-LM's default (--tp-comm-overlap unset): TP collectives beside no GEMM
    assert MEGATRON_CORE.tp_overlap_gemm
    assert not with_options(MEGATRON_CORE, {"tp-comm-overlap": False}).tp_overlap_gemm
    tt = with_options(TORCHTITAN, {"async-tp": True})
    assert tt.tp_overlap_gemm and tt.tp_overlap_chunks
    mc = with_options(MEGATRON_CORE, {"expandable-segments": True})
    assert mc.allocator_overhead == EXPANDABLE_SEGMENTS_OVERHEAD
    # torchtitan's launcher always sets them: its reserve is measured under them, no setting
    assert "expandable-segments" not in in_effect(TORCHTITAN)
    assert with_options(TORCHTITAN, {}) == TORCHTITAN
    for o in STACK_OPTIONS:
        assert set(o.stacks) <= set(STACKS), o.name
        for name in set(STACKS) - set(o.stacks):
            with pytest.raises(ConfigError) as e:
                o.apply(STACKS[name], True)
            assert f"--{o.name}: got '--stack {name}'" in str(e.value)
    with pytest.raises(ConfigError, match="--no-expandable-segments"):
        OPTIONS_BY_NAME["expandable-segments"].apply(MEGATRON_CORE, False)
    assert options_text({"async-tp": True, "fp8-param-gather": False}) == (
        "--async-tp --no-fp8-param-gather"
    )
    # a setting that cannot be turned off is not typed as --no-NAME when it is off
    assert options_text({"expandable-segments": False, "async-tp": False}) == "--no-async-tp"


def _plan_argv(row: dict) -> list[str]:
    """The validation page's `llmscale plan` command for a published row (its layout fixed, its
    facts as the stack's flags), as argv with --json."""
    cmd = plan_command(row)
    assert cmd is not None
    return [*shlex.split(cmd)[1:], "--json", "--top", "1"]


@pytest.mark.parametrize(
    "run_id", ["mbridge-2602-gb200-llama31-405b-fp8", "mbridge-2602-gb300-llama31-405b-fp8"]
)
def test_the_command_for_a_published_run_predicts_what_the_validation_page_shows(
    run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """FP8 parameters, bf16 gradient reduction and expandable segments, typed as flags: the same
    tokens/s and memory as the row; with fp32 main gradients and the caching allocator's share
    (Megatron-LM's defaults), GiB more."""
    row = next(r for r in load_runs() if r["id"] == run_id)
    want = evaluate(row)
    argv = _plan_argv(row)
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)["candidates"][0]
    assert got["step_time"]["tokens_per_s"] / row["gpus"] == pytest.approx(want.predicted, 1e-9)
    gib = got["memory_bytes"]["worst_stage"]["total"] / 2**30
    assert gib == pytest.approx(want.memory_predicted, 1e-9) and got["fits"] == want.fits
    bare = [a for a in argv if a not in ("--grad-reduce-in-bf16", "--expandable-segments")]
    main([*bare, "--no-grad-reduce-in-bf16"])
    more = json.loads(capsys.readouterr().out)
    worst = more["candidates"][0]["memory_bytes"]["worst_stage"]["total"] / 2**30
    assert worst > gib + 5  # fp32 main gradients and the allocator's 5% share


def test_plan_and_dry_run_name_and_refuse_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    for o in STACK_OPTIONS:
        assert f"--{o.name}" in text
    assert "--no-fp8-param-gather" in text and "--no-expandable-segments" not in text
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--async-tp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmscale plan: error: --async-tp: got '--stack llmscale'")
    assert len(err.splitlines()) == 1
    assert main(["train", "--dry-run", "--model.name", "tiny", "--grad-reduce-in-bf16"]) == 2
    assert "only applies with --dry-run --gpu NAME --stack NAME" in capsys.readouterr().err


def test_a_plan_names_the_settings_it_assumes(capsys: pytest.CaptureFixture[str]) -> None:
    """The headline and --json name every setting of the stack as the plans assume it, defaults
    included; those given on the command line stay apart in inputs.stack_options."""
    base = ["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--top", "1"]
    assert main([*base, "--stack", "megatron-core"]) == 0
    out = capsys.readouterr().out
    assert (
        "megatron-core settings: --fp8-param-gather --grad-reduce-in-bf16 --tp-comm-overlap "
        "--cross-entropy-fusion te\n"
    ) in out
    assert main([*base, "--stack", "megatron-core", "--no-grad-reduce-in-bf16", "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["stack_options"] == {"grad-reduce-in-bf16": False}
    assert inputs["stack_settings"] == {
        "fp8-param-gather": True,
        "grad-reduce-in-bf16": False,
        "tp-comm-overlap": True,
        "cross-entropy-fusion": "te",
        "expandable-segments": False,
    }
    assert main(base) == 0  # the llmscale runtime has no such settings: no line
    assert "settings:" not in capsys.readouterr().out


def test_torchtitans_older_software_is_typed_as_settings() -> None:
    """K and V repeated before attention (torchtitan until 2026-01-27) and the loss run eager
    (torchtitan of 2024-12): settings of the torchtitan stack, off / on by default as
    torchtitan runs today, refused under another stack."""
    assert not TORCHTITAN.kernels.repeat_kv and TORCHTITAN.compiles_loss
    old = with_options(TORCHTITAN, {"repeat-kv": True, "compile-loss": False})
    assert old.kernels.repeat_kv and not old.compiles_loss
    assert old.kernels == replace(TORCHTITAN.kernels, repeat_kv=True)  # nothing else moved
    assert in_effect(old) | {"repeat-kv": False, "compile-loss": True} == in_effect(TORCHTITAN)
    with pytest.raises(ConfigError, match="--repeat-kv: got '--stack megatron-core'"):
        with_options(MEGATRON_CORE, {"repeat-kv": True})


def test_a_valued_setting_takes_one_of_its_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron's cross-entropy fusion and torch pipelining's kept stage outputs are settings
    with values (`--NAME VALUE`): each sets its fields, the stack's default is one of them,
    and a value outside them is refused in one line naming the choices."""
    assert in_effect(MEGATRON_CORE)["cross-entropy-fusion"] == "te"
    unfused = with_options(MEGATRON_CORE, {"cross-entropy-fusion": "none"})
    assert unfused.kernels.loss_kernel == "megatron"
    assert in_effect(unfused)["cross-entropy-fusion"] == "none"
    assert with_options(TORCHTITAN, {"pipeline-outputs-kept": "all"}).pipeline_outputs_kept == "all"
    assert options_text({"cross-entropy-fusion": "native", "async-tp": True}) == (
        "--cross-entropy-fusion native --async-tp"
    )
    with pytest.raises(ConfigError, match="--cross-entropy-fusion: got 'fused'; allowed: te"):
        with_options(MEGATRON_CORE, {"cross-entropy-fusion": "fused"})
    base = ["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--top", "1"]
    argv = [*base, "--stack", "megatron-core", "--cross-entropy-fusion", "none", "--json"]
    assert main(argv) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["stack_options"] == {"cross-entropy-fusion": "none"}
    assert inputs["stack_settings"]["cross-entropy-fusion"] == "none"
    with pytest.raises(SystemExit) as exit_:  # argparse's own one-line refusal
        main([*base, "--stack", "megatron-core", "--cross-entropy-fusion", "fused"])
    assert exit_.value.code == 2
    assert "invalid choice: 'fused'" in capsys.readouterr().err


def test_without_tp_comm_overlap_the_tp_collectives_are_exposed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Megatron-LM runs its TP collectives beside no GEMM unless --tp-comm-overlap is set
    (TransformerEngine's userbuffers): the same layout then takes longer, by its exposed TP
    traffic."""
    base = ["plan", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64", "--stack",
            "megatron-core", "--tp", "8", "--pp", "2", "--mbs", "1", "--recompute", "none",
            "--schedule", "1f1b", "--top", "1", "--json"]  # fmt: skip
    steps = {}
    for flag in ("--tp-comm-overlap", "--no-tp-comm-overlap"):
        assert main([*base, flag]) == 0
        (c,) = json.loads(capsys.readouterr().out)["candidates"]
        steps[flag] = c["step_time"]
    on, off = steps["--tp-comm-overlap"], steps["--no-tp-comm-overlap"]
    assert off["seconds"] > 1.05 * on["seconds"]
    assert off["breakdown_seconds"]["tp_comm"] > on["breakdown_seconds"].get("tp_comm", 0.0)
