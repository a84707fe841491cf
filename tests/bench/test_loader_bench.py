"""The loader benchmark runs at a small size and prints its figures (not a timed test)."""

from __future__ import annotations

from llmscale.bench.loader import main, memory_status
from llmscale.bench.runner import BenchOptions
from llmscale.bench.suites import get_suite


def test_script_prints_a_row_per_size_and_cleans_up(tmp_path, capsys) -> None:
    main(["--sizes-mb", "1", "3", "--batches", "20", "--seq", "32", "--batch", "4",
          "--model", "none", "--dir", str(tmp_path)])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ShardStream: 20 batches of 4 x 33 tokens")
    rows = [line.split() for line in lines[2:4]]
    assert [r[0] + r[1] for r in rows] == ["1.0MiB", "3.0MiB"]
    assert all(float(r[3].replace(",", "")) > 0 for r in rows)  # tokens/s
    assert lines[4].startswith("anonymous memory from 1.0 MiB to 3.0 MiB of tokens:")
    assert list(tmp_path.iterdir()) == []  # the synthetic shards are deleted
    assert memory_status().get("VmRSS", 1) > 0


def test_bench_suite_reports_the_loader_next_to_a_training_step(tmp_path) -> None:
    opts = BenchOptions(model="tiny", seq_len=32, steps=1, warmup=0, device="cpu",
                        work_dir=tmp_path, loader_sizes_mb=(1, 2))  # fmt: skip
    res = get_suite("loader")(opts)
    rates = [r for r in res.rows if r.quantity == "tokens/s delivered"]
    assert [r.config for r in rates] == ["1 MB, 1 shards", "2 MB, 1 shards"]
    assert all(r.measured > 0 and r.predicted is None for r in rates)
    demand = [r for r in res.rows if r.quantity == "tokens/s consumed"]
    assert len(demand) == 1 and demand[0].measured > 0
    assert any("demand" in n for n in res.notes)
