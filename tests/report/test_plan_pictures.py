"""The plan table and picture show every memory part the total counts, and name each layout."""

from __future__ import annotations

from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.search import SearchSpace, search
from llmscale.report.report import MEMORY_PARTS, bar_label, memory_png, search_table


def _result():  # type: ignore[no-untyped-def]
    space = SearchSpace(tp=2, pp=8, schedules=("interleaved_1f1b",), offload=("optimizer+params",))
    return search(get_preset("llama2-70b"), 64, Cluster.of("h200"), 4096, 1024, top=2, space=space)


def test_every_part_of_the_total_is_drawn(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = _result()
    for c in res.shown:
        w = c.memory.worst
        assert w.pipeline_buffers > 0  # torch's receive buffers: the part the bars left out
        assert sum(w.breakdown()[p] for p in MEMORY_PARTS) == w.total
    assert memory_png(res, tmp_path / "plans.png").stat().st_size > 0


def test_a_bar_names_its_layout_fully() -> None:
    c = _result().shown[0]
    label = bar_label(c)
    for word in ("tp2", "pp8", "fsdp", "interleaved", "offload optimizer+params"):
        assert word in label, label


def test_the_wide_table_has_the_pipeline_columns() -> None:
    t = search_table(_result(), wide=True)
    names = [col.header for col in t.columns]
    assert "B to W" in names and "recv" in names
