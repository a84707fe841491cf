"""Tied embeddings under pipeline parallelism train exactly like one process.

The tied tiny model with 8 layers, 3 steps of 4 micro-batches (parallel_harness.BASE; the GB16
layouts: a global batch of 16, against their own one-process run), fp32, gloo; one torchrun per world size trains every layout of it in turn (tied_worker.py: the
layout worker's loop, hashing the tied weights after every step), and the tests below read its
outputs. Each layout's losses, gradient norms (the tied weight counted once, as one process
counts it), validation loss and final parameters equal the single-process run to 1e-5
relative. Where the last stage keeps a copy of the embedding (`output.weight`), the copy equals
the embedding bit for bit after every step; in a V (zbv, dualpipev), with or without FSDP2, pp
rank 0 holds one tensor and all-reduces nothing. Every rank's data-parallel and
tied all-reduce counts equal the planner's (`plan_collectives`). A checkpoint written under
pp = 2 (1F1B's copy, or ZB-V's one tensor) resumes under pp = 1 with the same losses, and one
written under pp = 1 resumes under pp = 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_harness import (
    BASE,
    HERE,
    RTOL,
    assert_same_run,
    rel_error,
    run_layouts,
    single_process_reference,
)

from llmscale.config import load_config
from llmscale.hf.folder import read_llama_folder
from llmscale.inference.export import export_run
from llmscale.plan import activations as act
from llmscale.plan.memory import MemoryOptions
from llmscale.plan.predict import as_plan, expected_runtime_metrics, plan_collectives
from llmscale.train.metrics import read_jsonl
from llmscale.train.trainer import Trainer

STEPS = 3
GB16 = ["--train.global_batch_size", "16"]
# 8 layers: pp 4 x 2 chunks (interleaved) is 8 stages of one layer each.
TIED = ("--model.tie_embeddings", "true", "--model.n_layers", "8", "--train.steps", str(STEPS))
EMB, COPY = "tok_embeddings.weight", "output.weight"
CKPT = ("--checkpoint.enabled", "true", "--checkpoint.keep_last", "5")
CPU = MemoryOptions(kernels=act.RUNTIME_CPU)
COUNTS = (
    "param_allgathers", "grad_reduces", "param_allgather_bytes", "grad_reduce_bytes",
    "grad_allreduces", "grad_allreduce_bytes",
)  # fmt: skip


def _p(**degrees: Any) -> list[str]:
    args: list[str] = []
    for k, v in degrees.items():
        args += [f"--parallel.{k}", str(v).lower()]
    return args


WORLD2 = {
    "tied_pp2_1f1b": _p(pp=2, pp_schedule="1f1b"),
    "tied_pp2_zero_bubble": _p(pp=2, pp_schedule="zero_bubble", pp_chunks=2),  # ZB1P
    "tied_pp2_zbv": _p(pp=2, pp_schedule="zbv"),  # a V: one tensor
    # the copy alone on the last stage (no block), and over n_layers + 2 = 10 stages the
    # embedding alone on the first and the copy alone on the last (the automatic split)
    "tied_pp2_head_alone": _p(pp=2, pp_layers="[8, 0]"),
    "tied_pp2_v5_ends_alone": _p(pp=2, pp_schedule="interleaved_1f1b", pp_chunks=5),
}
WORLD4 = {
    "tied_pp2_fsdp2": _p(pp=2, dp_shard=2),
    "tied_pp2_tp2_sp": _p(pp=2, tp=2, sequence_parallel=True),
    "tied_pp4_gpipe": _p(pp=4, pp_schedule="gpipe"),  # the embedding group of pp ranks 0, 3
    # stages 0 and 4 on pp rank 0, 3 and 7 on pp rank 3: the embedding group of pp ranks 0, 3
    "tied_pp4_interleaved": _p(pp=4, pp_schedule="interleaved_1f1b", pp_chunks=2),
    "tied_pp2_dp_replicate2": _p(pp=2, dp_replicate=2),
    # a V under FSDP2: one tensor in the last stage's root unit, zero 3 (the default) and 1
    "tied_pp2_zbv_fsdp2": _p(pp=2, pp_schedule="zbv", dp_shard=2),
    "tied_pp2_zbv_fsdp2_zero1": _p(pp=2, pp_schedule="zbv", dp_shard=2, zero_stage=1),
    # DualPipeV needs 2 pp micro-batches per rank: the global batch of 16 (its own reference)
    "tied_pp2_dualpipev_fsdp2": [*_p(pp=2, pp_schedule="dualpipev", dp_shard=2), *GB16],
}
# HSDP (dp_replicate 2 x dp_shard 2) under a tied pipeline: 2 micro-batches per rank
WORLD8 = {
    "tied_pp2_hsdp": [*_p(pp=2, dp_replicate=2, dp_shard=2), *GB16],
    "tied_pp2_zbv_hsdp": [*_p(pp=2, pp_schedule="zbv", dp_replicate=2, dp_shard=2), *GB16],
}
LAYOUTS = {**WORLD2, **WORLD4, **WORLD8}
SHARED = {n for n in LAYOUTS if "zbv" in n or "dualpipev" in n} | {"from_hf"}  # a V
# Trained in the world-2 group after the layouts above: saved under pp = 2 after step 2 (then
# resumed here under pp = 1), and resumed under pp = 2 from a pp = 1 checkpoint of step 2.
RESUME2 = [
    {"name": "to_pp1_save", "run": "to_pp1", "args": [*_p(pp=2), *CKPT, "--checkpoint.stop_after", "2"]},
    {"name": "zbv_to_pp1_save", "run": "zbv_to_pp1", "args": [*_p(pp=2, pp_schedule="zbv"), *CKPT, "--checkpoint.stop_after", "2"]},
    {"name": "from_pp1_load", "run": "from_pp1", "args": [*_p(pp=2), *CKPT, "--checkpoint.resume", "true"]},
]  # fmt: skip
# A tied Hugging Face folder (exported from the pp = 1 checkpoint of step 2) starts a pp = 2
# run of 2 steps (dualpipev: one tensor on pp rank 0 for the embedding and the head).
FROM_HF = ("--train.steps", "2")

pytestmark = pytest.mark.slow


def _run(nproc: int, out: Path, layouts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Train `layouts` in one torchrun group (tied_worker.py); per layout run_layouts' merged
    result, plus every pp rank's metrics rows (`pp_rows`) and tied tensor count (`tensors`),
    the tied weights' hashes after every step by name (`hashes`), and rank 0's metrics rows."""
    results = run_layouts(nproc, out, layouts, base=[*BASE, *TIED], worker=HERE / "tied_worker.py")
    for layout in layouts:
        merged = results[layout["name"]]
        stages = merged["stages"]  # by pp rank
        merged["pp_rows"] = [d["rows"] for d in stages]
        merged["tensors"] = [d["tied_tensors"] for d in stages]
        merged["hashes"] = [{} for _ in stages[0]["hashes"]]
        for d in stages:
            for mine, step in zip(merged["hashes"], d["hashes"], strict=True):
                mine.update(step)
        rows = read_jsonl(merged["run_dir"] / "metrics.jsonl")
        merged["rows"] = [r for r in rows if r["kind"] == "train"]
    return results


def _in_process(run_dir: Path, *args: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    t = Trainer(load_config(None, [*BASE, *TIED, "--job.run_dir", str(run_dir), *args]))
    with t:
        r = t.fit()
        return r.losses, {n: p.detach().clone() for n, p in t.model.named_parameters()}


def _reference(run_dir: Path, *extra: str) -> dict[str, Any]:
    ref = single_process_reference(run_dir, (*TIED, *extra))
    ref["rows"] = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    return ref


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    return _reference(tmp_path_factory.mktemp("single") / "run")


@pytest.fixture(scope="module")
def reference16(tmp_path_factory) -> dict[str, Any]:
    """One process on the global batch of 16 (the layouts with GB16)."""
    return _reference(tmp_path_factory.mktemp("single16") / "run", *GB16)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("tied2")
    # The pp = 1 checkpoint of step 2 that `from_pp1_load` resumes under pp = 2.
    _in_process(out / "from_pp1", *CKPT, "--checkpoint.stop_after", "2")
    hf = export_run(out / "from_pp1", out / "hf", step=2).out
    init_hf = ("--checkpoint.init_from", f"hf:{hf}", *FROM_HF)
    from_hf = {"name": "from_hf", "args": [*_p(pp=2, pp_schedule="dualpipev"), *init_hf]}
    layouts = [{"name": n, "args": a} for n, a in WORLD2.items()] + [*RESUME2, from_hf]
    results = _run(2, out, layouts)
    losses, params = _in_process(out / "from_hf_pp1", *init_hf)
    results["from_hf_pp1"] = {"losses": losses, "params": params}
    results["out"] = out
    # `to_pp1_save`'s and `zbv_to_pp1_save`'s pp = 2 checkpoints of step 2 (the copy, and one
    # tensor in a V), resumed here under pp = 1.
    for run in ("to_pp1", "zbv_to_pp1"):
        losses, params = _in_process(out / run, *CKPT, "--checkpoint.resume", "true")
        results[f"{run}_load"] = {"losses": losses, "params": params}
    return results


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return _run(
        4, tmp_path_factory.mktemp("tied4"), [{"name": n, "args": a} for n, a in WORLD4.items()]
    )


@pytest.fixture(scope="module")
def world8(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return _run(
        8, tmp_path_factory.mktemp("tied8"), [{"name": n, "args": a} for n, a in WORLD8.items()]
    )


def _got(name: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Layout `name`'s result, from its world size's group."""
    for world, table in (("world2", WORLD2), ("world4", WORLD4), ("world8", WORLD8)):
        if name in table:
            return request.getfixturevalue(world)[name]  # type: ignore[no-any-return]
    raise KeyError(name)


def _ref(name: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The one-process run on layout `name`'s global batch."""
    return request.getfixturevalue("reference16" if GB16[1] in LAYOUTS[name] else "reference")  # type: ignore[no-any-return]


def _one_tensor(got: dict[str, Any], name: str) -> dict[str, torch.Tensor]:
    """The layout's parameters under one process's names, after checking the tied weight: one
    tensor on pp rank 0 in a V (named `output.weight`, the head's), else the copy equal to the
    embedding bit for bit after every step and at the end."""
    params = dict(got["params"])
    if name in SHARED:
        assert got["tensors"][0] == 1, name  # the embedding reads the head's very tensor
        assert EMB not in params and all(set(h) == {COPY} for h in got["hashes"]), name
        params[EMB] = params.pop(COPY)
        return params
    for step, h in enumerate(got["hashes"], 1):
        assert h[EMB] == h[COPY], f"{name} step {step}: the copy differs from the embedding"
    assert torch.equal(params.pop(COPY), params[EMB]), name
    return params


def _check_layout(got: dict[str, Any], ref: dict[str, Any], name: str) -> None:
    assert len(got["hashes"]) == STEPS, name
    assert_same_run({**got, "params": _one_tensor(got, name)}, ref, name, steps=STEPS)
    # The gradient norm counts the tied weight once, as one process does.
    for a, b in zip(got["rows"], ref["rows"], strict=True):
        assert rel_error(a["grad_norm"], b["grad_norm"]) < RTOL, (name, a["step"], a, b)


@pytest.mark.parametrize("name", list(WORLD2))
def test_tied_pp_two_ranks_equal_one_process(name, request) -> None:
    _check_layout(_got(name, request), _ref(name, request), name)


@pytest.mark.parametrize("name", list(WORLD4))
def test_tied_pp_four_ranks_equal_one_process(name, request) -> None:
    _check_layout(_got(name, request), _ref(name, request), name)


@pytest.mark.parametrize("name", list(WORLD8))
def test_tied_pp_eight_ranks_equal_one_process(name, request) -> None:
    """HSDP under a tied pipeline: the copy's all-reduce (1F1B) or one tensor (ZB-V) beside
    HSDP's per-unit all-reduces across the replicas."""
    _check_layout(_got(name, request), _ref(name, request), name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tied_all_reduces_equal_the_planners(name, request) -> None:
    """Every pp rank's collectives (metrics rows) equal `plan_collectives`: the tied
    all-reduce once per step on pp ranks 0 and pp - 1 (of the local embedding gradient: a
    shard under FSDP2), none in a V; replicate's and FSDP2's counted beside it. Under FSDP2 the
    first step's shape inference gathers once more (not compared); under tp > 1 the planner
    does not predict (the tied all-reduce is then the whole tensor)."""
    got = _got(name, request)
    cfg = load_config(None, [*BASE, *TIED, *LAYOUTS[name]])
    plan = as_plan(cfg)
    v, d = cfg.model.vocab_size, cfg.model.dim
    assert len(got["pp_rows"]) == cfg.parallel.pp
    for rank, rows in enumerate(got["pp_rows"]):
        assert len(rows) == STEPS, (name, rank)
        want = plan_collectives(plan, rank)
        if want is None:  # tp 2: the tied all-reduce alone, of the whole (replicated) tensor
            assert cfg.parallel.tp == 2
            want = {k: 0 for k in COUNTS} | {
                "grad_allreduces": 1,
                "grad_allreduce_bytes": 4 * v * d,
            }
        for step, row in enumerate(rows, 1):
            if step == 1 and cfg.parallel.dp_shard > 1:
                continue
            assert {k: row[k] for k in COUNTS} == want, (name, rank, step)
        assert want["grad_allreduces"] == ALLREDUCES[name][rank], (name, rank)
        if ALLREDUCES[name][rank] == 1:  # the tied all-reduce alone: the local gradient
            local = v * d // cfg.parallel.dp_shard
            assert want["grad_allreduce_bytes"] == 4 * local, (name, rank)


# All-reduces per step of each pp rank: the tied one on pp ranks 0 and pp - 1, none in a V;
# under dp_replicate 2 also one per FSDP unit (4 blocks and the root on each rank).
ALLREDUCES = {
    "tied_pp2_1f1b": [1, 1],
    "tied_pp2_zero_bubble": [1, 1],
    "tied_pp2_zbv": [0, 0],
    "tied_pp2_fsdp2": [1, 1],
    "tied_pp2_tp2_sp": [1, 1],
    "tied_pp4_gpipe": [1, 0, 0, 1],
    "tied_pp4_interleaved": [1, 0, 0, 1],
    "tied_pp2_dp_replicate2": [6, 6],
    "tied_pp2_zbv_fsdp2": [0, 0],
    "tied_pp2_zbv_fsdp2_zero1": [0, 0],
    "tied_pp2_dualpipev_fsdp2": [0, 0],
    "tied_pp2_head_alone": [1, 1],
    "tied_pp2_v5_ends_alone": [1, 1],
    # HSDP: one all-reduce per unit (4 blocks, and the root) and the tied one; in a V pp rank 0's
    # first stage has no root unit (the tied weight is the last stage's)
    "tied_pp2_hsdp": [6, 6],
    "tied_pp2_zbv_hsdp": [5, 4],
}


def test_tied_checkpoint_reshards_between_pp2_and_pp1(world2, reference) -> None:
    ref = reference["losses"]
    for name in ("to_pp1_save", "zbv_to_pp1_save"):
        saved = world2[name]
        assert saved["steps_done"] == 2
        for a, b in zip(saved["losses"], ref[:2], strict=True):
            assert rel_error(a, b) < RTOL
    for name in ("to_pp1_load", "zbv_to_pp1_load", "from_pp1_load"):  # step 3 after the resume
        got = world2[name]
        assert len(got["losses"]) == 1, name
        for a, b in zip(got["losses"], ref[2:], strict=True):
            assert rel_error(a, b) < RTOL, (name, a, b)
        params = dict(got["params"])
        if COPY in params:  # pp = 2: the copy was loaded from the embedding's one tensor
            assert torch.equal(params.pop(COPY), params[EMB]), name
        assert set(params) == set(reference["params"]), name
        for k, want in reference["params"].items():
            assert rel_error(params[k], want) < RTOL, (name, k)


def test_tied_pp2_checkpoint_exports_a_tied_hf_folder(world2) -> None:
    """The pp = 2 checkpoint of step 2 exports as a tied model holding the run's embedding."""
    saved = world2["to_pp1_save"]["params"]  # the pp = 2 run's weights when it stopped at 2
    out = world2["out"] / "hf_from_pp2"
    export_run(world2["out"] / "to_pp1", out, step=2)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    model, sd = read_llama_folder(out)
    assert model.tie_embeddings and COPY not in sd
    assert torch.equal(sd[EMB], saved[EMB]) and torch.equal(sd[EMB], saved[COPY])


def test_init_from_tied_hf_folder_into_pp2(world2) -> None:
    """`init_from hf:` a tied folder: the pp = 2 dualpipev run (one tensor on pp rank 0,
    loaded from the folder's embedding) trains like the pp = 1 run from the same folder."""
    got, ref = world2["from_hf"], world2["from_hf_pp1"]
    assert len(got["losses"]) == len(ref["losses"]) == 2
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert rel_error(a, b) < RTOL, (a, b)
    params = _one_tensor(got, "from_hf")
    for k, want in ref["params"].items():
        assert rel_error(params[k], want) < RTOL, k


@pytest.mark.parametrize(
    "name",
    [
        "tied_pp2_1f1b",
        "tied_pp2_zbv",
        "tied_pp2_fsdp2",
        "tied_pp2_zbv_fsdp2",
        "tied_pp2_dualpipev_fsdp2",
        "tied_pp4_interleaved",
        "tied_pp2_zbv_hsdp",
    ],
)
def test_planner_predicts_each_stage_memory_with_the_copy(name, request) -> None:
    """param_bytes, grad_bytes and optimizer_bytes of every pipeline rank (the copy on the last
    pp rank, sharded under FSDP2; none in a V) equal the planner's expectation exactly."""
    got = _got(name, request)
    cfg = load_config(None, [*BASE, *TIED, *LAYOUTS[name]])
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
    v, d, shard = cfg.model.vocab_size, cfg.model.dim, cfg.parallel.dp_shard
    for rank, rows in enumerate(got["pp_rows"]):
        want = expected_runtime_metrics(cfg, rank=rank, options=CPU)
        assert {k: rows[0][k] for k in keys} == {k: want[k] for k in keys}, (name, rank)
    # The copy: the last pp rank's parameters beyond the split's (sharded); a V holds none, its
    # two ranks together the one process's parameters.
    one = expected_runtime_metrics(load_config(None, [*BASE, *TIED]), rank=0, options=CPU)
    held = sum(rows[0]["param_bytes"] for rows in got["pp_rows"]) * shard
    assert held - one["param_bytes"] == (0 if name in SHARED else 4 * v * d), name
