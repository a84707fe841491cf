"""Today's stacks against their published runs (validation/data/runs.toml)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from llmscale.errors import ConfigError
from llmscale.stack import ALLOCATOR_OVERHEAD
from llmscale.validation.runs import (
    RUNS,
    all_results,
    load_runs,
    model_file,
    plan_command,
    run_plan,
    summarise,
)

RESULTS = all_results()
# Published layouts the planner still predicts not to fit, each with why (docs/planner.md): the
# GB200 405B row comes out 1.4 GiB over the 186 GiB it ran in.


def test_rows_are_sourced_and_unique() -> None:
    rows = load_runs()
    assert len({r["id"] for r in rows}) == len(rows)
    stacks = {r["stack"] for r in rows}
    assert {"megatron-core", "torchtitan"} <= stacks
    for stack in ("megatron-core", "torchtitan"):
        assert sum(r["stack"] == stack and r["role"] == "validation" for r in rows) >= 4


def test_a_row_without_a_source_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "runs.toml"
    bad.write_text(RUNS.read_text().replace('source = "', 'source = " "  # ', 1))
    with pytest.raises(ConfigError, match="source"):
        load_runs(bad)


@pytest.mark.parametrize("stack", ["megatron-core", "torchtitan"])
def test_median_throughput_error_within_10_percent(stack: str) -> None:
    (s,) = [s for s in summarise(RESULTS) if s.stack == stack]
    assert s.median_error <= 0.10, s.line


def test_every_published_layout_fits() -> None:
    assert [r.id for r in RESULTS if not r.fits] == []


def test_torchtitan_shards_over_the_cp_ranks_without_dp_shard() -> None:
    """torchtitan's cp 8 x dp_shard 1 run is FSDP over 8 ranks (its dp_shard_cp mesh): an 8B
    model's states are 1/8 per rank, as at cp 1 x dp_shard 8; the llmscale runtime replicates
    over the cp ranks there, so the same layout under its stack holds them whole."""
    from llmscale.hardware.catalog import GiB
    from llmscale.plan.memory import estimate_memory, memory_options
    from llmscale.stack import LLMSCALE

    rows = {r["id"]: r for r in load_runs()}
    plan, stack, _ = run_plan(rows["tt2412-8b-8gpu-cp8-seq256k"])
    assert (plan.dp_shard, plan.cp, plan.fsdp_shards_for(stack)) == (1, 8, 8)
    assert plan.fsdp_shards_for(LLMSCALE) == 1
    shard = estimate_memory(plan, memory_options(stack), validate=False).worst
    whole = estimate_memory(plan, memory_options(LLMSCALE), validate=False).worst
    n = plan.model.num_params()
    assert shard.params == pytest.approx(4 * n / 8, rel=0.01)
    assert whole.params == pytest.approx(4 * n, rel=0.01)
    assert (whole.total - shard.total) / GiB > 100


def test_torchtitan_compiles_the_loss_with_the_model() -> None:
    """With compile on, torchtitan compiles its loss (since 2025-04): no fp32 logits are kept or
    made, only the bf16 logits and two fp32 numbers per token. Its H200 run fits its published
    memory that way; run eager, as the 2024 torchtitan did (the row says `compiled_loss =
    false`), the same layout keeps the fp32 log-softmax (4 B per logit, not the logits' 2) and
    the backward's two fp32 temporaries (8 B)."""
    from llmscale.hardware.catalog import GiB
    from llmscale.plan.memory import estimate_memory, memory_options

    rows = {r["id"]: r for r in load_runs()}
    row = rows["tt2506-h200-8b-32gpu-fsdp-compile-float8"]
    plan, stack, compiled = run_plan(row)
    assert compiled and stack.compiles_loss
    fused = estimate_memory(plan, memory_options(stack, compiled=True), validate=False).worst
    eager = estimate_memory(plan, memory_options(stack, compiled=False), validate=False).worst
    tokens = plan.micro_batch_size * plan.seq_len
    logits = tokens * plan.model.vocab_size
    assert eager.activations - fused.activations == (4 - 2) * logits - 8 * tokens
    assert eager.transient == 8 * logits > fused.transient  # tp 1: the plain kernels
    assert abs(fused.total / GiB / row["memory_GiB"] - 1) < 0.15
    assert eager.total / GiB / row["memory_GiB"] > 1.15
    _, old, _ = run_plan(rows["tt2412-8b-8gpu-fsdp-compile"])
    assert not old.compiles_loss


def test_a_run_with_expandable_segments_reserves_what_it_allocates() -> None:
    """Megatron-Bridge's 405B recipe on GB200 sets expandable segments (the run row says so):
    the allocator adds no fragmentation, and the layout that ran fits its 186 GB; fixed-size
    segments would add 5% of what it allocates."""
    from llmscale.hardware.catalog import get_gpu
    from llmscale.plan.memory import estimate_memory, memory_options

    row = {r["id"]: r for r in load_runs()}["mbridge-2511-gb200-llama31-405b-fp8"]
    plan, stack, _ = run_plan(row)
    assert stack.allocator_overhead.value == 0.0
    ran = estimate_memory(plan, memory_options(stack), validate=False)
    fixed = estimate_memory(plan, memory_options(stack.on(allocator_overhead=ALLOCATOR_OVERHEAD)),
                            validate=False)  # fmt: skip
    assert ran.worst.allocator == 0.0 and ran.fits(get_gpu("gb200"))
    assert fixed.worst.allocator == pytest.approx(ALLOCATOR_OVERHEAD.value * ran.worst.total)


def test_a_row_is_driven_as_the_cli_drives_it() -> None:
    """Megatron-Core's distributed optimizer is --dp-shard N --zero-stage 1; torchtitan's FSDP
    is zero 3; interleaving is the row's virtual pipeline size."""
    rows = {r["id"]: r for r in load_runs()}
    plan, stack, _ = run_plan(rows["nemo2407-h100-llama2-70b"])
    assert (plan.tp, plan.pp, plan.chunks, plan.dp_shard, plan.zero_stage) == (4, 4, 20, 4, 1)
    assert stack.name == "megatron-core" and plan.pp_schedule == "interleaved_1f1b"
    plan, stack, compiled = run_plan(rows["tt2412-8b-8gpu-fsdp-compile"])
    assert (plan.dp_shard, plan.zero_stage, plan.recompute, compiled) == (
        8,
        3,
        "selective_op",
        True,
    )


def test_each_rows_command_prints_its_prediction(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The validation page's command for a row, typed as it is (with the model file the page
    gives beside it where the model is not a preset as it stands), gives the row's tokens/s per
    GPU, memory and fit (the CLI and the page read one definition of each setting)."""
    import json
    import shlex

    from llmscale.cli import main

    by_id = {r.id: r for r in RESULTS}
    typed = 0
    for row in load_runs():
        toml = model_file(row)
        path = tmp_path / f"{row['id']}.toml"
        if toml is not None:
            path.write_text(toml + "\n")
        cmd = plan_command(row, str(path))
        if cmd is None:
            continue
        argv = shlex.split(cmd)[1:] + ["--json", "--top", "1"]
        assert main(argv) == 0, cmd
        got = json.loads(capsys.readouterr().out)["candidates"][0]
        want, gpus = by_id[row["id"]], int(row["gpus"])
        if "tokens_per_s_per_gpu" in row:
            assert got["step_time"]["tokens_per_s"] / gpus == pytest.approx(want.predicted, 1e-9)
        gib = got["memory_bytes"]["worst_stage"]["total"] / 2**30
        assert gib == pytest.approx(want.memory_predicted, 1e-9), cmd
        assert (got["fits"], got["tight"]) == (want.fits, want.tight), cmd
        typed += 1
    # every row of the two stacks the issue names: presets, custom shapes, longer contexts
    assert typed == sum(r["stack"] in ("megatron-core", "torchtitan") for r in load_runs())


def test_a_run_that_fits_only_without_the_allocators_share_is_shown_fitting_tightly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """NeMo 24.07's Nemotron-4 340B on 128 H100 ran; its allocated peak fits the usable memory
    and its total with the caching allocator's 5% does not. The caching allocator flushes its
    cache before it fails, so `plan` keeps the layout as fitting, marked tight (~), with what
    that means, and exits 0."""
    import shlex

    from llmscale.cli import main

    row = {r["id"]: r for r in load_runs()}["nemo2407-h100-nemotron-340b"]
    (res,) = [r for r in RESULTS if r.id == row["id"]]
    assert res.fits and res.tight and abs(res.ratio - 1) < 0.10
    path = tmp_path / "n340.toml"
    path.write_text((model_file(row) or "") + "\n")
    cmd = plan_command(row, str(path))
    assert cmd is not None
    assert main(shlex.split(cmd)[1:]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("1~ ") for line in lines), out
    assert "~ = fits tightly (below)" in out
    (note,) = [line for line in lines if line.startswith("#1~ tight: ")]
    assert "GiB allocated on pipeline rank 0 of 78.5 usable" in note
    assert "num_alloc_retries" in note


def test_a_row_fact_with_an_unknown_value_is_refused() -> None:
    rows = {r["id"]: r for r in load_runs()}
    row = dict(rows["tt2412-405b-512gpu-3d-1f1b"], pipeline_outputs_kept="al")
    with pytest.raises(ConfigError, match=r"pipeline_outputs_kept.*none \| last \| all"):
        run_plan(row)


def test_a_loss_kernel_the_row_does_not_know_is_refused() -> None:
    rows = {r["id"]: r for r in load_runs()}
    row = dict(rows["mcore-r080-weak-1.7b"], loss_kernel="tee")
    with pytest.raises(ConfigError, match=r"loss_kernel: got 'tee'; allowed: te \| megatron_fused"):
        run_plan(row)


def test_megatron_runs_price_the_cross_entropy_their_configuration_ran() -> None:
    """Megatron-LM r0.8's README runs kept --cross-entropy-loss-fusion off: its unfused
    vocab-parallel cross-entropy moves 52 B per bf16 logit (38 forward, 14 backward) where
    TransformerEngine's, which the megatron-core stack runs today, moves 10 (6, 4); the 1.7B
    row (tp 1, pp 1, 4 micro-batches of 4,096 tokens, vocabulary 131,072) is slower by exactly
    that traffic at the GPU's HBM rate, and keeps an fp32 softmax (4 B per logit) and a bf16
    cast beside it (the rank's peak transient) where TransformerEngine keeps the bf16 gradient
    alone."""
    from llmscale.plan.cluster import Cluster
    from llmscale.plan.memory import estimate_memory, memory_options
    from llmscale.plan.time import estimate_step_time, time_params

    row = {r["id"]: r for r in load_runs()}["mcore-r080-weak-1.7b"]
    plan, unfused, _ = run_plan(row)
    assert unfused.kernels.loss_kernel == "megatron"
    te = unfused.on(kernels=replace(unfused.kernels, loss_kernel="te"))
    cluster = Cluster.of("h100")
    slow = estimate_step_time(plan, cluster, time_params(unfused), validate=False)
    fast = estimate_step_time(plan, cluster, time_params(te), validate=False)
    logits = plan.micro_batch_size * plan.seq_len * plan.model.vocab_size
    hbm = cluster.gpu.hbm_bandwidth * cluster.gpu.calibration.hbm_efficiency.value
    assert plan.n_microbatches == 4
    assert slow.seconds - fast.seconds == pytest.approx(4 * (52 - 10) * logits / hbm, rel=1e-9)
    kept = estimate_memory(plan, memory_options(unfused), validate=False).worst
    lean = estimate_memory(plan, memory_options(te), validate=False).worst
    assert kept.activations - lean.activations == pytest.approx((4 - 2) * logits)
    assert kept.transient == pytest.approx(2 * logits)
    assert lean.transient < kept.transient  # TE: the loss holds nothing beside what it keeps
