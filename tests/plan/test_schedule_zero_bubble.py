"""Zero-bubble schedules in the simulator: F, B and W apart, closed forms, activations, CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmscale.cli import main
from llmscale.plan.schedule import (
    bubble_fraction,
    inflight_units,
    schedule_ops,
    simulate,
)

FAST = settings(max_examples=60, deadline=None)
SPLIT = ("zero_bubble", "zbv", "dualpipev")


def _chunks(schedule: str, v: int = 2) -> int:
    return v if schedule == "zero_bubble" else 2


# ---- closed forms where they hold ------------------------------------------------------------


@FAST
@given(
    p=st.integers(2, 8),
    k=st.integers(1, 4),
    v=st.integers(1, 3),
    f=st.floats(0.5, 2.0),
    b=st.floats(1.0, 4.0),
    share=st.floats(0.05, 0.5),
)
def test_zero_bubble_is_zb_h1_closed_form_when_w_is_the_shortest(p, k, v, f, b, share):
    w = share * b
    if w > f:  # ZB-H1's (p-1)(F+B-W) assumes W <= F and W <= B
        w = f
    res = simulate("zero_bubble", p, p * k, v, t_fwd=f, t_bwd=b, t_w=w)
    idle = (p - 1) * (f + (b - w) - w) / v  # chunk costs: one chunk op is 1/v of the slice
    assert res.makespan == pytest.approx(p * k * (f + b) + idle, rel=1e-12)
    assert res.bubble_fraction == pytest.approx(
        bubble_fraction("zero_bubble", p, p * k, v, f, b, w), abs=1e-12
    )


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zbv_and_dualpipev_equal_papers_closed_forms_at_equal_f_b_w(p, extra):
    # F = B = W = 1 per chunk: t_fwd = 2, t_bwd = 4, t_w = 2 per rank slice of two chunks.
    m = 2 * p + extra
    zbv = simulate("zbv", p, m, 2, t_fwd=2, t_bwd=4, t_w=2)
    assert zbv.makespan - m * 6 == pytest.approx((p - 1) * 1)  # (p-1)(F+B-2W) + (p-1)F
    dpv = simulate("dualpipev", p, m, 2, t_fwd=2, t_bwd=4, t_w=2)
    assert dpv.makespan - m * 6 == pytest.approx((p - 1) * (3 + 2 - 3))  # (F&B + B - 3W)
    for res in (zbv, dpv):
        closed = bubble_fraction(res.schedule, p, m, 2, 2, 4, 2)
        assert res.bubble_fraction == pytest.approx(closed, abs=1e-12)


def test_zero_bubble_schedules_beat_1f1b_and_interleaved():
    base = simulate("1f1b", 4, 16).bubble_fraction
    intl = simulate("interleaved_1f1b", 4, 16, 2).bubble_fraction
    zb = simulate("zero_bubble", 4, 16, 2).bubble_fraction
    zbv = simulate("zbv", 4, 16, 2).bubble_fraction
    dpv = simulate("dualpipev", 4, 16, 2).bubble_fraction
    assert base > intl > zb >= zbv
    assert dpv < base
    # W's share moves the split schedules' bubble, not the old ones'.
    assert simulate("1f1b", 4, 16, t_w=0.2).makespan == simulate("1f1b", 4, 16).makespan
    assert simulate("zbv", 4, 16, 2, t_w=0.4).makespan != simulate("zbv", 4, 16, 2).makespan


# ---- dependencies, activations, joined actions -----------------------------------------------


@pytest.mark.parametrize("schedule", SPLIT)
@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12), (5, 10)])
def test_every_op_once_and_w_after_its_b(schedule, p, m):
    res = simulate(schedule, p, m, _chunks(schedule), t_fwd=1, t_bwd=3, t_w=1.2, t_p2p=0.1)
    ends = {(t.op.kind, t.op.stage, t.op.microbatch): t for t in res.timeline}
    assert len(ends) == len(res.timeline) == 3 * p * 2 * m
    for (kind, s, i), t in ends.items():
        if kind == "W":
            assert t.start >= ends[("B", s, i)].end
            assert t.end - t.start == pytest.approx(1.2 / 2)
        if kind == "B":
            assert t.start >= ends[("F", s, i)].end
            assert t.end - t.start == pytest.approx(1.8 / 2)
            if s < 2 * p - 1:
                assert t.start >= ends[("B", s + 1, i)].end


def test_v_placement_and_local_handoff_at_the_bottom_of_the_v():
    ops = schedule_ops("zbv", 4, 8, 2)
    for r, rank_ops in enumerate(ops):
        assert {op.stage for op in rank_ops} == {r, 7 - r}
    # Stages 3 and 4 sit on rank 3: no p2p latency between them.
    res = simulate("zbv", 4, 8, 2, t_p2p=5.0)
    ends = {(t.op.kind, t.op.stage, t.op.microbatch): t for t in res.timeline}
    assert ends[("F", 4, 0)].start == pytest.approx(ends[("F", 3, 0)].end)
    assert ends[("F", 3, 0)].start == pytest.approx(ends[("F", 2, 0)].end + 5.0)


def test_dualpipev_overlapped_actions_send_when_the_action_ends():
    p, m, lat = 4, 8, 0.25
    res = simulate("dualpipev", p, m, 2, t_p2p=lat)
    orders = schedule_ops("dualpipev", p, m, 2)
    timed = {(t.op.kind, t.op.stage, t.op.microbatch): t for t in res.timeline}
    rank_of = {op.stage: r for r, ops in enumerate(orders) for op in ops}
    joined_fs = 0
    for r, ops in enumerate(orders):
        for k, op in enumerate(ops):
            if op.kind != "F" or op.stage == 2 * p - 1 or k + 1 >= len(ops):
                continue
            if not ops[k + 1].joined or rank_of[op.stage + 1] == r:
                continue
            joined_fs += 1
            last = k + 1
            while last + 1 < len(ops) and ops[last + 1].joined:
                last += 1
            action_end = timed[(ops[last].kind, ops[last].stage, ops[last].microbatch)].end
            consumer = timed[("F", op.stage + 1, op.microbatch)]
            assert consumer.start >= action_end + lat - 1e-12
    assert joined_fs > 0


@pytest.mark.parametrize("schedule", SPLIT)
def test_activations_are_held_until_w(schedule):
    p, m = 4, 8
    v = _chunks(schedule)
    res = simulate(schedule, p, m, v)
    for r, ops in enumerate(schedule_ops(schedule, p, m, v)):
        held = peak = 0
        for op in ops:
            held += {"F": 1, "B": 0, "W": -1}[op.kind]
            peak = max(peak, held)
        assert res.peak_inflight[r] == peak == inflight_units(schedule, p, m, v, r)
    # ZB-H1 and ZB-V keep 1F1B's memory: p micro-batches (2p chunk units) on every rank;
    # DualPipeV one chunk more (the DualPipe README's PP + 1 with 2p stages).
    want = {"zero_bubble": 2 * p, "zbv": 2 * p, "dualpipev": 2 * p + 1}[schedule]
    assert res.peak_inflight == (want,) * p


# ---- CLI ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--schedule", "gpipe"],
        ["--schedule", "1f1b"],
        ["--schedule", "interleaved", "--chunks", "2"],
        ["--schedule", "zero_bubble", "--chunks", "2"],
        ["--schedule", "zbv"],
        ["--schedule", "dualpipev", "--t-w", "0.5"],
    ],
)
def test_cli_json_for_every_schedule(args, capsys):
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    split = out["schedule"] in SPLIT
    assert len(out["peak_inflight"]) == len(out["ops"]) == 4
    n_ops = sum(len(r) for r in out["ops"])
    assert n_ops == (3 if split else 2) * 4 * out["chunks"] * 8
    kinds = {o["kind"] for r in out["ops"] for o in r}
    assert kinds == ({"F", "B", "W"} if split else {"F", "B"})
    assert out["makespan"] == max(o["end"] for r in out["ops"] for o in r)
    busy = sum(o["end"] - o["start"] for r in out["ops"] for o in r)
    assert out["bubble_fraction"] == pytest.approx(1 - busy / (4 * out["makespan"]))
    for key in ("bubble_fraction", "makespan", "peak_inflight", "ops", "closed_form_bubble"):
        assert key in out


def test_cli_text_draws_w(capsys):
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zbv"]) == 0
    out = capsys.readouterr().out
    assert "W0" in out and "w0" in out and "F to W" in out


@pytest.mark.parametrize(
    "extra,field",
    [
        (["--schedule", "zbv", "--chunks", "3"], "--chunks"),
        (["--schedule", "zero_bubble"], "--chunks"),
        (["--schedule", "dualpipev", "--microbatches", "6"], "microbatches"),
        (["--schedule", "zbv", "--t-w", "2"], "t_w"),
        (["--schedule", "zbv", "--t-w", "x"], "t_w"),
        (["--schedule", "zbv", "--pp", "64", "--microbatches", "1000"], "microbatches"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(extra, field, capsys):
    argv = ["schedule", "--pp", "4", "--microbatches", "8", *extra]
    # argparse keeps the last --pp / --microbatches given
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_in_flight_formulas_equal_the_orders_own_count():
    from llmscale.plan.schedule import order_peak, zero_bubble_rounds

    for p in range(2, 9):
        for m in range(1, 6 * p):
            for r in range(p):
                for v in (1, 2, 3):
                    if m % zero_bubble_rounds(p, m) == 0:
                        got = inflight_units("zero_bubble", p, m, v, r)
                        assert got == order_peak("zero_bubble", p, m, v, r), (p, m, v, r)
                assert inflight_units("zbv", p, m, 2, r) == order_peak("zbv", p, m, 2, r)
                if m >= 2 * p:
                    got = inflight_units("dualpipev", p, m, 2, r)
                    assert got == order_peak("dualpipev", p, m, 2, r)


def test_a_stage_of_the_embedding_or_head_alone_may_cost_nothing() -> None:
    """126 layers over pp 32 x 4 chunks put the embedding and the head each on a stage of its
    own (n_layers + 2 stages); the time model shares a rank's time among its stages by their
    layers, so those two cost 0 in the simulator, which times the plan (it refused them:
    `llmscale plan` for Llama 3 405B on 128 H100 96GB under torchtitan stopped on it). Costs
    all 0 are still refused."""
    from llmscale.errors import ConfigError
    from llmscale.model.config import get_preset, stage_layer_counts
    from llmscale.plan.cluster import Cluster
    from llmscale.plan.plan import Plan
    from llmscale.plan.time import estimate_step_time

    costs = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    res = simulate("zero_bubble", 4, 8, 2, t_fwd=costs, t_bwd=[3 * c for c in costs])
    busy = 8 * (1 + 3)  # the fullest rank's forward and backward per micro-batch
    assert res.makespan >= busy
    with pytest.raises(ConfigError, match="not all 0"):
        simulate("zero_bubble", 4, 8, 2, t_fwd=[0.0] * 8, t_bwd=[0.0] * 8)
    plan = Plan(
        model=get_preset("llama3-405b"), seq_len=8192, micro_batch_size=1, global_batch_size=32,
        tp=4, pp=32, dp_shard=1, dp_replicate=1, pp_schedule="zero_bubble", pp_chunks=4,
        recompute="full", zero_stage=3, offload="optimizer+params",
    )  # fmt: skip
    counts = stage_layer_counts(126, 128)
    assert counts[0] == counts[-1] == 0 and sum(counts) == 126
    t = estimate_step_time(plan, Cluster.of("h100-96g"), simulate=True)
    assert t.seconds > 0
