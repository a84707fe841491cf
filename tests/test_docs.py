"""README.md and docs/ figures are rendered (`make docs`), and a hand-edited one is caught."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from llmscale import docs
from llmscale.bench import timed
from llmscale.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_every_rendered_block_is_current() -> None:
    """Fails when a figure changed without `make docs` (python -m llmscale.docs)."""
    assert docs.stale() == []


def test_every_drawn_image_is_current_and_make_docs_redraws_a_changed_one(tmp_path: Path) -> None:
    """The images the planner and the schedule simulator draw (`docs.IMAGE_COMMANDS`: README's
    plan chart, parallel.md's Gantt charts) are the commands' own bytes; a changed one is
    stale, and make docs draws it again."""
    assert docs.stale_images() == []
    paths = [c.split("--png ")[1].split()[0] for c in docs.IMAGE_COMMANDS]
    assert "docs/img/plan-llama2-70b-h200.png" in paths and len(paths) == len(set(paths))
    for p in paths:
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / p, tmp_path / p)
    gantt = tmp_path / "docs/img/gantt-zbv.png"
    gantt.write_bytes(gantt.read_bytes()[:-10])
    assert docs.stale_images(tmp_path) == ["docs/img/gantt-zbv.png: the image"]
    assert docs.write_images(tmp_path) == ["docs/img/gantt-zbv.png: the image"]
    assert gantt.read_bytes() == (ROOT / "docs/img/gantt-zbv.png").read_bytes()


RECORDS = tuple(
    f"docs/results/{n}.json"
    for n in (
        "results",
        "demo",
        "timings",
        "pipeline_memory",
        "overhead",
        "offload",
        "selective",
        "pages-startup",
        "reliability",
        "parallel-init",
        "offload-lsp",
        "offload-kernels",
    )
)


def _copy(tmp_path: Path) -> Path:
    for b in {b.file for b in docs.BLOCKS} | set(RECORDS):
        (tmp_path / b).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / b).is_file():
            shutil.copy(ROOT / b, tmp_path / b)
    return tmp_path


def test_a_hand_edited_figure_is_stale_and_make_docs_restores_it(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    i, j = docs._span(text, "megatron-ratios")
    edited = text[:i] + text[i:j].replace("for all", "for all 1") + text[j:]
    readme.write_text(edited)
    claims_md = root / "docs" / "claims.md"
    claims_md.write_text(claims_md.read_text().replace("**does not hold here**", "**holds**", 1))
    assert docs.stale(root) == ["README.md: megatron-ratios", "docs/claims.md: the whole file"]
    assert docs.write(root) == ["README.md: megatron-ratios", "docs/claims.md: the whole file"]
    assert docs.stale(root) == []
    assert readme.read_text() == text


def test_a_changed_result_makes_its_block_stale(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    res = root / "docs" / "results" / "results.json"
    data = json.loads(res.read_text())
    rows = data["recompute"]["rows"]
    row = next(r for r in rows if r["config"] == "recompute=full" and "/ none" in r["quantity"])
    row["measured"] *= 1.2
    res.write_text(json.dumps(data))
    stale = docs.stale(root)
    assert "README.md: measured-vs-predicted" in stale  # the recompute row
    assert "docs/claims.md: the whole file" in stale  # claims' recompute row
    assert "docs/results.md: the whole file" in stale  # make results' page of the same file


def test_the_reliability_page_is_rendered_from_the_fault_suites_record(tmp_path: Path) -> None:
    """docs/reliability.md is make reliability's record (docs/results/reliability.json)
    rendered by that command's own function: a failed or lossy case in the record shows on the
    page, and without the record the page names the command that writes it."""
    root = _copy(tmp_path)
    record = root / "docs/results/reliability.json"
    rows = json.loads(record.read_text())
    ctx = docs.Context(root / "docs/results/results.json")
    page = docs._reliability_md(ctx)
    assert page == (ROOT / "docs/reliability.md").read_text()
    n = len(rows)
    assert f"**{n} cases, {n} passed, " in page
    rows[0]["outcome"] = "failed"
    rows[1]["data_lost"] = "the last checkpoint"
    record.write_text(json.dumps(rows))
    doctored = docs._reliability_md(docs.Context(root / "docs/results/results.json"))
    assert f"**{n} cases, {n - 1} passed, " in doctored
    assert "| **failed** |" in doctored and "| **the last checkpoint** |" in doctored
    record.unlink()
    missing = docs._reliability_md(docs.Context(root / "docs/results/results.json"))
    assert "run `make reliability`" in missing


def _edit_block(path: Path, name: str, old: str, new: str) -> str:
    text = path.read_text()
    i, j = docs._span(text, name)
    assert old in text[i:j], (name, old)
    path.write_text(text[:i] + text[i:j].replace(old, new, 1) + text[j:])
    return text


def _bump(path: Path, suite: str, config: str, by: float, quantity: str | None = None) -> dict:
    """Add `by` to the measured figure of `suite`'s row `config` (and `quantity`, if given) in
    the record at `path`; the row as written."""
    data = json.loads(path.read_text())
    row = next(
        r for r in data[suite]["rows"]
        if r["config"] == config and quantity in (None, r["quantity"])
    )  # fmt: skip
    row["measured"] += by
    path.write_text(json.dumps(data))
    return dict(row)


def test_the_demo_transcript_is_rendered_from_its_record(tmp_path: Path) -> None:
    """README's demo block is what make demo recorded (docs/results/demo.json), rendered with
    the train command's own renderers: a hand-edited figure in it, or a changed record, is
    stale, and make docs restores the block."""
    root = _copy(tmp_path)
    readme = root / "README.md"
    record = json.loads((root / "docs/results/demo.json").read_text())
    step = next(r for r in record["demo"]["rows"] if r["quantity"] == "step_time_s")
    ratio = f"{step['predicted'] / step['measured']:.2f}"
    text = _edit_block(
        readme, "demo-run", f"   {ratio}\n", "   1.00\n" if ratio != "1.00" else "   0.99\n"
    )
    assert docs.stale(root) == ["README.md: demo-run"]
    assert docs.write(root) == ["README.md: demo-run"] and readme.read_text() == text
    i, j = docs._span(text, "demo-fit")
    fit = text[i:j]  # the ratio, then the other processes' load where the record has it
    assert fit.endswith(f"step time predicted/measured {ratio}") or (
        f"step time predicted/measured {ratio} (other processes used " in fit and fit.endswith(")")
    )

    step["measured"] *= 2  # another run
    (root / "docs/results/demo.json").write_text(json.dumps(record))
    assert docs.stale(root) == ["README.md: demo-fit", "README.md: demo-run"]
    docs.write(root)
    i, j = docs._span(readme.read_text(), "demo-run")
    assert f"{step['predicted'] / step['measured']:.2f}\n" in readme.read_text()[i:j]


def test_the_test_suites_time_is_rendered_from_its_record(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    timings = root / "docs/results/timings.json"
    if timings.is_file():  # the record without a row for make test
        data = json.loads(timings.read_text())
        data["timings"]["rows"] = [r for r in data["timings"]["rows"] if r["config"] != "make test"]
        timings.write_text(json.dumps(data))
    docs.write(root, only=["test-time"])
    readme = root / "README.md"
    i, j = docs._span(readme.read_text(), "test-time")
    assert "has not been timed here yet" in readme.read_text()[i:j]
    timed.record(
        timings,
        timed.wall_row("timings", "make test", 856.4, (1.5, 2.25)),
        "2026-12-05T01:00:00+00:00",
    )
    assert docs.stale(root) == ["README.md: test-time"]
    docs.write(root)
    i, j = docs._span(readme.read_text(), "test-time")
    assert readme.read_text()[i:j] == (
        "`make test` took 14 minutes (856 s) on 2026-12-05; "
        f"{os.cpu_count()} CPU cores; load average 1.50 at the start, 2.25 at the end "
        "(`make test-timed` runs it and records its wall time)."
    )


def test_timings_alone_do_not_make_a_block_stale(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    i, j = docs._span(text, "plan-speed")
    readme.write_text(text[:i] + docs.TIMING.sub("9.99 s", text[i:j]) + text[j:])
    assert docs.stale(root) == []
    # --retime measures the search again and writes its seconds, and nothing else
    assert docs.write(root, only=["plan-speed"]) == []
    assert docs.write(root, only=["plan-speed"], retime=True) == ["README.md: plan-speed"]
    i, j = docs._span(readme.read_text(), "plan-speed")
    assert "9.99 s" not in readme.read_text()[i:j]


def test_the_plan_example_is_the_commands_output(capsys: pytest.CaptureFixture[str]) -> None:
    """README's plan block is what `llmscale plan` prints (timings masked)."""
    assert main(docs.DEMO_PLAN.split()[1:]) == 0
    printed = "\n".join(line.rstrip() for line in capsys.readouterr().out.splitlines())
    text = (ROOT / "README.md").read_text()
    i, j = docs._span(text, "plan-demo")
    block = text[i:j].strip().removeprefix("```text\n").removesuffix("\n```")
    assert block.startswith(f"$ {docs.DEMO_PLAN}\n")
    got = block.split("\n", 1)[1]
    assert docs.TIMING.sub("<t>", got) == docs.TIMING.sub("<t>", printed)


def test_the_pipeline_memory_table_is_rendered_from_its_record(tmp_path: Path) -> None:
    """docs/schedule.md's bytes per rank are bench.pipeline_memory's rows: a changed row makes
    the table stale, and the table shows the new figure."""
    root = _copy(tmp_path)
    row = _bump(root / "docs/results/pipeline_memory.json", "pipeline_memory",
                "pp=4 m=8 zbv rank 3", 1, "pending_weight_grad_bytes")  # fmt: skip
    assert docs.stale(root) == ["docs/schedule.md: pipeline-memory-table"]  # 0.72 MB: the same
    docs.write(root)
    text = (root / "docs/schedule.md").read_text()
    i, j = docs._span(text, "pipeline-memory-table")
    assert f"| {row['measured']:,} / 262,144 |" in text[i:j]
    assert "Predicted within 0.0% of measured in every cell" in text[i:j]  # no longer exact


def test_the_selective_table_is_rendered_from_its_record(tmp_path: Path) -> None:
    """docs/memory-model.md's saved bytes are bench.selective's record: a hand edit and a changed
    row are stale; the saving and the hand count's verdict follow the record."""
    root = _copy(tmp_path)
    md = root / "docs/memory-model.md"
    text = _edit_block(md, "selective-kernels", "| 1,920 B (0.5%) |", "| 1,900 B (0.5%) |")
    assert docs.stale(root) == ["docs/memory-model.md: selective-kernels"]
    docs.write(root)
    assert md.read_text() == text

    # one more s x s fp32 tensor per block kept
    _bump(root / "docs/results/selective.json", "selective_kernels", "math recompute=none", 4800)
    assert docs.stale(root) == ["docs/memory-model.md: selective-kernels"]
    docs.write(root)
    i, j = docs._span(md.read_text(), "selective-kernels")
    block = md.read_text()[i:j]
    assert "| 458,548 B | 411,508 B | 47,040 B (10.3%) | 42,240 B: " in block
    assert "(≠ measured)" in block and "(none -4,800 B)" in block  # the planner's is as before


def test_the_lsp_figures_are_the_planners(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/offload.md's LSP-Offload traffic and the 7B plan's optimizer share come from the
    planner: a hand-counted tiny-model step is in the text, and a changed formula is stale."""
    from llmscale.model.config import get_preset
    from llmscale.plan import offload_traffic

    tiny = get_preset("tiny")
    groups = tiny.parameter_shapes()
    block = [s for _, s in groups["block"] if len(s) == 2]
    assert sorted(block) == [
        (32, 64),
        (32, 64),
        (64, 64),
        (64, 64),
        (64, 192),
        (192, 64),
        (192, 64),
    ]
    # d = min(512, rows or columns // 2): 16 for the 32 x 64 (wk, wv), 32 for the rest
    dxd = tiny.n_layers * 4 * (2 * 16**2 + 5 * 32**2)
    rest = sum(math.prod(s) for _, s in [*groups["embedding"], *groups["head"]])
    rest += tiny.n_layers * sum(math.prod(s) for _, s in groups["block"] if len(s) == 1)
    step = 2 * (dxd + 2 * rest)  # d x d fp32 and the rest in bf16, down and up
    text = (ROOT / "docs/offload.md").read_text()
    i, j = docs._span(text, "lsp-traffic")
    assert f"the tiny model, d = 16–32: {step / 1e6:.2f} MB instead of" in text[i:j]

    root = _copy(tmp_path)
    real = offload_traffic.lsp_bytes_per_step
    monkeypatch.setattr(
        offload_traffic, "lsp_bytes_per_step", lambda *a, **k: real(*a, **k)._replace(up=0)
    )
    docs._run.cache_clear()
    try:
        assert docs.stale(root) == ["docs/offload.md: lsp-traffic", "docs/offload.md: lsp-plan-7b"]
    finally:
        docs._run.cache_clear()


def test_typed_planner_and_results_figures_are_rendered(tmp_path: Path) -> None:
    """README's preset table and docs/memory-model.md's Llama 2 70B bytes per token are the
    planner's; the selective_op figures are the memory suite's rows: each is stale after a hand
    edit or a changed row."""
    from llmscale.model.config import PRESETS, get_preset

    text = (ROOT / "README.md").read_text()
    i, j = docs._span(text, "preset-params")
    for name in PRESETS:
        assert f"{get_preset(name).num_params():,}" in text[i:j], name
    assert (
        "| llama2-7b / 13b / 70b | 6,738,415,616 / 13,015,864,320 / 68,976,648,192 | the same, exactly |"
        in text[i:j]
    )

    root = _copy(tmp_path)
    _edit_block(root / "README.md", "preset-params", "6,738,415,616", "6,738,415,617")
    md = root / "docs/memory-model.md"
    # 22d + 4kv + 8f + 4H + 8 per token (the bf16 sum above it), d 8192, kv 1024, f 28672, H 64
    assert 22 * 8192 + 4 * 1024 + 8 * 28672 + 4 * 64 + 8 == 413_960
    _edit_block(md, "llama70b-block", "413,960 bytes", "413,961 bytes")
    row = _bump(root / "docs/results/results.json", "memory",
                "fp32 mbs=4 recompute=selective_op", 4, "activations")  # fmt: skip
    stale = docs.stale(root)
    for block in (
        "README.md: preset-params",
        "docs/memory-model.md: llama70b-block",
        "docs/memory-model.md: memory-selective-op",
    ):
        assert block in stale
    docs.write(root)
    i, j = docs._span(md.read_text(), "memory-selective-op")
    got = f"fp32 {row['measured']:,.0f} B measured, {row['predicted']:,.0f} predicted"
    assert got in md.read_text()[i:j]


def test_the_lsp_goals_are_rendered_from_the_finetune_suite(tmp_path: Path) -> None:
    """docs/offload.md's LSP-Offload table and its verdicts follow results.json's finetune rows:
    a final loss 5% above ZeRO-Offload's misses the 3% goal."""
    root = _copy(tmp_path)
    text = (root / "docs/offload.md").read_text()
    i, j = docs._span(text, "lsp-finetune")
    assert "(goal: within 3%): met" in text[i:j]
    res = root / "docs/results/results.json"
    data = json.loads(res.read_text())
    rows = data["finetune"]["rows"]
    opt = next(r for r in rows if r["config"] == "optimizer" and r["quantity"].startswith("final"))
    lsp = next(r for r in rows if r["config"] == "lsp" and r["quantity"].startswith("final"))
    lsp["measured"] = opt["measured"] * 1.05
    res.write_text(json.dumps(data))
    assert "docs/offload.md: lsp-finetune" in docs.stale(root)
    docs.write(root)
    text = (root / "docs/offload.md").read_text()
    i, j = docs._span(text, "lsp-finetune")
    assert f"| {opt['measured']:.4f} | {lsp['measured']:.4f} | +5.00% |" in text[i:j]
    assert "final loss +5.00% (goal: within 3%): missed" in text[i:j]


def test_the_bubble_table_is_the_schedule_commands_output(tmp_path: Path) -> None:
    """docs/schedule.md's bubbles are `llmscale schedule --json`'s: 1F1B's rows read
    (p-1)/(m+p-1) and interleaved's (p-1)/(vm+p-1), simulated and closed form; a hand edit is
    stale."""
    text = (ROOT / "docs/schedule.md").read_text()
    i, j = docs._span(text, "schedule-bubbles")
    for p, m in ((4, 8), (4, 32), (8, 32)):
        b = f"{(p - 1) / (m + p - 1):.4f}"
        assert f"| 1f1b | {p} | {m} | 1 | - | {b} | {b} |" in text[i:j]
        b = f"{(p - 1) / (2 * m + p - 1):.4f}"
        assert f"| interleaved_1f1b | {p} | {m} | 2 | - | {b} | {b} |" in text[i:j]
    root = _copy(tmp_path)
    _edit_block(
        root / "docs/schedule.md",
        "schedule-bubbles",
        "| 0.2727 | 0.2727 | 4 |",
        "| 0.27 | 0.27 | 4 |",
    )
    assert docs.stale(root) == ["docs/schedule.md: schedule-bubbles"]


def test_the_finetune_table_is_the_suites(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    res = root / "docs/results/results.json"
    data = json.loads(res.read_text())
    table = data["finetune"]["tables"]["fine-tuning: every mode from the same pretrained weights"]
    table["rows"][1][4] = "999"  # optimizer's step ms
    res.write_text(json.dumps(data))
    assert docs.stale(root) == [
        "docs/offload.md: finetune-table",
        "docs/results.md: the whole file",
    ]
    docs.write(root)
    text = (root / "docs/offload.md").read_text()
    i, j = docs._span(text, "finetune-table")
    assert f"| `optimizer` | {' | '.join(table['rows'][1][1:4])} | 999 |" in text[i:j]


def test_the_inflight_accuracy_follows_the_pipeline_suite(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    res = root / "docs/results/results.json"
    data = json.loads(res.read_text())
    rows = [
        r for r in data["pipeline"]["rows"] if r["quantity"] == "activations in flight, stage 0"
    ]
    gpipe = next(r for r in rows if r["config"] == "pp=2 gpipe m=4")
    gpipe["measured"] = gpipe["predicted"] / 1.05  # 5% under-measured
    res.write_text(json.dumps(data))
    assert "docs/memory-model.md: inflight-accuracy" in docs.stale(root)
    docs.write(root)
    text = (root / "docs/memory-model.md").read_text()
    i, j = docs._span(text, "inflight-accuracy")
    assert text[i:j].endswith(
        f"({len(rows)} configurations, pp 2 and 4, {data['pipeline']['measured_at'][:10]}) it is the prediction to within 5.00%"
    )


def test_the_gantt_charts_are_the_schedule_commands(tmp_path: Path) -> None:
    text = (ROOT / "docs/parallel.md").read_text()
    i, j = docs._span(text, "gantt-1f1b")
    assert text[i:j].startswith(f"\n1F1B, for comparison: bubble {3 / 11:.4f} (`llmscale")
    assert text[i:j].count("\nrank ") == 4
    root = _copy(tmp_path)
    _edit_block(root / "docs/parallel.md", "gantt-zbv", "|F0F1F2F3F4F5F6f0", "|F0F1F2F3F4F5F6F0")
    assert docs.stale(root) == ["docs/parallel.md: gantt-zbv"]


def test_the_zero_stage_table_is_the_rule(tmp_path: Path) -> None:
    """docs/parallel.md's collectives per zero stage: 5 units of the tiny model (4 blocks and
    the root), 4 micro-batches: zero 2 reduce-scatters per micro-batch, zero 3 also gathers
    twice per micro-batch (forward and backward)."""
    text = (ROOT / "docs/parallel.md").read_text()
    i, j = docs._span(text, "zero-stage-collectives")
    units, m = 5, 4
    assert f"| 2 | {units} | {units * m} |" in text[i:j]
    assert f"| 3 | {units * m * 2} | {units * m} |" in text[i:j]
    root = _copy(tmp_path)
    _edit_block(root / "docs/parallel.md", "zero-stage-collectives", "| 3 | 40 |", "| 3 | 41 |")
    assert docs.stale(root) == ["docs/parallel.md: zero-stage-collectives"]


def test_the_rail_only_figures_are_the_network_commands(tmp_path: Path) -> None:
    """docs/planner.md's rail-only cost and all-to-all figures at 4096 H100s equal what its
    rendered `llmscale network --gpus 4096` output shows; a hand edit is stale."""
    text = (ROOT / "docs/planner.md").read_text()
    i, j = docs._span(text, "network")
    shown = text[i:j]
    a, b = docs._span(text, "rail-only-a2a")
    a2a = text[a:b].split(", ")[1].split(" at ")[0]
    assert f"rail-only {a2a} for forwarding" in shown
    c, d = docs._span(text, "rail-only-cost")
    cost = text[c:d].split(": ")[1].split(";")[0]
    rail = next(line for line in shown.splitlines() if "rail-only" in line and "│" in line)
    assert f"{cost} │" in rail
    root = _copy(tmp_path)
    _edit_block(root / "docs/planner.md", "rail-only-a2a", "at 1024", "at 1,024")
    assert docs.stale(root) == ["docs/planner.md: rail-only-a2a"]


def test_the_kv_and_tied_copy_figures_are_the_planners(tmp_path: Path) -> None:
    text = (ROOT / "docs/inference.md").read_text()
    i, j = docs._span(text, "kv-per-token")
    # 2 (K and V) x 80 layers x 8 KV heads x 128 head_dim x 2 B
    assert (
        f"make it {2 * 80 * 8 * 128 * 2:,} bytes in bf16, 1/8 of what 64 heads would" in text[i:j]
    )
    text = (ROOT / "docs/parallel.md").read_text()
    i, j = docs._span(text, "tied-copy-memory")
    got = [float(x) for x in re.findall(r"(\d+\.\d+) GiB", text[i:j])]
    assert got[0] - got[1] == pytest.approx(4 * 50257 * 768 / 2**30, abs=0.01)  # the copy, fp32
    root = _copy(tmp_path)
    _edit_block(root / "docs/inference.md", "kv-per-token", "327,680", "327,600")
    assert docs.stale(root) == ["docs/inference.md: kv-per-token"]


def test_the_parameter_offload_times_are_the_offload_record(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    path = root / "docs/results/offload.json"
    data = json.loads(path.read_text())
    run = next(
        r for r in data["offload_modes"]["runs"]
        if r["offload"] == "optimizer+params" and r["link_gbps"] == 1.0
    )  # fmt: skip
    run["step_s"]["serial"] = 1.2345
    path.write_text(json.dumps(data))
    stale = docs.stale(root)
    assert "docs/offload.md: params-offload-times" in stale
    docs.write(root)
    text = (root / "docs/offload.md").read_text()
    i, j = docs._span(text, "params-offload-times")
    assert "the offloaded step took 1234 ms serially and " in text[i:j]
    assert f"{1e3 * run['offload_work_s']:.0f} ms per step" in text[i:j]


def test_the_costed_counts_are_the_searches(tmp_path: Path) -> None:
    from llmscale.bench.plan_speed import CASES, time_search

    text = (ROOT / "docs/planner.md").read_text()
    i, j = docs._span(text, "plan-costed")
    assert text[i:j] == " and ".join(f"{time_search(c).costed:,}" for c in CASES) + " today"


def test_the_idle_per_rank_is_the_simulators() -> None:
    """(p-1) chunk forwards of 1/2 for the split schedules, (p-1)(t_fwd + t_bwd) for 1F1B."""
    text = (ROOT / "docs/parallel.md").read_text()
    i, j = docs._span(text, "schedule-idle")
    assert f"leave {3 * 0.5:g} of idle per rank here" in text[i:j]
    assert f"against 1F1B's {3 * (1 + 2)}, " in text[i:j] and text[i:j].endswith(": a sixth")


def test_validation_misses_lists_the_rows_outside_the_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/planner.md's "What is not modelled" table: throughput beyond 25% and memory beyond
    15% (issue 25's bars) are listed, rows within them and calibration rows are not; an async-TP
    row's speedup is over its vanilla twin."""
    from types import SimpleNamespace

    import llmscale.validation.runs as runs

    def row(
        rid: str,
        ratio: float,
        mem: float | None = None,
        role: str = "validation",
        fits: bool = True,
    ) -> object:
        return SimpleNamespace(
            id=rid, role=role, ratio=ratio, memory_ratio=mem, predicted=ratio * 100.0,
            published=100.0, memory_predicted=50.0 if mem is None else 50.0 * mem,
            memory_published=None if mem is None else 50.0, fits=fits,
        )  # fmt: skip

    fake = [
        row("fast", 1.26), row("ok", 1.24, 0.86), row("heavy", 1.0, 0.84),
        row("cal", 1.5, role="calibration"), row("x-tp", 1.0), row("x-asynctp", 1.1),
        row("tight", 1.0, fits=False),
    ]  # fmt: skip
    monkeypatch.setattr(runs, "all_results", lambda: fake)
    out = docs.validation_misses(docs.Context(measure=False))
    assert (
        "| fast | throughput | 1.260 |" in out
        and "| heavy | memory | 0.84 (42.0 / 50.0 GiB) |" in out
        and "| tight | fit | does not fit (50.0 GiB predicted) |" in out
    )
    assert "| ok |" not in out and "| cal |" not in out
    assert "x-asynctp: 1.10 predicted, 1.00 published" in out


def test_bubble_estimate_reads_its_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/schedule.md's estimate of the V schedules' closed-form bubble: range and median of
    the seeded draws' closed / simulated - 1; the draws themselves are the simulator's."""
    real = docs.bubble_estimate_errors("zbv", draws=3)
    assert len(real) == 3 and all(-1 < e < 3 for e in real)
    errs = {"zbv": [-0.2, 0.1, 0.5], "dualpipev": [-0.3, -0.01, 0.2]}
    monkeypatch.setattr(docs, "bubble_estimate_errors", lambda schedule: errs[schedule])
    out = docs.bubble_estimate(docs.Context(measure=False))
    assert "from 20% below to 50% above the simulated bubble for zbv (median 10% above)" in out
    assert "from 30% below to 20% above the simulated bubble for dualpipev (median 1% below)" in out


def test_a_negative_hidden_share_reads_as_none() -> None:
    """Where overlapping cost more than it hid (a busy host), the page says so, not 'hid -12%'."""
    assert docs._hid(0.55) == "55%"
    assert docs._hid(-0.12) == "none (its threads cost 12% more)"
