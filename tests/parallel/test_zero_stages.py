"""ZeRO 1, 2 and 3 gather and reduce as `stack.residency` says, counted from the runtime, and
train alike; an uneven interleaved split trains like one process.

Without a pipeline (2 ranks, dp_shard 2, 4 micro-batches per rank) every step's four counts
(`param_allgathers`, `grad_reduces` and their bytes) equal `predict_collectives`; with pp 2 x
dp_shard 2 (4 ranks, 1F1B, 4 micro-batches) every step after the first does on both pipeline
ranks, the first under zero 1 and 2 too. Losses equal one process to 1e-5 under every stage.
The all-reduces across replicas (`grad_allreduces` and their bytes) of dp_replicate 2 (2 ranks,
`replicate`) and HSDP 2 x 2 (4 ranks) equal the rule, measured and in prediction.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_harness import RTOL, rel_error, run_layouts, single_process_reference

from llmscale.config import load_config
from llmscale.plan.schedule import schedule_ops
from llmscale.stack.residency import predict_collectives

pytestmark = pytest.mark.slow

STEPS = ["--train.steps", "3"]
ACCUM4 = ["--train.global_batch_size", "16"]  # micro-batches of 2, dp 2: 4 per rank
UNEVEN = ["--model.n_layers", "6"]  # over pp 2 x 2 chunks: 1, 2, 2, 1 layers per stage
KEYS = ("param_allgathers", "grad_reduces", "param_allgather_bytes", "grad_reduce_bytes")


def _zero(z: int, *extra: str) -> list[str]:
    return [*STEPS, *ACCUM4, "--parallel.dp_shard", "2", "--parallel.zero_stage", str(z), *extra]


DP_REPLICATE2 = [*STEPS, *ACCUM4, "--parallel.dp_replicate", "2"]  # replicate: all-reduce
HSDP = [*STEPS, "--train.global_batch_size", "16", "--parallel.dp_replicate", "2"]
WORLD2 = {
    **{f"zero{z}": _zero(z) for z in (1, 2, 3)},
    "dp_replicate2": DP_REPLICATE2,
    "uneven_interleaved": [
        *STEPS,
        *UNEVEN,
        *("--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b"),
        *("--parallel.pp_chunks", "2"),
    ],
}
PP2 = ("--parallel.pp", "2", "--parallel.pp_schedule", "1f1b")
WORLD4 = {
    **{f"pp2_zero{z}": _zero(z, *PP2) for z in (1, 2, 3)},
    # HSDP: dp_replicate 2 x dp_shard 2, 2 micro-batches per rank, zero 2 (a reduce-scatter
    # and an all-reduce of its output per unit and micro-batch)
    "hsdp_zero2": [*HSDP, "--parallel.dp_shard", "2", "--parallel.zero_stage", "2"],
}
KEYS6 = (*KEYS, "grad_allreduces", "grad_allreduce_bytes")


def _layouts(table: dict[str, list[str]]) -> list[dict[str, Any]]:
    return [{"name": n, "args": a} for n, a in table.items()]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("single")
    return {
        "accum4": single_process_reference(root / "accum4", (*STEPS, *ACCUM4)),
        "uneven": single_process_reference(root / "uneven", (*STEPS, *UNEVEN)),
    }


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return run_layouts(2, tmp_path_factory.mktemp("zero2"), _layouts(WORLD2))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return run_layouts(4, tmp_path_factory.mktemp("zero4"), _layouts(WORLD4))


def _rows(result: dict[str, Any], pp_rank: int) -> list[dict[str, Any]]:
    """Every step's metrics row of pipeline rank `pp_rank` (its dp rank 0)."""
    run_dir: Path = result["run_dir"]
    payload = torch.load(run_dir.parent / f"{run_dir.name}.stage{pp_rank}.pt", weights_only=False)
    return payload["rows"]


def _predicted(result: dict[str, Any]) -> dict[str, int]:
    """The run's prediction.json collectives (pipeline rank 0, a step after the first)."""
    return json.loads((result["run_dir"] / "prediction.json").read_text())["collectives"]


def _counts(row: dict[str, Any]) -> tuple[int, ...]:
    return tuple(row[k] for k in KEYS)


def _assert_losses(got: list[float], want: list[float], name: str) -> None:
    assert len(got) == len(want) == 3, (name, got)
    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        assert rel_error(a, b) < RTOL, f"{name} step {step}: loss {a} vs {b}"


@pytest.mark.parametrize("z", [1, 2, 3])
def test_zero_stage_counts_equal_the_rule(z, world2) -> None:
    model = load_config(None, []).model
    want = predict_collectives(model, dp_shard=2, zero_stage=z, microbatches=4).to_dict()
    rows = _rows(world2[f"zero{z}"], 0)
    assert len(rows) == 3
    for row in rows:
        assert _counts(row) == tuple(want[k] for k in KEYS), (z, row)
        assert row["grad_allreduces"] == row["grad_allreduce_bytes"] == 0
    assert _predicted(world2[f"zero{z}"]) == want  # what prediction.json carries
    # The table itself, on the tiny model's 5 units (4 blocks and the root):
    assert (want["param_allgathers"], want["grad_reduces"]) == {
        1: (5, 5),
        2: (5, 20),
        3: (40, 20),
    }[z]


def test_zero_stages_train_alike(world2, references) -> None:
    for z in (1, 2, 3):
        _assert_losses(world2[f"zero{z}"]["losses"], references["accum4"]["losses"], f"zero{z}")


@pytest.mark.parametrize("z", [1, 2, 3])
def test_zero_stage_counts_under_a_pipeline_equal_the_rule(z, world4, references) -> None:
    model = load_config(None, []).model
    result = world4[f"pp2_zero{z}"]
    _assert_losses(result["losses"], references["accum4"]["losses"], f"pp2_zero{z}")
    orders = schedule_ops("1f1b", 2, 4)
    for pp_rank in (0, 1):
        order = [(op.kind, op.stage) for op in orders[pp_rank]]
        for step, row in enumerate(_rows(result, pp_rank), 1):
            if step == 1 and z == 3:
                continue  # zero 3's first step under a pipeline is not modelled (residency)
            want = predict_collectives(
                model, dp_shard=2, zero_stage=z, microbatches=4, pp=2, schedule="1f1b",
                pp_rank=pp_rank, order=order, first_step=step == 1,
            )  # fmt: skip
            assert _counts(row) == tuple(want.to_dict()[k] for k in KEYS), (z, pp_rank, step, row)
        # torch's REDUCE_GRAD: one reduce-scatter per unit per step, whatever the zero stage
        assert row["grad_reduces"] == 3
    assert tuple(_predicted(result)[k] for k in KEYS) == _counts(_rows(result, 0)[-1])
    assert _rows(result, 0)[-1]["grad_allreduces"] == _predicted(result)["grad_allreduces"] == 0


@pytest.mark.parametrize(
    ("name", "world", "want"),
    [
        # replicate: one all-reduce of each of the 5 units' whole gradients per step (zero 1's
        # rule), nothing gathered or reduce-scattered
        ("dp_replicate2", "world2", (0, 0, 0, 0, 5, 923_904)),
        # HSDP: per micro-batch (2 per rank) a reduce-scatter of each unit and an all-reduce of
        # its output (half the unit) across the replicas
        ("hsdp_zero2", "world4", (5, 10, 923_904, 1_847_808, 10, 923_904)),
    ],
)
def test_replica_all_reduces_equal_the_rule(name, world, want, request, references) -> None:
    result = request.getfixturevalue(world)[name]
    _assert_losses(result["losses"], references["accum4"]["losses"], name)
    rows = _rows(result, 0)
    assert len(rows) == 3
    for row in rows:
        assert tuple(row[k] for k in KEYS6) == want, (name, row)
    assert tuple(_predicted(result)[k] for k in KEYS6) == want  # prediction.json


def test_uneven_interleaved_split_equals_one_process(world2, references) -> None:
    got, ref = world2["uneven_interleaved"], references["uneven"]
    _assert_losses(got["losses"], ref["losses"], "uneven_interleaved")
    assert rel_error(got["val_loss"], ref["val_loss"]) < RTOL
    assert set(got["params"]) == set(ref["params"])
    for k, want in ref["params"].items():
        assert rel_error(got["params"][k], want) < RTOL, k
