"""`llmscale plan` with fixed dimensions, fits/why, exit codes, table width; bounded inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.schedule import MAX_STAGE_MICROBATCHES
from llmscale.plan.search import search
from llmscale.report.search_report import fixed_space

L70 = get_preset("llama2-70b")
H200 = Cluster.of("h200")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmscale", *args], capture_output=True, text=True, timeout=120
    )


def _flags(p: dict) -> list[str]:
    """The fixing flags of a JSON candidate's plan: every dimension."""
    return [
        "--tp", str(p["tp"]), "--pp", str(p["pp"]), "--dp-shard", str(p["dp_shard"]),
        "--dp-replicate", str(p["dp_replicate"]), "--mbs", str(p["micro_batch_size"]),
        "--recompute", p["recompute"], "--schedule", p["pp_schedule"],
        "--chunks", str(p["pp_chunks"]), "--zero-stage", str(p["zero_stage"]),
        "--sp" if p["sequence_parallel"] else "--no-sp", "--offload", p["offload"], "--cp", "1",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def searched() -> dict:
    r = _run("plan", "--gpus", "64", "--top", "10", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("rank", [0, 1, 4])
def test_one_fixed_layout_equals_the_searchs_candidate(searched: dict, rank: int) -> None:
    cand = searched["candidates"][rank]
    r = _run("plan", "--gpus", "64", "--json", *_flags(cand["plan"]))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["search"]["evaluated"] == 1 and len(out["candidates"]) == 1
    one = out["candidates"][0]
    assert one["plan"] == cand["plan"] and one["fits"] is True and one["why"] is None
    assert one["step_time"] == cand["step_time"]
    assert (
        one["memory_bytes"]["worst_stage"]["total"] == cand["memory_bytes"]["worst_stage"]["total"]
    )


def test_partial_fixing_searches_the_rest() -> None:
    r = _run("plan", "--gpus", "64", "--tp", "8", "--recompute", "selective", "--top", "5",
             "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    plans = [c["plan"] for c in out["candidates"]]
    assert len(plans) == 5 and {p["tp"] for p in plans} == {8}
    assert {p["recompute"] for p in plans} == {"selective"}
    assert len({(p["pp"], p["dp_shard"], p["micro_batch_size"], p["sequence_parallel"])
                for p in plans}) > 1  # fmt: skip
    assert out["inputs"]["fixed"] == {"tp": 8, "recompute": "selective"}
    # The same as the search API with that space, first candidate.
    space, _ = fixed_space(64, {"tp": 8, "recompute": "selective"})
    best = search(L70, 64, H200, 4096, 1024, top=5, space=space).candidates[0]
    assert out["candidates"][0]["step_time"]["seconds"] == best.time.seconds


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tp", "3"], "--tp 3 = 3 GPUs do not divide --gpus 64"),
        (["--tp", "8", "--pp", "2", "--dp-shard", "2", "--dp-replicate", "1"],
         "--tp 8 x --pp 2 x --dp-shard 2 x --dp-replicate 1 = 32 GPUs do not make --gpus 64"),
        (["--cp", "3"], "--cp 3 = 3 GPUs do not divide --gpus 64"),
        (["--tp", "8", "--pp", "4", "--dp-shard", "2", "--dp-replicate", "1", "--cp", "2"],
         "--tp 8 x --pp 4 x --dp-shard 2 x --dp-replicate 1 x --cp 2 = 128 GPUs do not divide"),
        (["--pp-layers", "20,20,20,10"], "summing to model.n_layers=80, got 70 (llama2-70b)"),
        (["--pp-layers", "20,20,20"], "--pp-layers 20,20,20 (pp 3) = 3 GPUs do not divide"),
        (["--pp", "2", "--pp-layers", "20,20,20"], "2 entries (pp 2 x chunks 1), got 3"),
        (["--pp-layers", "40,0,40"], "pp_layers: got '40,0,40'; allowed: layer counts >= 0"),
        (["--pp-layers=-1,41,40"], "pp_layers: got '-1,41,40'; allowed: layer counts >= 0"),
        (["--recompute", "some"], "recompute: got 'some'; allowed: none | full"),
        (["--zero-stage", "4"], "zero_stage: got 4"),
        (["--offload", "disk"], "offload: got 'disk'"),
        (["--chunks", "2", "--schedule", "gpipe"], "chunks: got 2"),
        (["--every-k", "2", "--recompute", "full"], "every_k: got 2"),
        (["--mbs", "0"], "mbs: got 0"),
        (["--tp", "1", "--sp"], "sp: got True"),
        (["--offload-activations", "-1"], "offload_activations: got -1"),
        (["--offload-activations", "8", "--pp", "2"], "pp: got 2; allowed: 1 with"),
        (["--offload-activations", "8", "--recompute", "full"], "recompute: got 'full'"),
        (["--offload-activations", "80"], "offload_activations: got 80; allowed: < the model"),
        (["--offload-activations", "8", "--stack", "torchtitan"],
         "train.offload_activations: got 8; allowed: 0 under --stack torchtitan"),
        (["--precision", "nvfp4"], "precision.mode: got 'nvfp4'; allowed: fp32 | bf16 | fp16 | "
         "fp8 under --stack llmscale (nvfp4: --stack megatron-core)"),
        (["--float8-recipe", "rowwise"],
         "float8_recipe: got 'rowwise'; allowed: tensorwise with --precision bf16"),
        (["--precision", "fp8", "--float8-recipe", "rowwise", "--stack", "megatron-core"],
         "precision.float8_recipe: got 'rowwise'; allowed: tensorwise | mxfp8 under --stack megatron-core"),
        (["--precision", "nvfp4", "--stack", "megatron-core"],
         "precision: got 'nvfp4'; allowed: fp32 | bf16 | fp16 | fp8 on h200 (no FP4"),
        (["--precision", "mxfp8"],
         "(mxfp8 is a float8 recipe: --precision fp8 --float8-recipe mxfp8)"),
        (["--precision", "fp8", "--float8-recipe", "mxfp8", "--stack", "megatron-core"],
         "float8_recipe: got 'mxfp8'; allowed: a recipe without block scales on h200"),
    ],
)  # fmt: skip
def test_bad_fixed_values_exit_2_with_one_line(args: list[str], needle: str) -> None:
    r = _run("plan", "--gpus", "64", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_indivisible_gpus_exit_1_naming_divisibility() -> None:
    # 83: prime and above n_layers 80 (7 GPUs run now: pp 7 splits the layers unevenly).
    r = _run("plan", "--gpus", "83")
    assert r.returncode == 1
    assert "try more GPUs" not in r.stderr and "no valid layout of 83 GPUs" in r.stderr
    assert "global batch 1024 is not a multiple of dp 83" in r.stderr
    assert "tp 2 does not divide 83 GPUs" in r.stderr
    out = json.loads(_run("plan", "--gpus", "83", "--json").stdout)
    assert out["candidates"] == [] and "no valid layout of 83 GPUs" in out["why"]


def test_nothing_fits_shows_the_closest_flagged_and_exits_1() -> None:
    args = ["plan", "--model", "llama3-405b", "--gpu", "a100-40g", "--gpus", "8", "--seq",
            "8192", "--global-batch", "8", "--top", "3"]  # fmt: skip
    r = _run(*args, "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert len(out["candidates"]) == 3 and "no plan fits in memory" in out["why"]
    for c in out["candidates"]:
        assert c["fits"] is False and "GiB" in c["why"]
        assert c["step_time"]["seconds"] > 0 and c["memory_bytes"]["worst_stage"]["total"] > 0
    r = _run(*args)
    assert r.returncode == 1 and "Closest plans (none fits)" in r.stdout and "1!" in r.stdout
    assert "no plan fits in memory" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_fixed_layout_that_does_not_fit_is_shown() -> None:
    r = _run("plan", "--gpus", "8", "--tp", "1", "--pp", "1", "--dp-shard", "1",
             "--dp-replicate", "8", "--mbs", "16", "--recompute", "none", "--offload", "none",
             "--json")  # fmt: skip
    assert r.returncode == 1
    (c,) = json.loads(r.stdout)["candidates"]
    assert c["fits"] is False and c["why"].startswith("needs ")
    assert c["memory_bytes"]["worst_stage"]["total"] > 141 * 2**30


def _table_lines(stdout: str) -> list[str]:
    """The table: from its title to the last row (not the continued `best:` command)."""
    lines = stdout.splitlines()
    start = next(i for i, s in enumerate(lines) if "plans" in s and " on " in s)
    end = next(i for i, s in enumerate(lines) if s.startswith(("best:", "GiB:", "memory ")))
    return lines[start:end]


@pytest.mark.parametrize("gpus", ["64", "4096"])
def test_table_fits_100_columns_and_wide_shows_everything(gpus: str) -> None:
    r = _run("plan", "--gpus", gpus, "--top", "10")
    assert r.returncode == 0, r.stderr
    table = _table_lines(r.stdout)
    assert len(table) >= 12 and max(len(s) for s in table) <= 100
    assert max(len(s) for s in r.stdout.splitlines()) <= 100  # headline, command lines too
    assert "transient" not in r.stdout
    w = _run("plan", "--gpus", gpus, "--top", "10", "--wide")
    assert w.returncode == 0
    assert all(c in w.stdout for c in ("states", "working", "activ.", "transient", "total GiB"))
    assert max(len(s) for s in _table_lines(w.stdout)) > 100


def test_schedule_refuses_sizes_past_its_limit() -> None:
    r = _run("schedule", "--pp", "100000", "--microbatches", "100000")
    assert r.returncode == 2 and f"<= {MAX_STAGE_MICROBATCHES:,}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert f"{MAX_STAGE_MICROBATCHES:,}" in _run("schedule", "--help").stdout.replace("\n", " ")
    r = _run("schedule", "--pp", "4", "--microbatches", str(MAX_STAGE_MICROBATCHES // 4))
    assert r.returncode == 0, r.stderr


def test_network_refuses_sizes_past_its_limit() -> None:
    r = _run("network", "--gpus", "1000000000")
    assert r.returncode == 2 and "gpus: got 1000000000; allowed: <= 65536" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "65,536" in _run("network", "--help").stdout


_ALL_BUT_CP = ["--tp", "8", "--dp-shard", "1", "--dp-replicate", "1", "--mbs", "1",
               "--recompute", "none", "--zero-stage", "3", "--sp", "--offload", "none"]  # fmt: skip


def test_a_fixed_cp_layout_is_evaluated_alone() -> None:
    """--cp 2 is a mesh degree: tp 8 x pp 4 x cp 2 = 64 GPUs, one plan, its ring traffic."""
    r = _run("plan", "--gpus", "64", "--json", "--pp", "4", "--cp", "2", "--schedule", "1f1b",
             "--chunks", "1", "--seq", "4096", *_ALL_BUT_CP)  # fmt: skip
    assert r.returncode in (0, 1), r.stderr
    out = json.loads(r.stdout)
    assert out["search"]["evaluated"] == 1 and len(out["candidates"]) == 1
    c = out["candidates"][0]
    assert c["plan"]["cp"] == 2 and c["plan"]["tp"] * c["plan"]["pp"] * c["plan"]["cp"] == 64
    assert isinstance(c["fits"], bool) and (c["why"] is None) == c["fits"]
    assert c["step_time"]["breakdown_seconds"]["cp_comm"] > 0
    assert c["memory_bytes"]["worst_stage"]["total"] > 0 and "--parallel.cp 2" in c["overrides"]
    assert out["inputs"]["fixed"]["cp"] == 2


def test_fixed_pp_layers_fix_pp_and_each_ranks_layers() -> None:
    r = _run("plan", "--gpus", "64", "--json", "--pp-layers", "19,21,21,19", "--cp", "1",
             "--schedule", "1f1b", *_ALL_BUT_CP, "--dp-shard", "2")  # fmt: skip
    assert r.returncode in (0, 1), r.stderr
    out = json.loads(r.stdout)
    assert out["search"]["evaluated"] == 1 and len(out["candidates"]) == 1
    c = out["candidates"][0]
    assert c["plan"]["pp"] == 4 and c["plan"]["pp_layers"] == [19, 21, 21, 19]
    assert "--parallel.pp_layers [19,21,21,19]" in c["overrides"]
    assert (
        out["inputs"]["fixed"]["pp"] == 4 and out["inputs"]["fixed"]["pp_layers"] == "19,21,21,19"
    )
    # The middle ranks hold 21 layers: their states are the largest.
    stages = c["memory_bytes"]["stages"]
    assert len(stages) == 4 and stages[1]["params"] > stages[0]["params"]
    even = _run("plan", "--gpus", "64", "--json", "--pp", "4", "--cp", "1", "--schedule", "1f1b",
                *_ALL_BUT_CP, "--dp-shard", "2")  # fmt: skip
    e = json.loads(even.stdout)["candidates"][0]
    assert e["plan"]["pp_layers"] == [] and e["step_time"]["seconds"] < c["step_time"]["seconds"]


def test_a_zero_stage_without_shards_is_named() -> None:
    """PL11: --zero-stage 3 with --dp-shard 1 plans plain data parallelism; it says so."""
    r = _run("plan", "--gpus", "64", "--tp", "8", "--pp", "2", "--dp-shard", "1",
             "--zero-stage", "3", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--zero-stage 3 shards over the dp_shard ranks" in r.stderr
    assert json.loads(r.stdout)["candidates"][0]["plan"]["dp_shard"] == 1
    quiet = _run("plan", "--gpus", "64", "--tp", "8", "--pp", "2", "--dp-shard", "4", "--json")
    assert "zero-stage" not in quiet.stderr


def test_offloaded_activations_fit_a_layout_that_did_not() -> None:
    """Megatron-Bridge's Megatron-FSDP Llama 3 70B on 64 GB300 (26.02: 20 of 80 blocks'
    activations offloaded to the Grace memory): without offload the layout does not fit; with
    it, it does, at the same step time (the copies hide behind NVLink-C2C's 450 GB/s), and the
    table names the offload."""
    layout = [
        "plan", "--model", "llama3-70b", "--gpu", "gb300", "--gpus", "64", "--seq", "8192",
        "--global-batch", "256", "--stack", "megatron-core", "--precision", "fp8", "--tp", "1", "--pp", "1",
        "--recompute", "none",
        "--dp-shard", "64", "--zero-stage", "3", "--mbs", "2", "--offload", "none", "--json",
    ]  # fmt: skip
    out = {}
    for n in ("0", "20"):
        r = _run(*layout, "--offload-activations", n)
        out[n] = json.loads(r.stdout)["candidates"][0]
    assert not out["0"]["fits"] and out["20"]["fits"]
    assert out["20"]["plan"]["pp"] == 1 and out["20"]["plan"]["recompute"] == "none"
    assert out["20"]["plan"]["offload_activations"] == 20
    gib = {n: c["memory_bytes"]["worst_stage"]["total"] / 2**30 for n, c in out.items()}
    assert gib["0"] - gib["20"] > 50
    t = {n: c["step_time"]["seconds"] for n, c in out.items()}
    assert t["20"] == pytest.approx(t["0"], rel=1e-9)
    table = _run(*layout[:-1], "--offload-activations", "20", "--wide")
    assert "act 20" in table.stdout


def test_nvfp4_plans_under_megatron_core_on_blackwell() -> None:
    """Megatron-Bridge's GB200 NVFP4 layout for Llama 3 70B, on GB300: planned, and the llmscale
    command printed for it says this runtime trains it in fp8, not nvfp4."""
    r = _run("plan", "--model", "llama3-70b", "--gpu", "gb300", "--gpus", "64", "--seq", "8192",
             "--global-batch", "256", "--stack", "megatron-core", "--precision", "nvfp4",
             "--tp", "2", "--pp", "4", "--chunks", "5", "--schedule", "interleaved_1f1b",
             "--mbs", "1", "--recompute", "none", "--dp-shard", "8", "--zero-stage", "1", "--sp")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "nvfp4: 1 plans costed, 1 fit" in r.stdout
    assert "(which trains no nvfp4: fp8)" in r.stdout and "--precision.mode fp8" in r.stdout
