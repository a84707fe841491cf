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


def test_the_data_parallel_kind_is_named_as_the_stack_names_it() -> None:
    """Under megatron-core, --dp-shard N --zero-stage 1 is Megatron's distributed optimizer
    and the tables and bars say so; its zero 3 (Megatron FSDP) and every other stack's shards
    read fsdp."""
    from llmscale.plan.time import time_params
    from llmscale.stack import MEGATRON_CORE, STACKS

    space = SearchSpace(tp=8, pp=1, dp_shard=8, zero_stages=(1,), micro_batch_sizes=(1,),
                        recompute=("full",), offload=("none",), sequence_parallel=(True,))  # fmt: skip
    res = search(get_preset("llama2-70b"), 64, Cluster.of("h100"), 4096, 64, top=1,
                 space=space, time_params=time_params(MEGATRON_CORE))  # fmt: skip
    assert res.stack is MEGATRON_CORE
    assert "distopt z1" in bar_label(res.shown[0], res.stack)
    dp = next(c for c in search_table(res).columns if c.header == "dp")
    assert list(dp.cells) == ["8 distopt"]
    for stack in STACKS.values():
        want = "distopt" if stack.sharding == "megatron" else "fsdp"
        assert stack.sharded_dp_name(1) == want and stack.sharded_dp_name(3) == "fsdp"


def test_the_wide_table_has_the_pipeline_columns() -> None:
    t = search_table(_result(), wide=True)
    names = [col.header for col in t.columns]
    assert "B to W" in names and "recv" in names


def test_a_table_s_bytes_take_the_unit_its_largest_figure_reads_at_least_1_in() -> None:
    from llmscale.report.report import byte_unit

    assert byte_unit(80 * 2**30) == ("GiB", 2**30)
    assert byte_unit(2**30) == ("GiB", 2**30)
    assert byte_unit(2**30 - 1) == ("MiB", 2**20)  # 0.999 GiB would read 1.00 GiB; 1024.00 MiB
    assert byte_unit(45 * 2**20) == ("MiB", 2**20)
    assert byte_unit(3000) == ("KiB", 2**10)
    assert byte_unit(1023) == ("B", 1)
    assert byte_unit(0) == ("B", 1)


def test_a_tiny_model_s_plan_table_is_in_mib_not_zeros() -> None:
    """`plan --model tiny` printed 0.0 GiB for every plan; its table and legend now say MiB."""
    from llmscale.report.search_report import memory_legend

    res = search(get_preset("tiny"), 2, Cluster.of("h200"), 128, 8, top=2)
    totals = [c.memory.worst.total for c in res.shown]
    assert all(2**20 < t < 2**30 for t in totals)
    for wide, column in ((False, "MiB"), (True, "total MiB")):
        t = search_table(res, wide=wide)
        (col,) = [c for c in t.columns if c.header == column]
        assert list(col.cells) == [f"{t / 2**20:.1f}" for t in totals]
        assert memory_legend(res, wide).count("MiB") == 1 and "GiB" not in memory_legend(res, wide)
    big = _result()  # a 70B model's stays in GiB
    (col,) = [c for c in search_table(big).columns if c.header == "GiB"]
    assert list(col.cells) == [f"{c.memory.worst.total / 2**30:.1f}" for c in big.shown]


def test_a_bar_says_when_its_plan_fits_only_tightly_or_not_at_all() -> None:
    from dataclasses import replace

    c = _result().shown[0]
    assert not bar_label(c).endswith(("tight", "does not fit"))
    assert bar_label(replace(c, tight=True)).endswith("s, tight")
    assert bar_label(replace(c, fits=False, why="x")).endswith("s, does not fit")
