"""bench/offload.py's record (--json-out) and docs/offload.md's table rendered from it (make
docs): every figure of the table is the record's, none typed."""

from __future__ import annotations

import json
import math
from pathlib import Path

from llmscale import docs
from llmscale.bench import offload


def test_the_offload_table_is_rendered_from_the_benchs_record(tmp_path: Path) -> None:
    out = tmp_path / "results" / "offload.json"
    argv = ["--model", "tiny", "--rounds", "1", "--block", "2", "--warmup", "1", "--seq", "32",
            "--batch", "2", "--accum", "1", "--link-gbps", "0", "1", "--json-out", str(out)]  # fmt: skip
    offload.main(argv)
    rec = json.loads(out.read_text())[offload.SUITE]
    assert rec["command"] == "python -m llmscale.bench.offload " + " ".join(argv)
    assert [(r["offload"], r["link_gbps"]) for r in rec["runs"]] in (
        [("optimizer", 0.0), ("optimizer", 1.0)],
        [("optimizer", 0.0), ("optimizer", 0.0)],  # a CUDA host: native links only
    )
    # the bytes moved, measured = predicted, as results.json rows
    assert len(rec["rows"]) == 4 and all(r["ratio"] == 1.0 for r in rec["rows"])

    ctx = docs.Context(tmp_path / "results" / "results.json", measure=False)
    lines = docs.offload_modes(ctx).splitlines()
    assert lines[0] == f"    {rec['command']}"
    table = [line for line in lines if line.startswith("| `optimizer`")]
    assert len(table) == 2
    for line, run in zip(table, rec["runs"], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == ("memcpy" if run["link_gbps"] == 0 else "1 GB/s")
        for cell, mode in zip(cells[2:5], ("off", "serial", "overlap"), strict=True):
            assert cell == f"{1e3 * run['step_s'][mode]:.0f} ms"
        assert cells[5] == f"{run['bytes_moved']['serial'] / 2**20:.2f} MiB (= predicted)"
        assert cells[6] == f"{1e3 * run['host_adam_s']:.1f} ms"
        wall = run["hidden_wall"]
        assert cells[7].split(" / ")[0] == ("—" if math.isnan(wall) or wall < 0 else f"{wall:.0%}")

    # no record: the block says how to make one
    empty = docs.Context(tmp_path / "none" / "results.json", measure=False)
    assert docs.offload_modes(empty).startswith("Not measured yet")
