"""Every parallel layout trains exactly like one process on the same global batch.

Each world size is one torchrun process group that trains its layouts in turn (5 steps of the
tiny model, fp32, gloo); the per-step losses, the final validation loss and the final parameters
(gathered to full tensors, merged over pipeline stages) must equal those of an in-process
single-process run to 1e-5 relative. Measured: about 1e-7 for losses and at most 3e-6 for any
parameter tensor (reduction orders differ; nothing else).
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
from parallel_harness import (
    BASE,
    PARAM_RTOL,
    RTOL,
    assert_same_run,
    rel_error,
    run_layouts,
    single_process_reference,
    torchrun,
)

from llmscale.config import load_config
from llmscale.train.metrics import read_jsonl
from llmscale.train.trainer import Trainer

pytestmark = pytest.mark.slow


def _p(**degrees: Any) -> list[str]:
    args: list[str] = []
    for k, v in degrees.items():
        args += [f"--parallel.{k}", str(v).lower()]
    return args


WORLD2 = {
    "dp2": _p(dp_replicate=2),
    "fsdp2_zero2": _p(dp_shard=2, zero_stage=2),
    "fsdp2_zero3": _p(dp_shard=2, zero_stage=3),
    "tp2": _p(tp=2),
    "tp2_sp": _p(tp=2, sequence_parallel=True),
    "pp2_gpipe": _p(pp=2, pp_schedule="gpipe"),
    "pp2_1f1b": _p(pp=2, pp_schedule="1f1b"),
    "pp2_interleaved": _p(pp=2, pp_schedule="interleaved_1f1b", pp_chunks=2),
}
# Trained in the world-2 group too, in bf16 (FSDP2 computes on bf16 weights): not compared with
# the fp32 reference; their memory metrics are compared with the planner's prediction instead.
WORLD2_BF16 = {
    "fsdp2_bf16": [*_p(dp_shard=2), "--precision.mode", "bf16"],
    "fsdp2_bf16_full": [*_p(dp_shard=2), "--precision.mode", "bf16", "--train.recompute", "full"],
}
WORLD4 = {
    "fsdp2_tp2": _p(dp_shard=2, tp=2),
    "hsdp2x2": _p(dp_replicate=2, dp_shard=2),
    "pp2_tp2_sp": _p(pp=2, tp=2, sequence_parallel=True),
    "pp2_fsdp2": _p(pp=2, dp_shard=2),
}
WORLD8 = {
    "fsdp2_pp2_tp2": _p(
        dp_shard=2, pp=2, tp=2, sequence_parallel=True, pp_schedule="interleaved_1f1b", pp_chunks=2
    ),
}
CKPT = ["--checkpoint.enabled", "true", "--checkpoint.keep_last", "5"]
# Saved under pp=2 x tp=2 after step 3, resumed under dp_shard=4 (FSDP) to step 5.
RESUME = [
    {
        "name": "resume_save",
        "run": "resume",
        "args": [*_p(pp=2, tp=2), *CKPT, "--checkpoint.stop_after", "3"],
    },
    {
        "name": "resume_load",
        "run": "resume",
        "args": [*_p(dp_shard=4), *CKPT, "--checkpoint.resume", "true"],
    },
]


def _layouts(table: dict[str, list[str]]) -> list[dict[str, Any]]:
    return [{"name": n, "args": a} for n, a in table.items()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    return single_process_reference(tmp_path_factory.mktemp("single") / "run")


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, dict[str, Any]]:
    layouts = [*_layouts(WORLD2), *_layouts(WORLD2_BF16)]
    return run_layouts(2, tmp_path_factory.mktemp("world2"), layouts)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return run_layouts(4, tmp_path_factory.mktemp("world4"), [*_layouts(WORLD4), *RESUME])


@pytest.fixture(scope="module")
def world8(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return run_layouts(8, tmp_path_factory.mktemp("world8"), _layouts(WORLD8), timeout=300)


@pytest.mark.parametrize("name", list(WORLD2))
def test_two_ranks_equal_one_process(name, world2, reference) -> None:
    assert_same_run(world2[name], reference, name)


@pytest.mark.parametrize("name", list(WORLD4))
def test_four_ranks_equal_one_process(name, world4, reference) -> None:
    assert_same_run(world4[name], reference, name)


@pytest.mark.parametrize("name", list(WORLD8))
def test_eight_ranks_equal_one_process(name, world8, reference) -> None:
    assert_same_run(world8[name], reference, name)


@pytest.mark.parametrize("name", list(WORLD2_BF16))
def test_fsdp_bf16_memory_is_what_the_planner_predicts(name, world2) -> None:
    from llmscale.plan import activations as act
    from llmscale.plan.memory import MemoryOptions
    from llmscale.plan.predict import expected_runtime_metrics

    row = [
        r for r in read_jsonl(world2[name]["run_dir"] / "metrics.jsonl") if r["kind"] == "train"
    ][-1]
    cfg = load_config(None, [*BASE, *WORLD2_BF16[name]])
    want = expected_runtime_metrics(cfg, options=MemoryOptions(kernels=act.RUNTIME_CPU))
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")
    assert {k: row[k] for k in keys} == {k: want[k] for k in keys}
    assert all(x == x for x in world2[name]["losses"])  # finite, not NaN


@pytest.mark.parametrize("name", ["pp2_gpipe", "pp2_1f1b", "pp2_interleaved"])
def test_each_stage_holds_the_micro_batches_in_flight_the_planner_predicts(name, world2) -> None:
    """The most saved-activation bytes a stage held at once during its last step (several
    micro-batches in flight) against the planner: its schedule's in-flight count x one
    micro-batch's bytes. GPipe holds all 4 micro-batches on both stages; 1F1B p - rank of them;
    interleaved (v = 2) 5 and 3 half-stage units on ranks 0 and 1."""
    from llmscale.plan import activations as act
    from llmscale.plan.memory import MemoryOptions, rank_activation_bytes
    from llmscale.plan.predict import as_plan

    plan = as_plan(load_config(None, [*BASE, *WORLD2[name]]))
    options = MemoryOptions(kernels=act.RUNTIME_CPU)
    peaks = world2[name]["activation_peaks"]
    assert len(peaks) == 2
    for rank, got in enumerate(peaks):
        want = rank_activation_bytes(plan, rank, options)
        # The schedule's micro-batches of token ids are views of the batch, so the first stage
        # holds the batch's storage, some hundred bytes beyond the micro-batches' own.
        assert abs(got - want) <= 0.002 * want, (rank, got, want)


def test_metrics_written_once_with_the_global_loss(world4, reference) -> None:
    rows = [r for r in read_jsonl(world4["fsdp2_tp2"]["run_dir"] / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]  # rank 0 only: no duplicate rows
    assert [r["loss"] for r in train] == world4["fsdp2_tp2"]["losses"]
    assert all(r["world_size"] == 4 and r["tokens_per_s"] > 0 for r in train)
    # Memory is per rank: FSDP x TP leaves each rank about a quarter of the parameters.
    n = load_config(None, BASE).model.num_params()
    assert n <= train[-1]["param_bytes"] < 1.05 * n  # 4 bytes x n / 4 ranks, norms on 2 of them


def test_resume_under_another_layout_continues_the_run(world4, reference, tmp_path) -> None:
    """pp=2 x tp=2 saves after step 3; dp_shard=4 resumes; the curve is the uninterrupted one."""
    saved, resumed = world4["resume_save"], world4["resume_load"]
    assert saved["steps_done"] == 3 and len(saved["losses"]) == 3
    assert resumed["steps_done"] == 5 and len(resumed["losses"]) == 2
    rows = [r for r in read_jsonl(resumed["run_dir"] / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row, want in zip(rows, reference["losses"], strict=True):
        assert rel_error(row["loss"], want) < RTOL, (row["step"], row["loss"], want)
    for k, want in reference["params"].items():
        rel = ((resumed["params"][k] - want).norm() / want.norm()).item()
        assert rel < PARAM_RTOL, (k, rel)

    # The same distributed checkpoint also loads into one process, without a process group.
    ckpt = resumed["run_dir"] / "checkpoints" / "step-000003"
    assert ckpt.is_dir()
    single = tmp_path / "single"
    shutil.copytree(ckpt, single / "checkpoints" / ckpt.name)
    t = Trainer(
        load_config(
            None, [*BASE, "--job.run_dir", str(single), *CKPT[:2], "--checkpoint.resume", "true"]
        )
    )
    r = t.fit()
    assert r.steps_done == 5 and len(r.losses) == 2
    for a, b in zip(r.losses, reference["losses"][3:], strict=True):
        assert rel_error(a, b) < RTOL, (a, b)
    for n, p in t.model.named_parameters():
        want = reference["params"][n]
        assert ((p.detach() - want).norm() / want.norm()).item() < PARAM_RTOL, n


@pytest.mark.parametrize(
    ("name", "syncs", "reduction", "per_micro_batch"),
    [
        ("dp2", ["sync=False", "sync=True"], "all_reduce", 1),
        ("fsdp2_zero2", ["sync=True"], "reduce_scatter", 2),
        ("fsdp2_zero3", ["sync=True"], "reduce_scatter", 2),
    ],
)
def test_accumulation_reduces_gradients_as_the_zero_stage_says(
    name, syncs, reduction, per_micro_batch, world2
) -> None:
    """2 micro-batches per rank. Plain DP: sync off for the first, on for the last, which alone
    all-reduces; zero 2 and 3 reduce-scatter after every micro-batch (stack.residency).

    One reduction per FSDP unit: 4 blocks and the root.
    """
    (events,) = world2[name]["stage_events"]
    got_syncs = [e for e in events if e.startswith("sync=")]
    assert got_syncs == syncs * (2 // len(syncs)), events
    grads = [e for e in events if not e.startswith("sync=")]
    assert grads == [reduction] * 5 * per_micro_batch, events


def test_hsdp_reduce_scatters_then_all_reduces_once_per_unit(world4) -> None:
    """dp = 4 leaves one micro-batch per rank: each unit reduce-scatters within its shard group
    of 2, then all-reduces its shard across the 2 replicas."""
    (events,) = world4["hsdp2x2"]["stage_events"]
    assert events == ["sync=True", *["reduce_scatter", "all_reduce"] * 5], events


def test_pipeline_with_fsdp_reduces_once_per_step(world4) -> None:
    """2 micro-batches go through each stage, yet each stage's 3 FSDP units reduce once."""
    for events in world4["pp2_fsdp2"]["stage_events"]:
        assert events == ["reduce_scatter"] * 3, events


def test_gathered_parameters_are_the_model(world2, reference) -> None:
    """Pipeline stages together hold every parameter exactly once (checked while merging)."""
    got = world2["pp2_interleaved"]["params"]
    assert sum(p.numel() for p in got.values()) == load_config(None, BASE).model.num_params()
    assert all(isinstance(p, torch.Tensor) and p.device.type == "cpu" for p in got.values())


def test_llmscale_train_under_torchrun(reference, tmp_path) -> None:
    """The CLI itself, 2 pipeline ranks: rank 0 (first stage) prints and logs the true loss."""
    run = tmp_path / "cli"
    r = torchrun(2, "-m", "llmscale", "train", *BASE, "--job.run_dir", str(run), *_p(pp=2))
    rows = [x for x in read_jsonl(run / "metrics.jsonl") if x["kind"] == "train"]
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    for x, want in zip(rows, reference["losses"], strict=True):
        assert rel_error(x["loss"], want) < RTOL
    assert r.stdout.count("step     1 ") == 1, r.stdout  # one rank prints
    assert "pp=2 (2 ranks)" in r.stdout
