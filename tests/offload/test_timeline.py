"""Interval arithmetic behind the hidden-transfer figure."""

import pytest

from llmscale.offload.timeline import Interval, TransferTimeline, intersect, overlap_stats, union


def _iv(lane: str, a: float, b: float, step: int = 0, phase: str = "x") -> Interval:
    return Interval(step, "u", phase, lane, a, b)


def test_union_and_intersection() -> None:
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert intersect([(0, 2.5), (3, 4)], [(1, 3.5)]) == pytest.approx(2.0)
    assert intersect([], [(0, 1)]) == 0.0


def test_overlap_stats_counts_each_instant_once() -> None:
    ivs = [
        _iv("compute", 0, 10),
        _iv("d2h", 8, 12),  # 2 hidden, 2 exposed
        _iv("cpu", 11, 13),  # overlaps d2h: the union is 8..13
        _iv("h2d", 13, 15),
        _iv("compute", 14, 20, step=1),  # the next step's forward hides 1 of the upload
        _iv("d2h", 30, 31, step=1),
    ]
    s = overlap_stats(ivs, [0])
    assert s.offload_s == pytest.approx(7.0) and s.hidden_s == pytest.approx(3.0)
    assert s.hidden_fraction == pytest.approx(3 / 7) and s.exposed_s == pytest.approx(4.0)
    assert s.compute_s == pytest.approx(10.0)  # step 0's own compute
    assert s.per_lane_s == pytest.approx({"d2h": 4.0, "cpu": 2.0, "h2d": 2.0})
    assert overlap_stats(ivs).offload_s == pytest.approx(8.0)
    # A forward that waits for an upload does not hide it.
    waited = [*ivs, _iv("compute", 12, 14, step=1, phase="wait")]
    assert overlap_stats(waited, [0]).hidden_s == pytest.approx(3.0)


def test_timeline_keeps_the_last_steps_and_round_trips(tmp_path) -> None:
    from llmscale.offload.timeline import read_timeline

    tl = TransferTimeline(keep_steps=2)
    for step in range(4):
        t = tl.host_now()
        tl.add(step, "layers.0", "upload", "h2d", t, t + 0.001)
    tl.prune(3)
    assert sorted(iv.step for iv in tl.intervals()) == [2, 3]
    meta, ivs = read_timeline(tl.write(tmp_path / "t.json", device="cpu"))
    assert meta["device"] == "cpu" and [iv.step for iv in ivs] == [2, 3]
    assert ivs[0].end - ivs[0].start == pytest.approx(0.001)
