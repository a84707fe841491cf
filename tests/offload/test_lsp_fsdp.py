"""LSP-Offload under data parallelism: FSDP2 row shards (offload/lsp_shard.py) and replicate.

Two gloo ranks train the layout tests' job (tests/parallel's harness: tiny preset cut to one
block, 3 steps of 8 sequences) with `optimizer.offload = "lsp"`, checking every 2 steps and
always refitting at a check (steps 0 and 2: a fit, then a refit with moment re-projection). Under data parallelism
the gradient hooks run once per step on the step's averaged gradient, so the reference is one
process taking the whole batch in one micro-batch: same gradients, same fits. Losses and the
gathered parameters must match it to the layout tests' 1e-5; a dp_shard=2 checkpoint resumes bit
for bit (across a refit) and loads into one process; each rank's bytes moved and ledger are the
planner's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from parallel_harness import (  # noqa: E402
    BASE,
    RTOL,
    rel_error,
    run_layouts,
    single_process_reference,
)

from llmscale.config import load_config  # noqa: E402
from llmscale.errors import ConfigError  # noqa: E402
from llmscale.plan.lsp import (  # noqa: E402
    lsp_bytes_per_step,
    lsp_memory,
    matrix_dims,
    one_process_split,
)
from llmscale.plan.predict import runtime_metric_bytes  # noqa: E402
from llmscale.train.metrics import read_jsonl  # noqa: E402
from llmscale.train.trainer import Trainer  # noqa: E402

STEPS = 3
LSP = [
    "--optimizer.offload", "lsp", "--model.n_layers", "1", "--train.steps", str(STEPS),
    "--optimizer.lsp_check_every", "2", "--optimizer.lsp_refit_threshold", "1e-9",
]  # fmt: skip
CKPT = ["--checkpoint.enabled", "true", "--checkpoint.keep_last", "5"]
LAYOUTS = {
    "lsp_fsdp2": ["--parallel.dp_shard", "2", *LSP],  # zero 3, 2 micro-batches per rank
    "lsp_fsdp2_z1": ["--parallel.dp_shard", "2", "--parallel.zero_stage", "1", *LSP],
    "lsp_dp2": ["--parallel.dp_replicate", "2", *LSP],
}
# bf16 weights, FSDP2's fp32 gradient reduction: trains like fp32 (not to 1e-5)
BF16 = {"lsp_fsdp2_bf16": ["--parallel.dp_shard", "2", "--precision.mode", "bf16", *LSP]}
# Four ranks: HSDP (replicate 2 x shard 2), the shard group a sub-group of the mesh.
LAYOUTS4 = {"lsp_hsdp2x2": ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", *LSP]}
RESUME = [
    {
        "name": "lsp_save",
        "run": "resume",
        "args": [*LAYOUTS["lsp_fsdp2"], *CKPT, "--checkpoint.stop_after", "2"],
    },
    {
        "name": "lsp_load",
        "run": "resume",
        "args": [*LAYOUTS["lsp_fsdp2"], *CKPT, "--checkpoint.resume", "true"],
    },
]
ONE_BATCH = ("--train.micro_batch_size", "8")  # one process, the step's gradient at once


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _assert_same_run(got: dict[str, Any], ref: dict[str, Any], name: str) -> None:
    """The harness's `assert_same_run` for STEPS steps: losses, validation loss, parameters."""
    assert got["steps_done"] == STEPS and len(got["losses"]) == len(ref["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True), 1):
        assert rel_error(a, b) < RTOL, f"{name} step {step}: loss {a} vs {b}"
    assert rel_error(got["val_loss"], ref["val_loss"]) < RTOL, name
    assert set(got["params"]) == set(ref["params"]), name
    for k, want in ref["params"].items():
        rel = rel_error(got["params"][k], want)
        assert rel < RTOL, f"{name} {k}: relative error {rel:.2e}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    ref = single_process_reference(run_dir, (*LSP, *ONE_BATCH))
    return {**ref, "run_dir": run_dir}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    layouts = [{"name": n, "args": a} for n, a in {**LAYOUTS, **BF16}.items()]
    return run_layouts(2, tmp_path_factory.mktemp("lsp2"), [*layouts, *RESUME], timeout=500)


@pytest.fixture(scope="module")
def runs4(tmp_path_factory) -> dict[str, dict[str, Any]]:
    layouts = [{"name": n, "args": a} for n, a in LAYOUTS4.items()]
    return run_layouts(4, tmp_path_factory.mktemp("lsp4"), layouts, timeout=500)


def _run(name: str, runs: dict[str, Any], runs4: dict[str, Any]) -> dict[str, Any]:
    return runs4[name] if name in LAYOUTS4 else runs[name]


def _args(name: str) -> list[str]:
    return {**LAYOUTS, **BF16, **LAYOUTS4}[name]


@pytest.mark.slow
@pytest.mark.timeout(600)  # the module's runs: 5 layouts on 2 ranks sharing a few cores
@pytest.mark.parametrize("name", [*LAYOUTS, *LAYOUTS4])
def test_lsp_under_data_parallelism_equals_one_process(name, runs, runs4, reference) -> None:
    run = _run(name, runs, runs4)
    _assert_same_run(run, reference, name)
    errs = [r["lsp_reconstruction_error"] for r in _rows(run["run_dir"])]
    want = [r["lsp_reconstruction_error"] for r in _rows(reference["run_dir"])]
    assert errs == pytest.approx(want, rel=1e-4)  # the same fits and checks


@pytest.mark.slow
def test_bf16_under_fsdp_trains_like_fp32(runs, reference) -> None:
    got = runs["lsp_fsdp2_bf16"]
    assert got["losses"] == pytest.approx(reference["losses"], abs=0.05)
    errs = [r["lsp_reconstruction_error"] for r in _rows(got["run_dir"])]
    assert all(0 < e < 1 for e in errs)


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_bit_for_bit_across_a_refit(runs) -> None:
    saved, resumed = runs["lsp_save"], runs["lsp_load"]
    assert saved["steps_done"] == 2 and resumed["steps_done"] == STEPS
    assert resumed["losses"] == runs["lsp_fsdp2"]["losses"][2:]  # step 2 refits after the load
    for k, p in resumed["params"].items():
        assert torch.equal(p, runs["lsp_fsdp2"]["params"][k]), k


@pytest.mark.slow
def test_fsdp_checkpoint_loads_into_one_process(runs, tmp_path) -> None:
    """The LSP state is whole on every rank (projectors, d x d moments): a dp_shard=2 checkpoint
    resumes under dp_shard=1, where the rest reshards as DCP does."""
    run_dir = tmp_path / "run"  # the dp_shard=2 run as it stood after 2 steps
    shutil.copytree(runs["lsp_save"]["run_dir"], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step-{STEPS:06d}")  # lsp_load's last
    args = [*BASE, *LSP, *CKPT, "--checkpoint.resume", "true"]
    t = Trainer(load_config(None, [*args, "--job.run_dir", str(run_dir)]))
    r = t.fit()
    assert r.steps_done == STEPS
    want = runs["lsp_fsdp2"]["losses"][2]
    assert abs(r.losses[0] - want) / abs(want) < 1e-5
    t.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", [*LAYOUTS, *BF16, *LAYOUTS4])
def test_bytes_moved_and_ledger_are_the_planners(name, runs, runs4) -> None:
    """Rank 0's `offload_bytes_moved`, step by step (a fit at step 0, a check and a refit at 2),
    and its ledger: the planner's for the layout."""
    cfg = load_config(None, [*BASE, *_args(name)])
    want = runtime_metric_bytes(cfg, device="cpu")
    steady = want.pop("offload_bytes_moved")
    rows = _rows(_run(name, runs, runs4)["run_dir"])
    assert len(rows) == STEPS
    for row in rows:
        assert {k: row[k] for k in want} == want
    kw = {
        "lsp_dim": cfg.optimizer.lsp_dim,
        "lsp_nonzeros": cfg.optimizer.lsp_nonzeros,
        "precision": cfg.precision.mode,
        "n_microbatches": cfg.n_microbatches,
        "dp_replicate": cfg.parallel.dp_replicate,
        "dp_shard": cfg.parallel.dp_shard,
    }
    refit = lsp_bytes_per_step(cfg.model, **kw, check=True, fit=True, refit=True)
    steps = [lsp_bytes_per_step(cfg.model, **kw, fit=True), lsp_bytes_per_step(cfg.model, **kw)]
    expect = [steps[0].total, steps[1].total, refit.total]
    assert [r["offload_bytes_moved"] for r in rows] == expect
    assert steady == steps[1].total


@pytest.mark.parametrize(
    "args, field",
    [
        (("--parallel.tp", "2"), "parallel.tp"),
        (("--parallel.pp", "2"), "parallel.pp"),
        (("--parallel.cp", "2"), "parallel.cp"),
        (("--parallel.dp_shard", "2", "--parallel.tp", "2"), "parallel.tp"),
    ],
)
def test_layouts_not_served_are_one_line_errors(args, field) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *LSP, *args])
    assert e.value.field == field and "\n" not in str(e.value)


def test_planner_per_rank_traffic_and_ledger() -> None:
    """Under FSDP2 the ZeRO path's share is rank 0's shard and moves once per step; each LSP
    matrix's d x d state and traffic are whole on every rank, as in one process."""
    cfg = load_config(None, [*BASE, *LSP])
    model, kw = cfg.model, {"lsp_dim": 512, "lsp_nonzeros": 16, "precision": "fp32"}
    one = lsp_memory(model, **kw, n_microbatches=1)
    two = lsp_memory(model, **kw, n_microbatches=1, dp_shard=2)
    sp1, sp2 = one_process_split(model), one_process_split(model, dp_shard=2)
    assert sp2.matrices == sp1.matrices and sp2.zero_tensors == sp1.zero_tensors
    assert 2 * sp2.zero_numel == sp1.zero_numel and 2 * sp2.matrix_numel == sp1.matrix_numel
    # whole projectors on each rank; P regrouped for the rank's rows only (8 B per non-zero)
    fewer = sum((m - -(-m // 2)) * matrix_dims((m, n), 512, 16)[1] * 8 for m, n in sp1.matrices)
    assert two["device_lsp_bytes"] == one["device_lsp_bytes"] - fewer > 0
    assert one["host_master_bytes"] == 2 * two["host_master_bytes"] == 4 * sp1.zero_numel
    assert one["param_bytes"] == 2 * two["param_bytes"]
    t1 = lsp_bytes_per_step(model, **kw, n_microbatches=4)
    t2 = lsp_bytes_per_step(model, **kw, n_microbatches=4, dp_shard=2)
    d2 = sum(4 * matrix_dims(m, 512, 16)[0] ** 2 for m in sp1.matrices)
    assert t1.down == 4 * (4 * sp1.zero_numel + d2)  # every micro-step
    assert t2.down == 4 * sp2.zero_numel + d2  # once per step (hooks after the reduction)
    assert t2.up == 4 * sp2.zero_numel + d2
    assert lsp_bytes_per_step(model, **kw, n_microbatches=4, dp_replicate=2).down == (
        4 * sp1.zero_numel + d2
    )


def test_dp_layouts_are_accepted() -> None:
    for args in [*LAYOUTS.values(), *BF16.values(), *LAYOUTS4.values()]:
        load_config(None, [*BASE, *args]).validate()
