"""docs/parallel.md, schedule.md, pipeline-bench.md and planner.md prose figures are rendered
(`llmscale.docs_parallel`): from the records they cite, or from the planner's rule."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmscale import docs, docs_parallel
from llmscale.docs import Context

ROOT = Path(__file__).resolve().parents[1]
MINE = {b.name for b in docs.BLOCKS if b.render.__module__ == docs_parallel.__name__}


def test_my_blocks_are_current() -> None:
    ctx = Context(ROOT / "docs" / "results" / "results.json", measure=False)
    import inspect

    renderers = {
        fn for name, fn in inspect.getmembers(docs_parallel, inspect.isfunction)
        if not name.startswith("_") and fn.__module__ == docs_parallel.__name__
        and list(inspect.signature(fn).parameters) == ["ctx"]
    }  # fmt: skip
    assert renderers == {b.render for b in docs.BLOCKS if b.name in MINE}  # each one registered
    for b in docs.BLOCKS:
        if b.name in MINE:
            have = docs._content((ROOT / b.file).read_text(), b)
            assert have == docs._rendered(b, ctx, have), b.name


def _records(tmp_path: Path) -> Path:
    out = tmp_path / "docs" / "results"
    out.mkdir(parents=True)
    for name in ("results.json", "demo.json"):
        shutil.copy(ROOT / "docs" / "results" / name, out / name)
    return out


def _edit(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_demo_losses_follow_the_demo_record(tmp_path: Path) -> None:
    res = _records(tmp_path)
    before = docs_parallel.demo_losses(Context(res / "results.json"))
    assert re.search(r"for \d+ steps \(\d+ s, .*\) and ends at loss \d\.\d{4}, validation", before)

    def change(d: dict[str, Any]) -> None:
        run = d["demo"]["run"]
        train = [s for s in run["steps"] if s["kind"] == "train"]
        train[-1]["loss"], train[-1]["step"] = 1.23456, 70
        run["closing"] = ["validation loss 9.8765"]

    _edit(res / "demo.json", change)
    after = docs_parallel.demo_losses(Context(res / "results.json"))
    assert "for 70 steps" in after and "ends at loss 1.2346, validation loss 9.8765" in after
    (res / "demo.json").unlink()
    assert "not been recorded" in docs_parallel.demo_losses(Context(res / "results.json"))


def _pipeline_rows(d: dict[str, Any], quantity: str) -> list[dict[str, Any]]:
    return [r for r in d["pipeline"]["rows"] if r["quantity"] == quantity]


def test_inflight_figures_follow_the_pipeline_suite(tmp_path: Path) -> None:
    res = _records(tmp_path)

    def exact(d: dict[str, Any]) -> None:
        for r in _pipeline_rows(d, docs_parallel.INFLIGHT):
            r["measured"] = r["predicted"]

    _edit(res / "results.json", exact)
    ctx = Context(res / "results.json")
    n = len(ctx.rows("pipeline", docs_parallel.INFLIGHT))
    assert docs_parallel.inflight_rest(ctx) == (
        f"Every one of the {n} configurations is the prediction to the byte."
    )
    assert docs_parallel.inflight_limit(ctx).startswith("the planner's prediction to 0.00%")

    def gap(d: dict[str, Any]) -> None:  # 3 micro-batches' token ids and one 0-d loss more
        r = _pipeline_rows(d, docs_parallel.INFLIGHT)[0]
        r["measured"] = r["predicted"] + 3 * 8 * 129 + 8

    _edit(res / "results.json", gap)
    ctx = Context(res / "results.json")
    rest = docs_parallel.inflight_rest(ctx)
    assert rest.startswith(f"What is left in 1 of the {n} configurations, 3,104 to 3,104 bytes")
    assert "the token ids of 3 to 3 micro-batches more (1,032 bytes each" in rest
    assert "and 8 bytes of 0-d losses" in rest
    r = ctx.rows("pipeline", docs_parallel.INFLIGHT)
    worst = max(abs(x["predicted"] / x["measured"] - 1) for x in r.values())
    assert f"to {worst:.2%} in" in docs_parallel.inflight_limit(ctx)


def test_step_cost_and_send_bytes_follow_the_pipeline_suite(tmp_path: Path) -> None:
    res = _records(tmp_path)

    def change(d: dict[str, Any]) -> None:
        for r in _pipeline_rows(d, "makespan"):
            r["measured"] = 0.5
        d["pipeline"]["notes"] = [re.sub(r"seq \d+", "seq 64", n) for n in d["pipeline"]["notes"]]

    _edit(res / "results.json", change)
    ctx = Context(res / "results.json")
    n = len(ctx.rows("pipeline", "makespan"))
    assert docs_parallel.pipeline_step_cost(ctx).startswith(f"at least {0.5 * n:.1f} s more")
    # small's residual stream, 64 tokens of 256 fp32 values
    assert (
        docs_parallel.pipeline_send_bytes(ctx)
        == "activations here are 64 KiB (small, seq 64, fp32)"
    )


def test_planner_blocks_are_the_rules_counts() -> None:
    """The counts tests/stack/test_residency.py and tests/parallel/test_zero_stages.py hold the
    runtime to."""
    ctx = Context(measure=False)
    table = docs_parallel.pipeline_gathers_table(ctx).splitlines()
    assert table[2:5] == [
        "| gpipe, 1f1b | 1 | 1 | 5 (m + 1) | 1 |",
        "| interleaved_1f1b, zero_bubble | 2 | 1 | 5 (m + 1) | 1 |",
        "| zbv, dualpipev | 2 (V) | 1 | 5 (m + 1) | 1 |",
    ]
    assert "rank 0: 11 gathers of its blocks and 4 of the root; rank 1: 9 " in table[5]
    assert "rank 0: 22 gathers of its blocks and 6 of the root; rank 1: 23 " in table[5]
    rep = docs_parallel.replica_allreduces(ctx)
    assert "once per step (5, 923,904 bytes)" in rep
    assert "once per reduce-scatter (10, 923,904 bytes" in rep
    assert docs_parallel.interleaved_inflight(ctx).startswith("5 and 3 ")
    assert docs_parallel.zbh1_idle(ctx) == "3, a third"  # (p-1)(F + B - W) = 3 (1 + 1 - 1)


def test_decode_ridge_is_where_decoding_turns_compute_bound() -> None:
    from llmscale.hardware.catalog import get_gpu
    from llmscale.model.config import get_preset
    from llmscale.plan.roofline import decode

    text = docs_parallel.decode_ridge(Context(measure=False))
    b = float(re.search(r"above batch ([\d,]+)", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    model, gpu = get_preset("llama2-70b"), get_gpu("h200")
    assert decode(model, gpu, int(b) - 1, 2048).bound == "memory-bound"
    assert decode(model, gpu, int(b) + 1, 2048).bound == "compute-bound"


def test_validation_blocks_follow_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    def row(rid: str, predicted: float, published: float) -> SimpleNamespace:
        return SimpleNamespace(id=rid, quantity="tokens/s per GPU", ratio=predicted / published)

    fake = [
        row("tt2412-8b-8gpu-cp8-seq256k", 3.0, 2.0),
        row("tt2412-8b-8gpu-cp1-seq32k", 1.0, 1.0),
        row("tt2506-8b-64gpu-bf16-tp", 1.1, 1.0),
        row("tt2506-8b-64gpu-bf16-asynctp", 2.0, 1.0),
    ]
    monkeypatch.setattr("llmscale.validation.runs.all_results", lambda: fake)
    ctx = Context(measure=False)
    assert (
        docs_parallel.cp_rows(ctx)
        == "predicted / published tokens/s per GPU at cp 1, 8: 1.00, 1.50"
    )
    assert docs_parallel.vanilla_tp(ctx) == "tt2506-8b-64gpu-bf16-tp 1.10 predicted / published"


def test_init_rate_renders_what_the_recorder_writes(tmp_path: Path) -> None:
    """The recorder's output is what the renderer reads: a tiny run, then a doctored rate."""
    from llmscale.bench import parallel_init
    from llmscale.model.config import get_preset

    res = tmp_path / "docs" / "results"
    ctx = Context(res / "results.json")
    assert docs_parallel.init_rate(ctx).startswith("not measured yet")
    out = res / "parallel-init.json"
    assert (
        parallel_init.main(
            ["--rows", "64", "--cols", "32", "--repeats", "2", "--json-out", str(out)]
        )
        == 0
    )
    rec = json.loads(out.read_text())[parallel_init.SUITE]
    assert rec["shape"] == [64, 32] and len(rec["seconds"]) == 2
    assert rec["values_per_s"] == pytest.approx(64 * 32 / min(rec["seconds"]))
    assert "bench.parallel_init --rows 64" in rec["command"] and len(rec["load_average"]) == 2

    def change(d: dict[str, Any]) -> None:
        d[parallel_init.SUITE]["values_per_s"] = 1e8

    _edit(out, change)
    n = get_preset("llama2-70b").num_params()
    text = docs_parallel.init_rate(ctx)
    assert text.startswith("0.10 G values/s on one core")
    assert f"take {n / 1e8 / 60:.0f} minutes" in text


def test_planner_md_reads_the_stacks_the_links_and_the_runs(monkeypatch) -> None:
    """The fitted factors, NVLink's achieved rate and the run counts are the catalog's and the
    stacks' own: a changed fact changes the sentence."""
    import dataclasses

    from llmscale import stack as stack_mod
    from llmscale.hardware import catalog
    from llmscale.validation import runs as runs_mod

    fits = docs_parallel.stack_fits(None)
    assert "torchtitan on NVIDIA H100 96GB" in fits and "0.74x" in fits
    tt = stack_mod.STACKS["torchtitan"]
    fit = dataclasses.replace(
        tt.fitted[0], scale=dataclasses.replace(tt.fitted[0].scale, value=0.5)
    )
    monkeypatch.setitem(stack_mod.STACKS, "torchtitan", dataclasses.replace(tt, fitted=(fit,)))
    assert "0.5x" in docs_parallel.stack_fits(None) and "0.74x" not in docs_parallel.stack_fits(
        None
    )

    link = catalog.default_catalog().link("nvlink4")
    per_link = link.achieved_GBps.value / link.links_per_gpu.value
    assert docs_parallel.nvlink_achieved(None).startswith(f"{per_link:.1f} GB/s per NVLink 4 link")

    rows = runs_mod.load_runs()
    text = docs_parallel.run_counts(None)
    assert text.startswith(f"{len(rows)} runs: ")
    monkeypatch.setattr(runs_mod, "load_runs", lambda: rows[:3])
    assert docs_parallel.run_counts(None).startswith("3 runs: ")


def test_planner_md_states_the_time_models_defaults_from_the_code(monkeypatch) -> None:
    """The assumptions paragraph reads `DEFAULT_TIME` and the stacks' step overhead: a changed
    default changes the sentence."""
    import dataclasses

    from llmscale.plan import time as time_mod

    text = docs_parallel.time_defaults(None)
    assert f"overlap efficiency {time_mod.DEFAULT_TIME.dp_overlap:g}" in text
    changed = dataclasses.replace(time_mod.DEFAULT_TIME, host_adam_GBps=12.5, tp_overlap=0.5)
    monkeypatch.setattr(time_mod, "DEFAULT_TIME", changed)
    text = docs_parallel.time_defaults(None)
    assert "host AdamW 12.5 GB/s" in text and "TP overlap 0.5" in text
    assert docs_parallel.step_overhead(None).endswith("ms on a catalog GPU")
