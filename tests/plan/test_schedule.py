"""Pipeline schedule orders and simulator: bubbles, activations held, dependencies, errors, CLI."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmscale.cli import main
from llmscale.errors import ConfigError
from llmscale.plan.schedule import (
    DeadlockError,
    Op,
    bubble_fraction,
    peak_inflight_closed_form,
    schedule_ops,
    simulate,
    simulate_orders,
)
from llmscale.report.gantt import text_gantt

FAST = settings(max_examples=60, deadline=None)
pps = st.integers(1, 8)
mbs = st.integers(1, 24)
ratios = st.sampled_from([1.0, 1.5, 2.0, 3.0])


def _interleaved_case() -> st.SearchStrategy[tuple[int, int, int]]:
    return st.tuples(pps, st.integers(1, 4), st.integers(1, 4)).map(
        lambda t: (t[0], t[0] * t[1], t[2])  # (pp, microbatches = k * pp, chunks)
    )


# ---- bubble: simulated == closed form ------------------------------------------------------


@FAST
@given(schedule=st.sampled_from(["gpipe", "1f1b"]), p=pps, m=mbs, ratio=ratios)
def test_bubble_gpipe_1f1b_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m, ratio):
    res = simulate(schedule, p, m, t_fwd=1.0, t_bwd=ratio)
    expected = (p - 1) / (m + p - 1)
    assert res.bubble_fraction == pytest.approx(expected, abs=1e-12)
    assert bubble_fraction(schedule, p, m) == pytest.approx(expected, abs=1e-15)
    # Makespan: (m + p - 1) slots of one forward plus one backward.
    assert res.makespan == pytest.approx((m + p - 1) * (1.0 + ratio))


@FAST
@given(case=_interleaved_case(), ratio=ratios)
def test_bubble_interleaved_is_p_minus_1_over_vm_plus_p_minus_1(case, ratio):
    p, m, v = case
    res = simulate("interleaved_1f1b", p, m, v, t_fwd=1.0, t_bwd=ratio)
    expected = (p - 1) / (v * m + p - 1)
    assert res.bubble_fraction == pytest.approx(expected, abs=1e-12)
    assert bubble_fraction("interleaved_1f1b", p, m, v) == pytest.approx(expected, abs=1e-15)


def test_bubble_known_values():
    assert simulate("1f1b", 4, 8).bubble_fraction == pytest.approx(3 / 11)
    res = simulate("interleaved_1f1b", 4, 8, 2)
    assert res.makespan == pytest.approx(28.5)  # 16 ideal + 3 * (1 + 2) / 2 bubble
    assert res.bubble_fraction == pytest.approx(3 / 19)


def test_scalar_costs_are_per_rank_slice_so_work_does_not_depend_on_chunks():
    for v in (1, 2, 4):
        res = simulate("interleaved_1f1b", 4, 8, v, t_fwd=1.0, t_bwd=2.0)
        assert res.busy == pytest.approx((8 * 3.0,) * 4)
        assert [t.end - t.start for t in res.timeline if t.op.kind == "F"] == pytest.approx(
            [1.0 / v] * (4 * 8 * v)
        )


def test_unequal_stages_gpipe_is_a_flow_shop():
    # Identical jobs through machines in series: Σt + (m-1)·max t, once forward, once backward.
    f, b, m = [1.0, 1.0, 2.0, 1.0], [2.0, 2.0, 4.0, 2.0], 4
    res = simulate("gpipe", 4, m, t_fwd=f, t_bwd=b)
    assert res.makespan == pytest.approx(sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b))
    assert res.busy == pytest.approx([m * (x + y) for x, y in zip(f, b, strict=True)])
    assert res.bubble_fraction == pytest.approx(1 - sum(res.busy) / (4 * res.makespan))


@pytest.mark.parametrize("p,m", [(2, 1), (4, 8), (8, 3)])
def test_p2p_latency_adds_two_hops_per_boundary_to_gpipe(p, m):
    c = 0.25
    res = simulate("gpipe", p, m, t_p2p=c)
    assert res.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * c)


def test_p2p_is_free_between_chunks_on_one_rank():
    # pp = 1: every hop stays on rank 0, so latency never shows.
    assert simulate("interleaved_1f1b", 1, 3, 2, t_p2p=5.0).makespan == pytest.approx(9.0)


# ---- activations held ----------------------------------------------------------------------


@FAST
@given(p=pps, m=mbs)
def test_peak_inflight_1f1b_at_most_gpipe(p, m):
    g = simulate("gpipe", p, m).peak_inflight
    o = simulate("1f1b", p, m).peak_inflight
    assert g == (m,) * p
    assert o == tuple(min(p - r, m) for r in range(p))  # stage 0 holds p
    assert all(a <= b for a, b in zip(o, g, strict=True))


@FAST
@given(
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]),
    case=_interleaved_case(),
)
def test_peak_inflight_closed_form_matches_simulation(schedule, case):
    p, m, v = case
    if schedule != "interleaved_1f1b":
        v = 1
    assert list(simulate(schedule, p, m, v).peak_inflight) == peak_inflight_closed_form(
        schedule, p, m, v
    )


def test_peak_inflight_interleaved_known():
    # Rank 0 warm-up: (v-1)·p + 2·(p-1) = 10 forwards, then one more before its first backward.
    assert peak_inflight_closed_form("interleaved_1f1b", 4, 8, 2) == [11, 9, 7, 5]


# ---- the orders themselves -----------------------------------------------------------------


def _names(ops: list[Op]) -> str:
    return " ".join(str(op) for op in ops)


def test_1f1b_order_warmup_steady_cooldown():
    orders = schedule_ops("1f1b", 4, 6)
    assert _names(orders[0]) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert _names(orders[3]) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"


def test_gpipe_order_all_forward_then_all_backward():
    assert _names(schedule_ops("gpipe", 2, 3)[1]) == "1F0 1F1 1F2 1B0 1B1 1B2"


def test_interleaved_order_rank0():
    # Stages are loop-style: rank 0 holds stages 0 and 4 (chunk 0 and 1) of 8.
    got = _names(schedule_ops("interleaved_1f1b", 4, 8, 2)[0])
    assert got == (
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 "  # warm-up: 10
        "0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "  # steady 1F1B
        "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7"  # cool-down
    )
    assert {(op.chunk, op.stage) for op in schedule_ops("interleaved_1f1b", 4, 8, 2)[1]} == {
        (0, 1),
        (1, 5),
    }


@FAST
@given(
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]),
    case=_interleaved_case(),
)
def test_every_microbatch_one_forward_one_backward_per_stage(schedule, case):
    p, m, v = case
    if schedule != "interleaved_1f1b":
        v = 1
    orders = schedule_ops(schedule, p, m, v)
    counts = Counter((op.kind, op.stage, op.microbatch) for ops in orders for op in ops)
    expected = {(k, s, i): 1 for k in "FB" for s in range(p * v) for i in range(m)}
    assert counts == expected
    for r, ops in enumerate(orders):
        assert all(op.rank == r and op.stage == op.chunk * p + r for op in ops)


@FAST
@given(
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]),
    case=_interleaved_case(),
    c=st.sampled_from([0.0, 0.1, 0.7]),
    data=st.data(),
)
def test_timeline_respects_dependencies_and_rank_order(schedule, case, c, data):
    p, m, v = case
    if schedule != "interleaved_1f1b":
        v = 1
    costs = st.lists(st.floats(0.25, 4.0), min_size=p * v, max_size=p * v)
    f, b = data.draw(costs), data.draw(costs)
    res = simulate(schedule, p, m, v, t_fwd=f, t_bwd=b, t_p2p=c)
    end = {(t.op.kind, t.op.stage, t.op.microbatch): t.end for t in res.timeline}
    eps = 1e-9
    for t in res.timeline:
        s, i = t.op.stage, t.op.microbatch
        hop = 0.0 if p == 1 else c
        cost = (f if t.op.kind == "F" else b)[s]
        assert t.end - t.start == pytest.approx(cost)
        if t.op.kind == "F" and s > 0:
            assert t.start >= end[("F", s - 1, i)] + hop - eps
        if t.op.kind == "B":
            assert t.start >= end[("F", s, i)] - eps
            if s < p * v - 1:
                assert t.start >= end[("B", s + 1, i)] + hop - eps
    orders = schedule_ops(schedule, p, m, v)
    for r in range(p):
        mine = [t for t in res.timeline if t.rank == r]
        assert [t.op for t in mine] == orders[r]  # ran in its order
        assert all(a.end <= b_.start + eps for a, b_ in zip(mine, mine[1:], strict=False))
    assert res.makespan == pytest.approx(max(t.end for t in res.timeline))
    assert sum(res.busy) + sum(res.idle) == pytest.approx(p * res.makespan)


# ---- deadlock ------------------------------------------------------------------------------


def _op(kind: str, rank: int, mb: int) -> Op:
    return Op(kind, rank, rank, 0, mb)  # type: ignore[arg-type]


def test_deadlock_is_reported_not_hung():
    # Rank 0 wants B0 before F1, but rank 1 runs F1 (needs rank 0's F1) before B0.
    orders = [
        [_op("F", 0, 0), _op("B", 0, 0), _op("F", 0, 1), _op("B", 0, 1)],
        [_op("F", 1, 0), _op("F", 1, 1), _op("B", 1, 0), _op("B", 1, 1)],
    ]
    with pytest.raises(DeadlockError, match=r"rank 0 at op #1 \(0B0\) waits for 1B0") as e:
        simulate_orders(orders)
    assert "rank 1 at op #1 (1F1) waits for 0F1" in str(e.value)


def test_backward_before_own_forward_deadlocks():
    with pytest.raises(DeadlockError):
        simulate_orders([[_op("B", 0, 0), _op("F", 0, 0)]])


def test_hand_made_order_equal_to_built_one_simulates_the_same():
    orders = schedule_ops("1f1b", 3, 5)
    assert simulate_orders(orders, schedule="1f1b") == simulate("1f1b", 3, 5)


def test_op_costs_replace_single_ops():
    """1F1B, pp=2, m=2 (F=1, B=2) takes 9; rank 1's first forward taking 3 instead of 1 sits on
    the critical path, so the step takes 2 longer. Costs must be finite and >= 0."""
    orders = schedule_ops("1f1b", 2, 2)
    assert simulate_orders(orders).makespan == 9
    slow = simulate_orders(orders, op_costs={("F", 1, 0): 3.0})
    assert slow.makespan == 11 and slow.busy == (6.0, 8.0)
    with pytest.raises(ConfigError, match="op_costs"):
        simulate_orders(orders, op_costs={("F", 1, 0): math.nan})


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"schedule": "zb"}, "schedule"),
        ({"schedule": "interleaved"}, "schedule"),  # the alias is the CLI's, not the library's
        ({"pp": 0}, "pp"),
        ({"pp": True}, "pp"),
        ({"pp": 2.0}, "pp"),
        ({"microbatches": 0}, "microbatches"),
        ({"chunks": 0}, "chunks"),
        ({"schedule": "1f1b", "chunks": 2}, "chunks"),
        ({"schedule": "interleaved_1f1b", "microbatches": 6, "chunks": 2}, "microbatches"),
    ],
)
def test_bad_schedule_inputs_name_the_field(kwargs, field):
    args = {"schedule": "1f1b", "pp": 4, "microbatches": 8, "chunks": 1} | kwargs
    for fn in (schedule_ops, bubble_fraction, peak_inflight_closed_form, simulate):
        with pytest.raises(ConfigError) as e:
            fn(**args)
        assert e.value.field == field


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"t_fwd": 0.0}, "t_fwd"),
        ({"t_fwd": math.inf}, "t_fwd"),
        ({"t_bwd": -1.0}, "t_bwd"),
        ({"t_bwd": [1.0, 2.0]}, "t_bwd"),  # 4 stages need 4 costs
        ({"t_fwd": [1.0, 1.0, -1.0, 1.0]}, "t_fwd"),
        ({"t_fwd": [0.0, 0.0, 0.0, 0.0]}, "t_fwd"),  # a stage may cost 0, not every one
        ({"t_p2p": -0.1}, "t_p2p"),
        ({"t_p2p": math.nan}, "t_p2p"),
    ],
)
def test_bad_costs_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        simulate("1f1b", 4, 8, **kwargs)
    assert e.value.field == field


def test_bad_hand_made_orders():
    good = schedule_ops("1f1b", 2, 2)
    dup = [good[0] + [good[0][0]], good[1]]
    missing = [good[0][:-1], good[1]]
    wrong_rank = [good[1], good[0]]
    for orders in (dup, missing, wrong_rank, []):
        with pytest.raises(ConfigError) as e:
            simulate_orders(orders)
        assert e.value.field == "orders"


# ---- text Gantt and CLI --------------------------------------------------------------------


def test_text_gantt_one_line_per_rank_on_one_time_scale():
    res = simulate("1f1b", 4, 8)
    quantum, lines = text_gantt(res)
    assert quantum == 0.5
    assert len(lines) == 4
    assert {len(line) for line in lines} == {len("rank 0 ||") + 66}  # 33 time units
    assert lines[3].startswith("rank 3 |......F0B0BBF1B1BB")  # waits 3 forwards, then 1F1B
    _, narrow = text_gantt(res, max_width=40)
    assert {len(line) for line in narrow} == {len("rank 0 ||") + 40}


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 2, 12, 1), ("interleaved_1f1b", 3, 12, 2)])
def test_text_gantt_labels_read_back_as_each_ranks_order(schedule, p, m, v):
    res = simulate(schedule, p, m, v)
    _, lines = text_gantt(res, max_width=10_000)
    for r, line in enumerate(lines):
        labels = re.findall(r"([FBfb])(\d+)", line.split("|")[1])
        want = [
            (op.kind if op.chunk % 2 == 0 else op.kind.lower(), str(op.microbatch))
            for op in schedule_ops(schedule, p, m, v)[r]
        ]
        assert labels == want


def test_cli_schedule_prints_numbers_and_writes_png(tmp_path, capsys):
    png = tmp_path / "gantt.png"
    argv = ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved"]
    rc = main([*argv, "--chunks", "2", "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "interleaved_1f1b" in out
    assert "makespan        28.5" in out
    assert "bubble          0.1579" in out and "= 0.1579" in out
    assert "rank 0: 11  rank 1: 9  rank 2: 7  rank 3: 5" in out
    assert sum(line.startswith("rank ") for line in out.splitlines()) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_cli_per_stage_costs(capsys):
    rc = main(["schedule", "--pp", "2", "--microbatches", "2", "--schedule", "gpipe"])
    assert rc == 0
    rc = main(["schedule", "--pp", "2", "--microbatches", "2", "--t-fwd", "1,3", "--t-bwd", "2,6"])
    assert rc == 0
    assert "makespan        " in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra,field",
    [
        (["--schedule", "zero-bubble-v9"], "schedule"),
        (["--pp", "0"], "pp"),
        (["--schedule", "interleaved", "--microbatches", "6", "--chunks", "2"], "microbatches"),
        (["--chunks", "2"], "chunks"),
        (["--t-fwd", "fast"], "t_fwd"),
        (["--t-bwd", "1,2"], "t_bwd"),
        (["--t-p2p", "1,2"], "t_p2p"),
        (["--width", "3"], "width"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(extra, field, capsys):
    assert main(["schedule", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"llmscale schedule: error: {field}: got ")


def test_cli_non_integer_pp_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["schedule", "--pp", "four"])
    assert e.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_schedule_and_gantt_import_neither_torch_nor_matplotlib():
    code = (
        "import sys, llmscale.plan.schedule, llmscale.report.gantt; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
