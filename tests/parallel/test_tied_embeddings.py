"""Tied embeddings under pipeline parallelism train exactly like one process.

A tied tiny model of 8 layers, 5 steps of 4 micro-batches (parallel_harness.BASE), fp32, gloo.
Each layout's losses, gradient norms (the tied weight counted once, as one process counts it),
validation loss and final parameters equal the single-process run to 1e-5 relative; the last
stage's copy of the embedding (`output.weight`) equals the embedding bit for bit after every
step; a checkpoint written under pp = 2 resumes under pp = 1 with the same losses, and one
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
    single_process_reference,
    torchrun,
)

from llmscale.config import load_config
from llmscale.hf.folder import read_llama_folder
from llmscale.inference.export import export_run
from llmscale.plan import activations as act
from llmscale.plan.memory import MemoryOptions
from llmscale.plan.predict import expected_runtime_metrics
from llmscale.train.metrics import read_jsonl
from llmscale.train.trainer import Trainer

TIED = ("--model.tie_embeddings", "true", "--model.n_layers", "8")
EMB, COPY = "tok_embeddings.weight", "output.weight"
CKPT = ("--checkpoint.enabled", "true", "--checkpoint.keep_last", "5")
CPU = MemoryOptions(kernels=act.RUNTIME_CPU)


def _p(**degrees: Any) -> list[str]:
    args: list[str] = []
    for k, v in degrees.items():
        args += [f"--parallel.{k}", str(v).lower()]
    return args


WORLD2 = {
    "tied_pp2_1f1b": _p(pp=2, pp_schedule="1f1b"),
    "tied_pp2_zbv": _p(pp=2, pp_schedule="zbv"),
}
WORLD4 = {
    "tied_pp2_fsdp2": _p(pp=2, dp_shard=2),
    "tied_pp2_tp2_sp": _p(pp=2, tp=2, sequence_parallel=True),
    "tied_pp4_interleaved": _p(pp=4, pp_schedule="interleaved_1f1b", pp_chunks=2),
}
# Trained in the world-2 group after the layouts above: saved under pp = 2 after step 3 (then
# resumed here under pp = 1), and resumed under pp = 2 from a pp = 1 checkpoint of step 3.
RESUME2 = [
    {"name": "to_pp1_save", "run": "to_pp1", "args": [*_p(pp=2), *CKPT, "--checkpoint.stop_after", "3"]},
    {"name": "from_pp1_load", "run": "from_pp1", "args": [*_p(pp=2), *CKPT, "--checkpoint.resume", "true"]},
]  # fmt: skip
# A tied Hugging Face folder (exported from the pp = 1 checkpoint of step 3) starts a pp = 2
# run of 2 steps (dualpipev: the copy on pp rank 0 beside the embedding).
FROM_HF = ("--train.steps", "2")

pytestmark = pytest.mark.slow


def _run(nproc: int, out: Path, layouts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Train `layouts` in one torchrun group (tied_worker.py); per layout the merged stages:
    losses, validation loss, parameters, the tied weights' hashes after every step by name,
    and the rank-0 metrics rows."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "base": [*BASE, *TIED], "layouts": layouts}))
    torchrun(nproc, str(HERE / "tied_worker.py"), str(spec))
    results = {}
    for layout in layouts:
        name = layout["name"]
        files = sorted(out.glob(f"{name}.stage*.pt"))
        assert files, f"{name}: no results written"
        merged: dict[str, Any] = {"params": {}, "hashes": None, "first_rows": []}
        for f in files:
            d = torch.load(f, weights_only=False)
            merged["first_rows"].append(d["first_row"])  # by pp rank
            assert not set(d["params"]) & set(merged["params"]), name
            merged["params"].update(d["params"])
            if merged["hashes"] is None:
                merged["hashes"] = [{} for _ in d["hashes"]]
            for mine, step in zip(merged["hashes"], d["hashes"], strict=True):
                mine.update(step)
            for k in ("losses", "val_loss", "steps_done"):
                merged.setdefault(k, d[k])
        merged["rows"] = [
            r
            for r in read_jsonl(out / layout.get("run", name) / "metrics.jsonl")
            if r["kind"] == "train"
        ]
        results[name] = merged
    return results


def _in_process(run_dir: Path, *args: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    t = Trainer(load_config(None, [*BASE, *TIED, "--job.run_dir", str(run_dir), *args]))
    with t:
        r = t.fit()
        return r.losses, {n: p.detach().clone() for n, p in t.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    ref = single_process_reference(run_dir, TIED)
    ref["rows"] = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    return ref


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("tied2")
    # The pp = 1 checkpoint of step 3 that `from_pp1_load` resumes under pp = 2.
    _in_process(out / "from_pp1", *CKPT, "--checkpoint.stop_after", "3")
    hf = export_run(out / "from_pp1", out / "hf", step=3).out
    init_hf = ("--checkpoint.init_from", f"hf:{hf}", *FROM_HF)
    from_hf = {"name": "from_hf", "args": [*_p(pp=2, pp_schedule="dualpipev"), *init_hf]}
    layouts = [{"name": n, "args": a} for n, a in WORLD2.items()] + [*RESUME2, from_hf]
    results = _run(2, out, layouts)
    losses, params = _in_process(out / "from_hf_pp1", *init_hf)
    results["from_hf_pp1"] = {"losses": losses, "params": params}
    results["out"] = out
    # `to_pp1_save`'s pp = 2 checkpoint of step 3, resumed here under pp = 1.
    losses, params = _in_process(out / "to_pp1", *CKPT, "--checkpoint.resume", "true")
    results["to_pp1_load"] = {"losses": losses, "params": params}
    return results


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return _run(
        4, tmp_path_factory.mktemp("tied4"), [{"name": n, "args": a} for n, a in WORLD4.items()]
    )


def _check_layout(got: dict[str, Any], ref: dict[str, Any], name: str) -> None:
    hashes = got["hashes"]
    assert len(hashes) == 5
    for step, h in enumerate(hashes, 1):
        assert h[EMB] == h[COPY], f"{name} step {step}: the copy differs from the embedding"
    params = dict(got["params"])
    assert torch.equal(params.pop(COPY), params[EMB]), name
    assert_same_run({**got, "params": params}, ref, name)
    # The gradient norm counts the tied weight once, as one process does.
    for a, b in zip(got["rows"], ref["rows"], strict=True):
        assert rel_error(a["grad_norm"], b["grad_norm"]) < RTOL, (name, a["step"], a, b)


@pytest.mark.parametrize("name", list(WORLD2))
def test_tied_pp_two_ranks_equal_one_process(name, world2, reference) -> None:
    _check_layout(world2[name], reference, name)


@pytest.mark.parametrize("name", list(WORLD4))
def test_tied_pp_four_ranks_equal_one_process(name, world4, reference) -> None:
    _check_layout(world4[name], reference, name)


def test_tied_checkpoint_reshards_between_pp2_and_pp1(world2, reference) -> None:
    ref = reference["losses"]
    saved = world2["to_pp1_save"]
    assert saved["steps_done"] == 3
    for a, b in zip(saved["losses"], ref[:3], strict=True):
        assert rel_error(a, b) < RTOL
    for name in ("to_pp1_load", "from_pp1_load"):  # steps 4 and 5 after the resume
        got = world2[name]
        assert len(got["losses"]) == 2, name
        for a, b in zip(got["losses"], ref[3:], strict=True):
            assert rel_error(a, b) < RTOL, (name, a, b)
        params = dict(got["params"])
        if COPY in params:  # pp = 2: the copy was loaded from the embedding's one tensor
            assert torch.equal(params.pop(COPY), params[EMB]), name
        assert set(params) == set(reference["params"]), name
        for k, want in reference["params"].items():
            assert rel_error(params[k], want) < RTOL, (name, k)


def test_tied_pp2_checkpoint_exports_a_tied_hf_folder(world2) -> None:
    """The pp = 2 checkpoint of step 3 exports as a tied model holding the run's embedding."""
    saved = world2["to_pp1_save"]["params"]  # the pp = 2 run's weights when it stopped at 3
    out = world2["out"] / "hf_from_pp2"
    export_run(world2["out"] / "to_pp1", out, step=3)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    model, sd = read_llama_folder(out)
    assert model.tie_embeddings and COPY not in sd
    assert torch.equal(sd[EMB], saved[EMB]) and torch.equal(sd[EMB], saved[COPY])


def test_init_from_tied_hf_folder_into_pp2(world2) -> None:
    """`init_from hf:` a tied folder: the pp = 2 run (its copy loaded from the embedding) trains
    like the pp = 1 run from the same folder."""
    got, ref = world2["from_hf"], world2["from_hf_pp1"]
    assert len(got["losses"]) == len(ref["losses"]) == 2
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert rel_error(a, b) < RTOL, (a, b)
    for h in got["hashes"]:
        assert h[EMB] == h[COPY]
    params = dict(got["params"])
    assert torch.equal(params.pop(COPY), params[EMB])
    for k, want in ref["params"].items():
        assert rel_error(params[k], want) < RTOL, k


@pytest.mark.parametrize("name", ["tied_pp2_1f1b", "tied_pp2_zbv", "tied_pp2_fsdp2"])
def test_planner_predicts_each_stage_memory_with_the_copy(name, world2, world4) -> None:
    """param_bytes, grad_bytes and optimizer_bytes of every pipeline rank (the copy on pp rank
    1, or 0 in a V; sharded under FSDP) equal the planner's expectation exactly."""
    got = {**world2, **world4}[name]
    args = {**WORLD2, **WORLD4}[name]
    cfg = load_config(None, [*BASE, *TIED, *args])
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
    copy_bytes = 4 * cfg.model.vocab_size * cfg.model.dim // cfg.parallel.dp_shard
    for rank, row in enumerate(got["first_rows"]):
        want = expected_runtime_metrics(cfg, rank=rank, options=CPU)
        assert {k: row[k] for k in keys} == {k: want[k] for k in keys}, (name, rank)
    # The copy is counted: the rank holding the last stage holds it beyond its layers.
    last = 0 if "zbv" in name else 1
    assert got["first_rows"][last]["param_bytes"] >= copy_bytes
