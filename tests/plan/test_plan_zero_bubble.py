"""The planner with the zero-bubble schedules: V placement, activations held until W, time with
W apart, the search and `llmscale plan --schedule zbv`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llmscale.cli import main
from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import DEFAULT_OPTIONS, estimate_memory, plan_rank_params
from llmscale.plan.plan import Plan
from llmscale.plan.schedule import simulate
from llmscale.plan.search import search
from llmscale.plan.time import estimate_step_time

MODEL = get_preset("llama2-7b")
BASE = Plan(
    model=MODEL, seq_len=4096, micro_batch_size=1, global_batch_size=64, precision="bf16",
    tp=1, pp=4, dp_shard=2, zero_stage=1,
)  # fmt: skip
H100 = Cluster.of("h100")


def _plan(schedule: str, chunks: int = 1) -> Plan:
    return replace(BASE, pp_schedule=schedule, pp_chunks=chunks)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_place_first_and_last_stage_on_rank_0(schedule):
    plan = _plan(schedule)  # pp_chunks left at 1: the V schedules run 2 anyway
    assert plan.chunks == 2 and plan.v_shape and plan.head_rank == 0
    plan.validate()
    n = MODEL.n_layers // 8
    assert plan.rank_layers(0) == [*range(n), *range(7 * n, 8 * n)]
    assert plan.rank_layers(3) == list(range(3 * n, 5 * n))
    assert len(plan.rank_stages(0)) == 2
    rp0, rp3 = (plan_rank_params(plan, r, DEFAULT_OPTIONS.kernels) for r in (0, 3))
    assert rp0.embedding is not None and rp0.head is not None
    assert rp3.embedding is None and rp3.head is None


def test_zero_bubble_keeps_loop_placement_and_its_chunks():
    plan = _plan("zero_bubble", 2)
    assert plan.chunks == 2 and not plan.v_shape and plan.head_rank == 3
    assert plan.rank_layers(0)[:4] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "schedule,chunks", [("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2), ("1f1b", 1)]
)
def test_memory_counts_activations_held_until_w_from_the_simulator(schedule, chunks):
    plan = _plan(schedule, chunks)
    est = estimate_memory(plan)
    sim = simulate(schedule, plan.pp, plan.n_microbatches, plan.chunks)
    # in-flight micro-batches per rank = the simulator's peak chunk units / chunks
    assert [r.inflight for r in est.per_rank] == [u / plan.chunks for u in sim.peak_inflight]


def test_split_schedules_hold_more_than_1f1b_on_late_ranks_and_not_on_rank_0():
    one = estimate_memory(_plan("1f1b"))
    zbv = estimate_memory(_plan("zbv"))
    assert [r.inflight for r in one.per_rank] == [4, 3, 2, 1]
    assert [r.inflight for r in zbv.per_rank] == [4, 4, 4, 4]
    assert zbv.per_rank[3].activations > one.per_rank[3].activations


def test_time_zero_bubble_schedules_beat_1f1b_and_w_is_the_weight_gemms():
    t = {s: estimate_step_time(_plan(s, c), H100) for s, c in
         [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]}  # fmt: skip
    assert t["zero_bubble"].bubble_fraction < t["interleaved_1f1b"].bubble_fraction
    assert t["zbv"].bubble_fraction < t["1f1b"].bubble_fraction
    assert t["zero_bubble"].seconds < t["1f1b"].seconds
    # The shown plans are re-timed by the simulator, with W = the weight-gradient GEMMs.
    sim = estimate_step_time(_plan("zbv"), H100, simulate=True)
    closed = t["zbv"]
    assert sim.seconds == pytest.approx(closed.seconds, rel=0.05)
    assert sim.seconds <= closed.seconds * (1 + 1e-9)


def test_search_tries_the_new_schedules_and_plan_fixes_zbv():
    res = search(MODEL, 16, H100, 4096, 64, top=200)
    seen = {c.plan.pp_schedule for c in res.candidates if c.plan.pp > 1}
    assert {"zero_bubble", "zbv", "dualpipev"} <= seen


def test_cli_plan_schedule_zbv(capsys):
    argv = ["plan", "--model", "llama2-7b", "--gpu", "h100", "--gpus", "16", "--seq", "4096",
            "--global-batch", "64", "--schedule", "zbv", "--json", "--top", "5"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    plans = out["candidates"]
    assert plans and all(p["plan"]["pp_schedule"] == "zbv" for p in plans)
    assert all(p["plan"]["pp"] > 1 for p in plans)


@pytest.mark.parametrize(
    "extra,field",
    [(["--schedule", "zbv", "--chunks", "4"], "chunks"),
     (["--schedule", "zero_bubble", "--chunks", "1"], "chunks"),
     (["--schedule", "gpipe", "--chunks", "2"], "chunks")],
)  # fmt: skip
def test_cli_plan_chunks_rules(extra, field, capsys):
    argv = ["plan", "--model", "llama2-7b", "--gpus", "16", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


@pytest.mark.parametrize(
    "extra,label",
    [(["--schedule", "zbv"], "zbv"),
     (["--schedule", "interleaved_1f1b", "--chunks", "2", "--pp", "4"], "intl v2")],
)  # fmt: skip
def test_cli_plan_pp_layers_of_two_chunks_per_rank(extra, label, capsys):
    # 8 stage entries: 2 per rank of pp 4 (a V for zbv); this was a traceback for interleaved.
    argv = ["plan", "--model", "llama2-7b", "--gpu", "h100", "--gpus", "16", "--global-batch",
            "64", "--pp-layers", "3,4,4,5,5,4,4,3", "--top", "2", *extra]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pp=4" in out and label in out
