"""Every figure in README.md and docs/ that comes from a run, rendered, never typed: `make docs`.

A rendered block sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->` (a whole
generated file has no markers). Each block is rendered from `docs/results/results.json` (what
`make results` measured), from the planner, or from the command whose output it shows, with the
same renderer as that command: `llmscale plan`'s (`cli.plan.plan_output`), `llmscale claims`'
(`validation.claims.to_markdown`), `llmscale bench --what published`'s
(`bench.published.markdown`), `make results`' page (`bench.report.markdown`). Nothing is re-measured but the plan search's own seconds.

    python -m llmscale.docs            # rewrite every stale block (make docs)
    python -m llmscale.docs --check    # exit 1 naming each stale block (tests/test_docs.py)

Search timings depend on the machine and its load: they are masked when comparing, so a block
whose other figures are current keeps its recorded timing, and a block rewritten for another
reason gets freshly measured ones (`bench/plan_speed.py`'s `time_search`).
"""

from __future__ import annotations

import argparse
import functools
import io
import re
import sys
from collections.abc import Callable, Collection
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console

from llmscale import docs_offload
from llmscale import docs_pages as pages
from llmscale import docs_parallel as par
from llmscale.bench import demo
from llmscale.cli.plan import plan_output
from llmscale.paths import RESULTS_JSON, SOURCE_ROOT
from llmscale.report.search_report import PlanReport
from llmscale.ui import value_range
from llmscale.validation.claims import Claim, Results, check_claims, results_notice, to_markdown

# A search's wall or CPU seconds, as `plan` and this module print them ("0.92 s").
TIMING = re.compile(r"\b\d+\.\d+ s\b")
DEMO_PLAN = " ".join(demo.PLAN)


class Context:
    """What the renderers read, each computed once: the results, the claims, the plan search.
    `measure`: time the plan searches (else their seconds read 0.00, to be masked)."""

    def __init__(self, results: Path = RESULTS_JSON, measure: bool = True) -> None:
        self.results_path = results
        self.measure = measure

    @cached_property
    def results(self) -> Results:
        return Results(self.results_path)

    @cached_property
    def claims(self) -> list[Claim]:
        return check_claims(self.results_path)

    def record(self, name: str, suite: str) -> dict[str, Any] | None:
        """Suite `suite` of the record `name` beside results.json (docs/results/NAME, what a
        bench recorder wrote); None where it is missing."""
        return Results(self.results_path.parent / name).suite(suite)

    @cached_property
    def demo(self) -> dict[str, Any] | None:
        """docs/results/demo.json (what `make demo` recorded), beside results.json."""
        return self.record("demo.json", demo.SUITE)

    def timing(self, name: str) -> dict[str, Any] | None:
        """docs/results/timings.json's wall-time row of `name` (`bench/timed.py`)."""
        rows = Results(self.results_path.parent / "timings.json").rows("timings", "wall time")
        return rows.get(name)

    def claim(self, starts: str) -> Claim:
        return next(c for c in self.claims if c.claim.startswith(starts))

    def rows(self, suite: str, quantity: str) -> dict[str, dict[str, Any]]:
        return self.results.rows(suite, quantity)


def _text(*parts: Any) -> str:
    """Rich renderables as a pipe sees them (`ui.console()`: 200 columns, no colour)."""
    buf = io.StringIO()
    con = Console(file=buf, width=200, highlight=False, soft_wrap=True, color_system=None)
    for p in parts:
        con.print(p)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


# ---- the planner ------------------------------------------------------------------------------


def plan_demo(ctx: Context) -> str:
    """README: the plan `make demo` ends with, as `llmscale plan` prints it."""
    return f"```text\n$ {DEMO_PLAN}\n{_text(*plan_output(_demo_search(), wide=False))}\n```"


def plan_demo_wide(ctx: Context) -> str:
    """docs/planner.md: the same search with every column (`--wide`)."""
    out = _text(*plan_output(_demo_search(), wide=True))
    return f"```text\n$ {DEMO_PLAN} --wide\n{out}\n```"


@functools.cache
def _demo_search() -> PlanReport:
    """One search per process: the planner's inputs do not change while it runs."""
    from llmscale.report.search_report import plan_report

    return plan_report("llama2-70b", 64, "h200", 4096, 1024, "bf16", 5)


@functools.cache
def _case_search(case: Any) -> Any:
    """A bench/plan_speed.py case's cold search (`time_search`: the least seconds of 3 runs, as
    `plan_speed --repeat 3` prints them, a single run on a shared machine varying by half), read
    by every block that reports on its time. Timed in a process of its own, as `llmscale plan`
    and `plan_speed` run it: inside this one, which holds every other block's objects, the same
    search took a fifth longer (0.57 s against 0.47 s of CPU, 2026-12-07)."""
    import json
    import subprocess

    from llmscale.bench.plan_speed import CASES, Timing

    code = (
        "import json; from llmscale.bench.plan_speed import CASES, time_search; "
        f"print(json.dumps(time_search(CASES[{CASES.index(case)}], repeat=3)._asdict()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return Timing(**json.loads(out.stdout))


@functools.cache
def _case_costed(case: Any) -> int:
    """The plans a bench/plan_speed.py case's search costs (the same on every run)."""
    from llmscale.bench.plan_speed import time_search

    return int(time_search(case).costed)


def _search_seconds(ctx: Context, case: Any) -> float:
    return float(_case_search(case).cpu_s) if ctx.measure else 0.0


def plan_speed(ctx: Context) -> str:
    """README: how long the largest search of bench/plan_speed.py takes (CPU seconds, cold)."""
    from llmscale.bench.plan_speed import CASES

    case = max(CASES, key=lambda c: c.gpus)
    s = _search_seconds(ctx, case)
    return (
        f"{case.model} on {case.gpus:,} {case.gpu.upper()}s in {s:.2f} s of CPU time, cold "
        "(`python -m llmscale.bench.plan_speed`; measured by `make docs`)"
    )


def plan_speed_cases(ctx: Context) -> str:
    """docs/planner.md: every case of bench/plan_speed.py, CPU seconds, cold."""
    from llmscale.bench.plan_speed import CASES

    parts = []
    for case in CASES:
        s = _search_seconds(ctx, case)
        parts.append(f"{case.label()}: {s:.2f} s")
    return "CPU time of a cold search, measured by `make docs` on this machine: " + "; ".join(parts)


def plan_costed(ctx: Context) -> str:
    """docs/planner.md: how many plans each of bench/plan_speed.py's searches costs today (the
    search's `evaluated`, what `llmscale plan --json` reports; not a timing)."""
    from llmscale.bench.plan_speed import CASES

    return " and ".join(f"{_case_costed(c):,}" for c in CASES) + " today"


def megatron_ratios(ctx: Context) -> str:
    """README: the time model against Narayanan et al. 2021, Table 1."""
    from llmscale.validation.published import narayanan_rows

    rows = narayanan_rows()
    ratios = [r.ratio for r in rows]
    return (
        f"predicted/published TFLOP/s per GPU is {min(ratios):.3f}–{max(ratios):.3f} for all "
        f"{len(rows)} rows"
    )


def stack_errors(ctx: Context) -> str:
    """docs/planner.md: per-stack errors over today's validation runs (the same summary lines
    as docs/planner-validation.md)."""
    from llmscale.validation.runs import all_results, summarise

    return "; ".join(s.line for s in summarise(all_results()))


# The draws behind docs/schedule.md's estimate of the V schedules' closed-form bubble.
BUBBLE_DRAWS = 500
BUBBLE_SEED = 0


def bubble_estimate_errors(schedule: str, draws: int = BUBBLE_DRAWS) -> list[float]:
    """closed-form / simulated bubble - 1 for `schedule` (zbv, dualpipev) over seeded random
    costs with W <= F and W <= B (F, B: 0.5-2; p = 2..8, m = 2p..2p+12; t_bwd = B + W)."""
    import random

    from llmscale.plan.schedule import bubble_fraction, simulate

    rng = random.Random(BUBBLE_SEED)
    errs = []
    for _ in range(draws):
        p = rng.randint(2, 8)
        m = rng.randint(2 * p, 2 * p + 12)
        f, b = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)
        w = rng.uniform(0.05, min(f, b))
        sim = simulate(schedule, p, m, 2, t_fwd=f, t_bwd=b + w, t_w=w, timeline=False)
        closed = bubble_fraction(schedule, p, m, 2, f, b + w, w)
        errs.append(closed / sim.bubble_fraction - 1)
    return errs


def bubble_estimate(ctx: Context) -> str:
    """docs/schedule.md: how far the V schedules' closed-form bubble (the search's estimate) is
    from the simulated one where W differs from F and B (`bubble_estimate_errors`)."""
    parts = []
    for schedule in ("zbv", "dualpipev"):
        e = sorted(bubble_estimate_errors(schedule))
        med = e[len(e) // 2]

        def pct(x: float) -> str:
            return f"{abs(x):.0%} {'below' if x < 0 else 'above'}"

        parts.append(f"from {pct(e[0])} to {pct(e[-1])} the simulated bubble for {schedule} "
                     f"(median {pct(med)})")  # fmt: skip
    return (
        f"over {BUBBLE_DRAWS} random draws (seed {BUBBLE_SEED}) with W <= F and W <= B "
        f"(p = 2..8, m = 2p..2p+12) it was " + " and ".join(parts)
    )


# Issue 25's bars over validation rows: throughput within 25%, memory within 15% where published.
THROUGHPUT_BAR = 0.25
MEMORY_BAR = 0.15


def validation_misses(ctx: Context) -> str:
    """docs/planner.md, "What is not modelled": the validation rows outside issue 25's bars
    (throughput beyond 25%, memory beyond 15%) and each async-TP row's predicted speedup over
    its vanilla-TP twin against the published one, from today's planner."""
    from llmscale.validation.runs import all_results

    results = {r.id: r for r in all_results() if r.role == "validation"}
    slow = [r for r in results.values() if abs(r.ratio - 1) > THROUGHPUT_BAR]
    heavy = [
        r for r in results.values()
        if r.memory_ratio is not None and abs(r.memory_ratio - 1) > MEMORY_BAR
    ]  # fmt: skip
    lines = ["| row | quantity | predicted / published |", "|---|---|---|"]
    lines += [f"| {r.id} | throughput | {r.ratio:.3f} |" for r in slow]
    lines += [
        f"| {r.id} | memory | {r.memory_ratio:.2f} ({r.memory_predicted:.1f} / "
        f"{r.memory_published:.1f} GiB) |"
        for r in heavy
    ]
    lines += [
        f"| {r.id} | fit | does not fit ({r.memory_predicted:.1f} GiB predicted) |"
        for r in results.values()
        if not r.fits
    ]
    pairs = []
    for rid, r in results.items():
        if "asynctp" not in rid:
            continue
        twin = results.get(rid.replace("-asynctp", "-tp")) or results.get(
            rid.replace("-asynctp", "")
        )
        if twin is not None:
            pairs.append(
                f"{rid}: {r.predicted / twin.predicted:.2f} predicted, "
                f"{r.published / twin.published:.2f} published"
            )
    return "\n".join(lines) + "\n\nAsync TP over vanilla TP: " + "; ".join(pairs) + "."


def serving_ratio(ctx: Context) -> str:
    """README: the serving model's H200/H100 ratio at NVIDIA's batches (claims' row)."""
    ratio = ctx.claim("H200 runs Llama 2 70B").rule.claim[0].figure
    return f"H200 / H100 = {ratio:.2f} predicted"


def claims_summary(ctx: Context) -> str:
    """README: the claims' verdict counts and the rows that do not hold, from `claims`."""
    rows = ctx.claims
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    fails = [r.claim for r in rows if r.verdict == "does not hold here"]
    u = ctx.claim("31% of gradient values").rule.claim[0].figure
    under = "not measured" if u is None else f"{u:.2%}"
    cut = ctx.claim("accumulation cuts").rule.claim[0].figure
    accum = (
        "not measured" if cut is None
        else f"{cut:.1%} faster" if cut >= 0 else f"{-cut:.1%} slower"
    )  # fmt: skip
    rail = ctx.claim("rail-only").figure.split(" (")[0]
    return (
        f"{len(rows)} claims: "
        + ", ".join(f"{n} {v}" for v, n in counts.items())
        + f". Not holding here: {'; '.join(fails) or 'none'} (fp16 underflow {under} here; "
        f"accumulation {accum} here); rail-only {rail}"
    )


def roofline_training(ctx: Context) -> str:
    """README: Llama 2 70B's training step against the H200's ridge point (`llmscale roofline
    --gpu h200 --model llama2-70b --batch 1 --seq 4096`)."""
    from llmscale.hardware.catalog import default_catalog
    from llmscale.model.config import get_preset
    from llmscale.plan import roofline

    r = roofline.training(get_preset("llama2-70b"), default_catalog().gpu("h200"), 1, 4096)
    return (
        f"training on an H200 does {r.intensity:,.0f} FLOP per byte against a ridge point of "
        f"{r.ridge:,.0f}: {r.bound}"
    )


def fp16_underflow(ctx: Context) -> str:
    """README: the precision suite's fp16 underflow table, medians over the seeds."""
    t = ctx.results.table("precision", "fp16 gradient underflow")
    if t is None:
        return "not measured yet (make results)"
    head, rows = t
    by = {r[0]: dict(zip(head, r, strict=True)) for r in rows}
    r0 = by["2^0"]
    return (
        f"**{r0['cast: underflow']} vanish unscaled ({r0['fp16 backward: underflow']} with the "
        f"backward itself in fp16), {by['2^3']['cast: underflow']} at 2^3, "
        f"{by['2^15']['cast: underflow']} at 2^15** (runs {r0['cast: range']} unscaled; "
        f"measured {_when(ctx, 'precision')})"
    )


def loader_memory(ctx: Context) -> str:
    """README: the shard loader's resident memory over corpus sizes (the loader suite)."""
    rss = ctx.rows("loader", "RSS")
    if not rss:
        return "resident memory not measured yet: make results"
    sizes = sorted(rss, key=lambda k: float(k.split(" MB")[0]))
    lo, hi = rss[sizes[0]], rss[sizes[-1]]
    gib = [r["measured"] / 2**30 for r in rss.values()]
    flat = "flat" if max(gib) - min(gib) < 0.05 * max(gib) else "not flat"
    return (
        f"resident memory {flat} from {sizes[0].split(',')[0]} to {sizes[-1].split(',')[0]} of "
        f"tokens, {lo['measured'] / 2**30:.2f} and {hi['measured'] / 2**30:.2f} GiB, in `make "
        f"results` ({_when(ctx, 'loader')})"
    )


def overhead_ratio(ctx: Context) -> str:
    """README: the trainer's step over a plain loop's (`bench/overhead.py --json-out`)."""
    rec = Results(ctx.results_path.parent / "overhead.json")
    suite = rec.suite("overhead")
    row = next(iter(rec.rows("overhead", "trainer / plain loop").values()), None)
    if suite is None or row is None:
        return "not recorded yet: `python -m llmscale.bench.overhead --json-out " \
            "docs/results/overhead.json`"  # fmt: skip
    return (
        f"{row['measured']:.3f} on {row['config']}, {suite['measured_at'][:10]}: {row['note']}; "
        "goal <= 1.03"
    )


def serving_table(ctx: Context) -> str:
    """docs/inference.md: H100 vs H200 serving Llama 2 70B, as `llmscale infer` predicts it."""
    from llmscale.model.config import get_preset
    from llmscale.plan import inference

    model = get_preset("llama2-70b")
    cases = [
        ("1 GPU, fp8, 2048 in / 128 out, NVIDIA's batches 8 and 32", 1, 2048, 128, "fp8", (8, 32)),
        ("1 GPU, fp8, 2048 / 128, the largest batch that fits", 1, 2048, 128, "fp8", None),
        ("8 GPUs, fp8, 1024 / 294 (MLPerf-shaped), best tp", 8, 1024, 294, "fp8", None),
        ("8 GPUs, bf16, 1024 / 294, best tp", 8, 1024, 294, "bf16", None),
    ]
    lines = ["| case | H100 | H200 | H200 / H100 |", "|---|---|---|---|"]
    for i, (name, gpus, inp, out, prec, batches) in enumerate(cases):
        p = [
            inference.predict(model, g, gpus, inp, out, prec, batch=batches[k] if batches else None)
            for k, g in enumerate(("h100", "h200"))
        ]
        if batches is None:
            name += (
                f" ({'tp' if gpus > 1 else 'batch'} "
                + " and ".join(str(x.tp if gpus > 1 else x.batch) for x in p)
                + ")"
            )
        ratio = f"{p[1].tokens_per_s / p[0].tokens_per_s:.2f}"
        lines.append(
            f"| {name} | {p[0].tokens_per_s:,.0f} tok/s | {p[1].tokens_per_s:,.0f} tok/s | "
            + (f"**{ratio}** (NVIDIA: 1.9)" if i == 0 else ratio)
            + " |"
        )
    return "\n".join(lines)


def serving_reading(ctx: Context) -> str:
    """docs/inference.md: what the serving table says, its figures from the same predictions
    (NVIDIA's batches 8 and 32 and its 303 tok/s are the launch post's, cited above)."""
    from llmscale.hardware.catalog import default_catalog
    from llmscale.model.config import get_preset
    from llmscale.plan import inference

    model, cat = get_preset("llama2-70b"), default_catalog()

    def pair(gpus: int, inp: int, out: int, prec: str, b: tuple[int, int] | None = None) -> Any:
        return [
            inference.predict(model, g, gpus, inp, out, prec, batch=b[k] if b else None)
            for k, g in enumerate(("h100", "h200"))
        ]

    nv, fit = pair(1, 2048, 128, "fp8", (8, 32)), pair(1, 2048, 128, "fp8")
    ml = [pair(8, 1024, 294, prec) for prec in ("fp8", "bf16")]

    def ratio(p: Any) -> float:
        return float(p[1].tokens_per_s / p[0].tokens_per_s)

    r_nv, r_fit = ratio(nv), ratio(fit)
    r_ml = sorted(ratio(p) for p in ml)
    bw = cat.gpu("h200").hbm_bandwidth / cat.gpu("h100").hbm_bandwidth
    h200, big = nv[1], fit[1]
    share = h200.prefill_s / h200.batch_seconds
    return "\n".join([
        f"- At NVIDIA's batches the model lands within {abs(r_nv / 1.9 - 1):.0%} of 1.9x "
        f"({r_nv:.2f}): the H200 decodes four times as many sequences per weight read (its "
        "141 GB leave room for 32 KV caches where the H100's 80 GB leave room for 8) at "
        f"{bw:.2f}x the bandwidth. The ratio is mostly capacity, not bandwidth.",
        f"- The H200's absolute figure is {h200.tokens_per_s:,.0f} tok/s predicted against 303 "
        "measured: the static-batch model's prefill and the catalog's calibrated rates are not "
        "TensorRT-LLM's kernels.",
        f"- Each phase's regime: the prefill of 2,048-token prompts is {h200.prefill.bound} "
        f"({h200.prefill.intensity:,.0f} FLOP/B against the ridge point of "
        f"{h200.prefill.ridge:,.0f} FLOP/B for FP8 on the H200) and takes {share:.0%} of a "
        f"batch's time at batch {h200.batch}; each decode step is {h200.decode.bound} "
        f"({h200.decode.intensity:,.0f} FLOP/B at batch {h200.batch}, "
        f"{big.decode.intensity:,.0f} at batch {big.batch}). So \"compute-bound rather than "
        "memory-bound\" holds for the time spent, not for the decode steps where the H200's "
        "gain is.",
        f"- Let both GPUs fill their memory and the ratio falls to {r_fit:.2f}: at batch "
        f"{big.batch} the H200 spends {big.prefill_s / big.batch_seconds:.0%} of its time in "
        f"{big.prefill.bound} prefill, where it is no faster than the H100. With MLPerf's "
        "shorter prompts over 8 GPUs both systems batch hundreds of sequences and the ratio is "
        f"{r_ml[0]:.2f}-{r_ml[1]:.2f} (fp8 and bf16).",
    ])  # fmt: skip


@functools.cache
def _run(argv: tuple[str, ...]) -> str:
    """What `llmscale ARGV` prints on stdout through a pipe (its own renderer); once per
    process, as the demo's search (these commands read no results)."""
    import contextlib

    from llmscale.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    if rc != 0:
        raise RuntimeError(f"llmscale {' '.join(argv)} exited {rc}")
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").splitlines())


def commands(*lines: str) -> Callable[[Context], str]:
    """A block of `$ llmscale ...` lines, each followed by what it prints."""

    def render(ctx: Context) -> str:
        parts = [f"$ {line}\n{_run(tuple(line.split()[1:]))}" for line in lines]
        return "```text\n" + "\n\n".join(parts) + "\n```"

    render.__doc__ = "; ".join(lines)
    return render


# ---- make demo -------------------------------------------------------------------------------


def demo_run(ctx: Context) -> str:
    """README: what the demo's train command printed, from its record (`bench/demo.py`), with
    the command's own renderers."""
    rec = ctx.demo
    if rec is None:
        return "```text\nnot recorded yet: make demo\n```"
    command: str = rec["commands"][0]
    return "```text\n$ " + command + "\n" + "\n".join(demo.transcript(rec)) + "\n```"


def demo_wall(ctx: Context) -> str:
    """README: how long `make demo` took (its record's wall-time row), when, under what load."""
    rec = ctx.demo
    w = demo.wall(rec) if rec else None
    if rec is None or w is None:
        return "not timed yet: make demo"
    return f"{w['measured']:.0f} s on {rec['measured_at'][:10]}; {w['note']}"


def demo_fit(ctx: Context) -> str:
    """README: the demo's predicted-vs-measured summary (memory rows, the step-time ratio, and
    the other processes' load while it trained and while its calibration was measured)."""
    rec = ctx.demo
    if rec is None:
        return "not recorded yet: make demo"
    mem = [r for r in demo.table_rows(rec) if r.unit == "B"]
    exact = all(r.predicted == r.measured for r in mem)
    ratio = demo.step_ratio(rec)
    load = demo.load_line(rec)
    return (
        ("memory exact" if exact else "memory not exact: see the table")
        + ", step time predicted/measured "
        + ("-" if ratio is None else f"{ratio:.2f}")
        + (f" ({load})" if load else "")
    )


def test_time(ctx: Context) -> str:
    """README: how long `make test` took when `make test-timed` last ran it."""
    r = ctx.timing("make test")
    how = "`make test-timed` runs it and records its wall time"
    if r is None:
        return f"`make test` has not been timed here yet: {how}."
    return (
        f"`make test` took {r['measured'] / 60:.0f} minutes ({r['measured']:.0f} s) on "
        f"{r['measured_at'][:10]}; {r['note']} ({how})."
    )


# ---- the pipeline bench -----------------------------------------------------------------------


def _pipeline(ctx: Context) -> dict[str, dict[str, dict[str, Any]]]:
    """{config: {quantity: row}} of the pipeline suite, in the suite's order."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in (ctx.results.suite("pipeline") or {}).get("rows", []):
        out.setdefault(r["config"], {})[r["quantity"]] = r
    return out


def pipeline_configs(ctx: Context) -> str:
    """docs/pipeline-bench.md: which configurations the suite ran (make results)."""
    runs = _pipeline(ctx)
    groups: dict[str, list[str]] = {}
    for config in runs:
        head, m = config.rsplit(" m=", 1)
        groups.setdefault(head, []).append(m)
    listed = "; ".join(f"{head} m={', '.join(ms)}" for head, ms in groups.items())
    return f"{len(runs)} configurations in `make results`' run: {listed}"


def _op_times(ctx: Context) -> tuple[list[float], list[float]] | None:
    """The pipeline suite's mean op times (forward and backward, every stage) and p2p waits, ms."""
    t = ctx.results.table("pipeline", "measured op times")
    if t is None:
        return None
    head, rows = t
    col = {h: i for i, h in enumerate(head)}
    ops = [float(x) for r in rows for c in ("forward", "backward") for x in r[col[c]].split()]
    return ops, [float(r[col["p2p wait"]]) for r in rows]


def pipeline_op_range(ctx: Context) -> str:
    """docs/pipeline-bench.md: the range of the ops the instrument times (make results)."""
    t = _op_times(ctx)
    return "ops not measured yet" if t is None else f"ops of {min(t[0]):.0f}-{max(t[0]):.0f} ms"


def pipeline_p2p_range(ctx: Context) -> str:
    """docs/pipeline-bench.md: the median p2p waits of the pipeline suite's runs."""
    t = _op_times(ctx)
    return "not measured yet" if t is None else f"{min(t[1]):.2f}-{max(t[1]):.2f} ms"


def pipeline_results(ctx: Context) -> str:
    """docs/pipeline-bench.md's results: the suite's rows and op times, and what they say."""
    runs = _pipeline(ctx)
    suite = ctx.results.suite("pipeline") or {}
    t = ctx.results.table("pipeline", "measured op times")
    if not runs or t is None:
        return "Not measured yet: `make results`."
    head, op_rows = t
    ops = {r[0]: dict(zip(head, r, strict=True)) for r in op_rows}

    def idle(c: str) -> float:
        return float(ops[c]["idle, inputs ready"].rstrip("%"))

    lines = [
        f"From `make results` (`llmscale bench --what pipeline`), measured "
        f"{suite.get('measured_at', 'undated')}. " + " ".join(suite.get("notes", [])),
        "",
        "| configuration | measured | simulated | closed form | replayed | idle, inputs ready "
        "| makespan measured | makespan simulated | order |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c, q in runs.items():
        sim, closed, span = q["bubble (simulator)"], q["bubble (closed form)"], q["makespan"]
        order = "= simulator" if sim["note"].startswith("order = simulator") else "differs"
        lines.append(
            f"| {c} | {sim['measured']:.1f}% | {sim['predicted']:.1f}% | "
            f"{closed['predicted']:.1f}% | {ops[c]['bubble, replayed']} | "
            f"{ops[c]['idle, inputs ready']} | {1e3 * span['measured']:.0f} ms | "
            f"{1e3 * span['predicted']:.0f} ms | {order} |"
        )
    lines += [
        "",
        "Measured op times (ms, mean per stage) fed to the simulator, from the same run:",
        "",
        "| configuration | forward | backward | p2p wait |",
        "|---|---:|---:|---:|",
        *(f"| {c} | {o['forward']} | {o['backward']} | {o['p2p wait']} |" for c, o in ops.items()),
    ]
    same = [c for c, q in runs.items() if q["bubble (simulator)"]["note"].startswith("order =")]
    gap = {c: q["bubble (simulator)"]["measured"] - q["bubble (simulator)"]["predicted"]
           for c, q in runs.items()}  # fmt: skip

    def rng(cs: list[str], f: Callable[[str], float], unit: str) -> str:
        vals = [f(c) for c in cs if c in runs]
        return f"{min(vals):.1f}-{max(vals):.1f}{unit}" if vals else "-"

    pp2 = [c for c in runs if c.startswith("pp=2")]
    pp4 = [c for c in runs if c.startswith("pp=4")]
    inter2 = [c for c in pp2 if "interleaved" in c]
    f1b2 = [c for c in pp2 if " 1f1b " in c]
    lines += [
        "",
        "### Reading it",
        "",
        f"- **Order.** In {len(same)} of {len(runs)} configurations every rank ran its ops in "
        "exactly the order `schedule_ops` gives (`tests/plan/test_schedule_torch.py` checks "
        "those lists against torch's own; `tests/bench/test_bench_pipeline.py` that no op "
        "starts before its inputs).",
    ]
    a, b = runs.get("pp=2 1f1b m=2"), runs.get("pp=2 1f1b m=4")
    if a and b:
        sa, sb = a["bubble (simulator)"], b["bubble (simulator)"]
        lines.append(
            f"- **pp = 2, 1F1B at small m.** m = 2 and m = 4: bubble {sa['predicted']:.1f} vs "
            f"{sa['measured']:.1f}% and {sb['predicted']:.1f} vs {sb['measured']:.1f}% "
            f"(simulated vs measured), makespan {1e3 * a['makespan']['predicted']:.0f} vs "
            f"{1e3 * a['makespan']['measured']:.0f} ms and {1e3 * b['makespan']['predicted']:.0f} "
            f"vs {1e3 * b['makespan']['measured']:.0f} ms; idle with inputs ready "
            f"{rng(f1b2, idle, '%')} for pp = 2 1F1B."
        )
    if "pp=2 1f1b m=8" in runs:
        c = "pp=2 1f1b m=8"
        lines.append(
            "- **The replay.** Where measured exceeds simulated by more than the idle column, "
            "ops varied: the replay (every op its own time) keeps that variation, the per-stage "
            f"means do not; e.g. {c}: {ops[c]['bubble, replayed']} replayed, "
            f"{runs[c]['bubble (simulator)']['predicted']:.1f}% simulated, "
            f"{runs[c]['bubble (simulator)']['measured']:.1f}% measured. A slow op on the "
            "critical path delays every rank; a fast one elsewhere gives nothing back."
        )
    if inter2:
        best = {}
        for m in ("4", "8"):
            cs = [c for c in pp2 if c.endswith(f" m={m}") and any(
                k in c for k in (" gpipe ", " 1f1b ", "interleaved"))]  # fmt: skip
            if cs:
                best[m] = min(cs, key=lambda c: runs[c]["bubble (simulator)"]["measured"])
        lines.append(
            "- **Interleaving pays a per-op cost the simulator does not model** (Python between "
            "ops whose inputs are there; twice the ops of 1F1B): idle with inputs ready "
            f"{rng(inter2, idle, '%')} for pp = 2 interleaved against {rng(f1b2, idle, '%')} for "
            f"1F1B, measured bubble {rng(inter2, gap.__getitem__, ' points')} above the "
            "simulated one. Smallest measured bubble at pp = 2 among GPipe, 1F1B and "
            "interleaved: " + ", ".join(f"m = {m}: {c}" for m, c in best.items()) + "."
        )
    if pp4:
        lines.append(
            "- **pp = 4 on 2 cores is contention, not pipelining.** Four ranks share two cores: "
            f"idle with inputs ready {rng(pp4, idle, '%')}, measured bubbles "
            f"{rng(pp4, gap.__getitem__, ' points')} above simulated. Read these rows as a "
            "check of order and dependencies, not of timing."
        )
    return "\n".join(lines)


def cp_results(ctx: Context) -> str:
    """docs/parallel.md: the cp suite of `make results`."""
    cp, ratio = ctx.rows("cp", "step time"), ctx.rows("cp", "step time ratio")
    base, ring = cp.get("dp_replicate=2, b=2"), cp.get("cp=2, b=4")
    if not (base and ring and ratio):
        return "The cp suite has not been measured yet (`make results`)."
    r = next(iter(ratio.values()))

    def ms(x: float) -> str:
        return f"{1e3 * x:.0f}"

    return (
        f"In `make results`' run ({ctx.results.when('cp')}): baseline {ms(base['measured'])} ms "
        f"measured vs {ms(base['predicted'])} ms predicted "
        f"({base['predicted'] / base['measured']:.2f}), cp=2 {ms(ring['measured'])} vs "
        f"{ms(ring['predicted'])} ms ({ring['predicted'] / ring['measured']:.2f}), ratio "
        f"cp/baseline {r['measured']:.2f} vs {r['predicted']:.2f} "
        f"({r['predicted'] / r['measured']:.2f})"
    )


def _lsp_figures(ctx: Context) -> str | None:
    """The finetune suite: lsp against ZeRO-Offload's bytes, loss and step time per link."""
    moved = ctx.rows("finetune", "bytes moved per step")
    loss = ctx.rows("finetune", "final loss (last 5)")
    t = ctx.results.suite_rows("finetune-time", "step time (median)")
    if not (moved.get("lsp") and moved.get("optimizer")):
        return None
    lsp, opt = moved["lsp"], moved["optimizer"]
    exact = all(r["measured"] == r["predicted"] for r in moved.values() if r["predicted"])
    speeds = [
        f"{t[f'lsp @ {k}']['measured'] / t[f'optimizer @ {k}']['measured']:.2f} ({k})"
        for k in ("native", "1 GB/s", "0.1 GB/s")
        if f"lsp @ {k}" in t and f"optimizer @ {k}" in t
    ]
    dl = loss["lsp"]["measured"] / loss["optimizer"]["measured"] - 1 if loss else float("nan")
    return (
        f"bytes moved per step measured {'=' if exact else '≠'} predicted "
        f"({lsp['measured'] / 1e6:.2f} MB vs {opt['measured'] / 1e6:.1f} MB: "
        f"{lsp['measured'] / opt['measured']:.2f}x); final loss {dl:+.2%}; step time "
        f"lsp/optimizer {', '.join(speeds)}"
    )


def _lsp_step(name: str) -> tuple[Any, list[tuple[tuple[int, int], int]], float, float]:
    """The planner's one-process step of preset `name` in bf16 without accumulation, at the
    config's lsp_dim and lsp_nonzeros: the plan, each block matrix shape with its d, and the bytes
    moved per step under lsp and under ZeRO-Offload ("optimizer"; `plan/offload_traffic.py`)."""
    import dataclasses

    from llmscale.model.config import get_preset
    from llmscale.plan import activations as act
    from llmscale.plan.lsp import matrix_dims, one_process_split
    from llmscale.plan.offload_traffic import offload_traffic
    from llmscale.plan.plan import Plan

    model = get_preset(name)
    lsp = Plan(model=model, seq_len=128, micro_batch_size=1, global_batch_size=1,
               precision="bf16", offload="lsp")  # fmt: skip
    kern = act.Kernels.for_runtime(model, 1)
    moved = {}
    for mode in ("lsp", "optimizer"):
        t = offload_traffic(dataclasses.replace(lsp, offload=mode), 0, kern)
        assert t is not None
        moved[mode] = t.total
    mats = sorted({
        (s, matrix_dims(s, lsp.lsp_dim, lsp.lsp_nonzeros)[0])
        for s in one_process_split(model).matrices
    })  # fmt: skip
    return lsp, mats, moved["lsp"], moved["optimizer"]


def _kib(n: float) -> str:
    return f"{n / 2**10:,.0f} KiB"


def lsp_traffic(ctx: Context) -> str:
    """docs/offload.md: what LSP-Offload moves per step for the small and tiny models against
    ZeRO-Offload, from the planner (`plan.lsp`, `plan.offload_traffic`)."""
    from llmscale.config import DTYPE_BYTES

    plan, mats, lsp, opt = _lsp_step("small")
    by_d: dict[int, list[str]] = {}
    for (m, n), d in mats:
        by_d.setdefault(d, []).append(f"{m} x {n}")
    dims = "; ".join(f"d = {d} for {', '.join(s)}" for d, s in sorted(by_d.items()))
    moved = sorted({4 * d * d for _, d in mats})
    whole = sorted({DTYPE_BYTES["bf16"] * m * n for (m, n), _ in mats})

    def span(xs: list[int]) -> str:
        return _kib(xs[0]) if len(xs) == 1 else f"{xs[0] / 2**10:,.0f}–{_kib(xs[-1])}"

    _, tmats, tlsp, topt = _lsp_step("tiny")
    tds = sorted({d for _, d in tmats})
    tdim = f"{tds[0]}–{tds[-1]}" if len(tds) > 1 else str(tds[0])
    return (
        f"For the small model (lsp_dim {plan.lsp_dim}: {dims}) the blocks move {span(moved)} "
        f"per matrix per direction instead of {span(whole)} in bf16: a step of the small model "
        f"moves {lsp / 1e6:.1f} MB instead of ZeRO-Offload's {opt / 1e6:.1f} MB in bf16 without "
        f"accumulation ({lsp / opt:.2f}x; the tiny model, d = {tdim}: "
        f"{tlsp / 1e6:.2f} MB instead of {topt / 1e6:.2f} MB, {tlsp / topt:.2f}x; "
        "`lsp_bytes_per_step` and `plan.offload_traffic`, rendered by `make docs`)"
    )


LSP_7B = ("plan", "--model", "llama2-7b", "--gpus", "1", "--gpu", "h200", "--seq", "2048",
          "--global-batch", "8", "--mbs", "2")  # fmt: skip


def lsp_plan_7b(ctx: Context) -> str:
    """docs/offload.md: the optimizer's share of a Llama-2 7B step on one H200 under lsp and
    under ZeRO-Offload, as `llmscale plan ... --offload MODE --json` prices it."""
    import json

    share, inputs = {}, {}
    for mode in ("lsp", "optimizer"):
        out = json.loads(_run((*LSP_7B, "--offload", mode, "--json")))
        best = out["candidates"][0]
        share[mode] = best["step_time"]["breakdown_seconds"]["optimizer"]
        inputs = best["plan"]

    def sec(x: float) -> str:
        return f"{1e3 * x:.0f} ms" if x < 1 else f"{x:.1f} s"

    mb = inputs["global_batch_size"] // inputs["micro_batch_size"]
    return (
        f"for Llama-2 7B on one H200 in {inputs['precision']} ({inputs['micro_batch_size']} x "
        f"{inputs['seq_len']} tokens x {mb} micro-batches) the offloaded optimizer's share is "
        f"{sec(share['lsp'])} against ZeRO-Offload's {sec(share['optimizer'])} "
        f"(`llmscale {' '.join(LSP_7B)} --offload lsp`)"
    )


def finetune_table(ctx: Context) -> str:
    """docs/offload.md: the finetune suite's table of every offload mode from the same
    pretrained weights, and its loss plot, as `make results` recorded them."""
    t = ctx.results.table("finetune", "fine-tuning: every mode")
    suite = ctx.results.suite("finetune") or {}
    if t is None:
        return "The finetune suite has not been measured yet (`make results`)."
    head, rows = t
    lines = [
        f"`make results`' finetune suite (measured {_when(ctx, 'finetune')}): "
        f"{suite.get('title', '')}. {' '.join(suite.get('notes', [])[:1])}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join([f"`{r[0]}`", *r[1:]]) + " |" for r in rows),
    ]
    for fig in suite.get("figures", []):
        lines += ["", f"![fine-tuning loss curves]({Path(fig).relative_to('docs')})"]
    return "\n".join(lines)


# LSP-Offload's goals against ZeRO-Offload (docs/offload.md): final loss within 3%, at most a
# quarter of the bytes moved, a shorter step at the simulated links.
LSP_LOSS_GOAL, LSP_BYTES_GOAL = 0.03, 0.25


def lsp_finetune(ctx: Context) -> str:
    """docs/offload.md: LSP-Offload against ZeRO-Offload in the finetune suite of `make results`
    (`llmscale bench --what finetune`): the table and each goal met or missed."""
    loss = ctx.rows("finetune", "final loss (last 5)")
    moved = ctx.rows("finetune", "bytes moved per step")
    wall = ctx.results.suite_rows("finetune-time", "step time (median)")
    cpu = ctx.results.suite_rows("finetune-time", "CPU time per step")
    if not all(m in d for d in (loss, moved) for m in ("lsp", "optimizer")):
        return "The finetune suite has not been measured yet (`make results`)."
    suite = ctx.results.suite("finetune") or {}
    links = [
        k.split(" @ ")[1]
        for k in wall
        if k.startswith("optimizer @ ") and f"lsp @ {k.split(' @ ')[1]}" in wall
    ]

    def exact(mode: str) -> bool:
        return bool(moved[mode]["measured"] == moved[mode]["predicted"])

    dl = loss["lsp"]["measured"] / loss["optimizer"]["measured"] - 1
    bytes_ratio = moved["lsp"]["measured"] / moved["optimizer"]["measured"]
    same = exact("lsp") and exact("optimizer")
    lines = [
        f"`make results`' finetune suite (`llmscale bench --what finetune`, measured "
        f"{_when(ctx, 'finetune')}): {suite.get('title', '')}. " + " ".join(suite.get("notes", [])),
        "",
        "| measurement | `optimizer` (ZeRO-Offload) | `lsp` | lsp / optimizer |",
        "|---|---|---|---|",
        f"| fine-tuning final loss (mean of the last 5 steps) | {loss['optimizer']['measured']:.4f} "
        f"| {loss['lsp']['measured']:.4f} | {dl:+.2%} |",
        f"| bytes moved per step (measured {'=' if same else '≠'} predicted) | "
        f"{moved['optimizer']['measured']:,.0f} | {moved['lsp']['measured']:,.0f} | {bytes_ratio:.2f} |",
    ]  # fmt: skip
    ratios = {}
    for link in links:
        o, lsp = wall[f"optimizer @ {link}"], wall[f"lsp @ {link}"]
        ratios[link] = lsp["measured"] / o["measured"]

        def cell(mode: str, link: str = link) -> str:
            c = cpu.get(f"{mode} @ {link}")
            got = f"{1e3 * wall[f'{mode} @ {link}']['measured']:.0f}"
            return got + (f" ({1e3 * c['measured']:.0f})" if c else "")

        lines.append(
            f"| step, overlapped, {'native copies' if link == 'native' else link}: ms wall "
            f"(ms CPU) | {cell('optimizer')} | {cell('lsp')} | {ratios[link]:.2f} |"
        )
    off = wall.get("none @ native")
    if off:
        lines += ["", f"No offload (on-device AdamW) took {1e3 * off['measured']:.0f} ms a step "
                  "with native copies in the same run."]  # fmt: skip
    simulated = {k: r for k, r in ratios.items() if k != "native"}
    met = {
        "loss": abs(dl) <= LSP_LOSS_GOAL,
        "bytes": bytes_ratio <= LSP_BYTES_GOAL,
        "step": bool(simulated) and all(r < 1 for r in simulated.values()),
    }
    steps = " and ".join(f"{r:.2f} at {k}" for k, r in simulated.items())
    lines += [
        "",
        f"Against the goals, in this run: final loss {dl:+.2%} (goal: within "
        f"{LSP_LOSS_GOAL:.0%}): {'met' if met['loss'] else 'missed'}; bytes moved "
        f"{bytes_ratio:.2f} of ZeRO-Offload's (goal: at most {LSP_BYTES_GOAL}): "
        f"{'met' if met['bytes'] else 'missed'}; overlapped step {steps} of ZeRO-Offload's "
        f"(goal: shorter at the simulated links): {'met' if met['step'] else 'missed'}.",
    ]
    return "\n".join(lines)


def offload_modes(ctx: Context) -> str:
    """docs/offload.md: step times and bytes of each offload mode and link, as
    `python -m llmscale.bench.offload --json-out docs/results/offload.json` recorded them."""
    from llmscale.bench import offload

    rec = ctx.record("offload.json", offload.SUITE)
    if not rec:
        return "Not measured yet: `python -m llmscale.bench.offload --json-out ...`."

    def ms(seconds: float) -> str:
        return f"{1e3 * seconds:.0f} ms"

    def pct(share: float) -> str:  # a share hidden; none (overlap no faster) or NaN: a dash
        return f"{share:.0%}" if share == share and share >= 0 else "—"

    lines = [
        f"    {rec['command']}",
        "",
        f"(measured {rec['measured_at'][:16].replace('T', ' ')} UTC, {rec['cores']} CPU cores, "
        f"{rec['threads']} torch thread{'s' if rec['threads'] != 1 else ''}, load average {rec['load_average'][0]:.1f} at the start, {rec['load_average'][1]:.1f} "
        f"at the end; {rec['notes'][0]}):",
        "",
        "| mode | link | off | serial | overlap | bytes moved / step (measured; predicted) "
        "| host Adam / step | hidden (wall / timeline) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rec["runs"]:
        step, moved, want = r["step_s"], r["bytes_moved"], r["bytes_moved_predicted"]
        got = {moved["serial"], moved["overlap"]}
        if got == {want}:
            said = " (= predicted)"
        elif want is None:
            said = " (not predicted)"
        else:
            said = f" (predicted {want / 2**20:.2f} MiB)"
        bytes_cell = " / ".join(f"{b / 2**20:.2f} MiB" for b in sorted(got)) + said
        lines.append(
            f"| `{r['offload']}` | {offload.link_label(r['link_gbps'])} | {ms(step['off'])} | "
            f"{ms(step['serial'])} | {ms(step['overlap'])} | {bytes_cell} | "
            f"{1e3 * r['host_adam_s']:.1f} ms | {pct(r['hidden_wall'])} / "
            f"{pct(r['hidden_timeline'])} |"
        )
    return "\n".join(lines)


def selective_kernels(ctx: Context) -> str:
    """docs/memory-model.md: saved bytes under none and selective on the CPU flash and math
    kernels, as `python -m llmscale.bench.selective --json-out docs/results/selective.json`
    recorded them; the planner's bytes and the hand count of what selective gives back computed
    here, for the recorded model and shape."""
    from llmscale.bench import selective as sel
    from llmscale.model.config import ModelConfig

    rec = ctx.record("selective.json", sel.SUITE)
    if not rec:
        return "Not measured yet: `python -m llmscale.bench.selective --json-out ...`."
    model, b, s = ModelConfig(**rec["model"]), rec["micro_batch_size"], rec["seq_len"]
    got = {r["config"]: r for r in rec["rows"]}
    lines = [
        f"Measured by `{rec['command']}` ({rec['measured_at'][:10]}, torch {rec['torch']}; "
        f"the runtime model, {model.n_layers} blocks, d {model.dim}, {model.n_heads} heads, "
        f"{model.n_kv_heads} kv heads, b {b}, s {s}, fp32, CPU; `saved_tensors_hooks`):",
        "",
        "| SDPA path | none | selective | saved by selective | counted by hand | planner: none "
        "/ selective |",
        "|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for backend in sel.BACKENDS:
        none, selective = got[f"{backend} recompute=none"], got[f"{backend} recompute=selective"]
        kernel = sel.planner_kernel(model, backend)
        saved = none["measured"] - selective["measured"]
        hand = sel.saving_by_hand(model, kernel, b, s)
        want = [sel.predicted_bytes(model, m, kernel, b, s) for m in sel.MODES]
        off = [w - r["measured"] for w, r in zip(want, (none, selective), strict=True)]
        path = (
            f"SDPA's choice, what the runtime takes: {kernel} (`{none['note']}`)"
            if backend == "auto"
            else f"{kernel}, forced with `sdpa_kernel(SDPBackend.MATH)`"
        )
        what = "the log-sum-exp, `4H` per token" if kernel != "math" else (
            "the `s × s` softmax output, the scaled q, k and v repeated to the heads, less the "
            "q, k, v the checkpoint keeps"
        )  # fmt: skip
        planner = f"{want[0]:,.0f} / {want[1]:,.0f} B" + (
            " (= measured)" if off == [0, 0]
            else " (" + ", ".join(f"{m} {o:+,.0f} B" for m, o in zip(sel.MODES, off, strict=True) if o) + ")"
        )  # fmt: skip
        lines.append(
            f"| {path} | {none['measured']:,} B | {selective['measured']:,} B | {saved:,} B "
            f"({saved / none['measured']:.1%}) | {hand:,} B: {what}"
            f"{'' if hand == saved else ' (≠ measured)'} | {planner} |"
        )
        square = 4 * model.n_heads * s * b * s * model.n_layers  # one fp32 s x s per block
        if off[0] and off[0] % square == 0:
            n = int(off[0] // square)
            notes.append(
                f"The planner's `{kernel}` path counts {abs(n)} fp32 `s × s` tensor"
                f"{'s' if abs(n) != 1 else ''} per block {'more' if n > 0 else 'fewer'} than "
                f"autograd keeps under `none` ({off[0]:+,.0f} B here)."
            )
    return "\n".join(lines + ["", *notes] if notes else lines)


def llama70b_block(ctx: Context) -> str:
    """docs/memory-model.md: one Llama 2 70B layer's saved bytes per token in bf16 on the
    runtime's CUDA kernels (`plan.activations.block_bytes`), against Korthikanti et al.'s eq. 1
    (`korthikanti_bytes`) at s = 4096."""
    from llmscale.model.config import get_preset
    from llmscale.plan import activations as act

    model, s = get_preset("llama2-70b"), 4096
    kern = act.Kernels.for_runtime(model, 1)
    ours = act.block_bytes(model, 1, s, "bf16", 1, False, kern, "none") / s
    paper = act.korthikanti_bytes(model, 1, s) / s
    return (
        f"For Llama 2 70B that is {ours:,.0f} bytes per token per layer in bf16, i.e. "
        f"`sbh · {ours / model.dim:.1f}`, against Korthikanti's `sbh(34 + 5as/h) = sbh · "
        f"{paper / model.dim:.0f}` at s = {s}"
    )


def memory_selective_op(ctx: Context) -> str:
    """docs/memory-model.md: selective_op's saved bytes in the memory suite of `make results`
    (`llmscale bench --what memory`), measured against predicted."""
    rows = ctx.rows("memory", "activations")
    if not rows:
        return "`llmscale bench --what memory` has not been run yet (make results)"
    suite = ctx.results.suite("memory") or {}
    mbs = sorted({int(k.split("mbs=")[1].split()[0]) for k in rows})

    def row(precision: str, b: int) -> dict[str, Any] | None:
        return rows.get(f"{precision} mbs={b} recompute=selective_op")

    def bytes_(precision: str) -> str:
        r = row(precision, mbs[-1])
        if r is None:
            return f"{precision} not measured"
        said = (
            "= predicted"
            if r["measured"] == r["predicted"]
            else f", {r['predicted']:,.0f} predicted"
        )
        return f"{precision} {r['measured']:,.0f} B measured{'' if said[0] == ',' else ' '}{said}"

    ratios = [
        f"{r['predicted'] / r['measured']:.4f} ({p})"
        for p in ("fp32", "bf16")
        if (r := row(p, mbs[0])) is not None
    ]
    return (
        f"`llmscale bench --what memory` in `make results` ({suite.get('title', '')}, "
        f"{_when(ctx, 'memory')}): mbs {mbs[-1]} {bytes_('fp32')}, {bytes_('bf16')}; mbs "
        f"{mbs[0]} predicted/measured {' and '.join(ratios)}"
    )


PRESET_ROWS = (
    ("tiny", "small"), ("gpt2-124m",), ("llama3.2-1b",), ("llama2-7b", "llama2-13b", "llama2-70b"),
    ("llama3-8b", "llama3-70b"), ("llama3-405b",), ("llama3.1-8b", "llama3.1-70b"),
    ("llama3.1-405b",), ("gpt3-175b",),
)  # fmt: skip


def preset_params(ctx: Context) -> str:
    """README: each preset's parameter count (`ModelConfig.num_params`) beside the published
    one (`published_params`, tests/model/test_config.py)."""
    from llmscale.model.config import PRESETS, get_preset

    listed = {n for names in PRESET_ROWS for n in names}
    lines = ["| preset | params | published |", "|---|---:|---:|"]
    for names in (*PRESET_ROWS, *((n,) for n in PRESETS if n not in listed)):
        models = [get_preset(n) for n in names]
        label = " / ".join([names[0], *(n.rsplit("-", 1)[-1] for n in names[1:])])
        ours = [m.num_params() for m in models]
        pub = [m.published_params for m in models]
        if not any(pub):
            said = "(tests / benchmarks)"
        elif pub == ours and len(pub) > 1:
            said = "the same, exactly"
        else:
            said = " / ".join(
                f"{p:,}" if p == o else f"{p / 1e9:,.0f}B" for p, o in zip(pub, ours, strict=True)
            )
        lines.append(f"| {label} | {' / '.join(f'{n:,}' for n in ours)} | {said} |")
    return "\n".join(lines)


# docs/schedule.md's bubble table: (schedule, pp, microbatches, chunks, t_w or None).
SCHEDULE_CASES = (
    *(("1f1b", p, m, 1, None) for p, m in ((4, 8), (4, 32), (8, 32))),
    *(("interleaved_1f1b", p, m, 2, None) for p, m in ((4, 8), (4, 32), (8, 32))),
    *(
        (s, p, m, 2, w)
        for s in ("zero_bubble", "zbv", "dualpipev")
        for p, m in ((4, 8), (4, 32), (8, 32))
        for w in (1.0, 0.6)
    ),
)


def schedule_bubbles(ctx: Context) -> str:
    """docs/schedule.md: simulated and closed-form bubbles and rank 0's peak in-flight, as
    `llmscale schedule ... --json` prints them (t_fwd = 1, t_bwd = 2)."""
    import json

    lines = [
        "| schedule | pp | m | v | t_w | simulated bubble | closed form | peak in-flight (rank 0) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sched, p, m, v, w in SCHEDULE_CASES:
        argv = ["schedule", "--pp", str(p), "--microbatches", str(m), "--schedule", sched]
        argv += ["--chunks", str(v)] if v > 1 else []
        argv += ["--t-w", f"{w:g}"] if w is not None else []
        out = json.loads(_run((*argv, "--json")))
        closed = out.get("closed_form_bubble")
        lines.append(
            f"| {sched} | {p} | {m} | {v} | {'-' if w is None else f'{w:g}'} | "
            f"{out['bubble_fraction']:.4f} | {'-' if closed is None else f'{closed:.4f}'} | "
            f"{out['peak_inflight'][0]} |"
        )
    return "\n".join(lines)


def inflight_accuracy(ctx: Context) -> str:
    """docs/memory-model.md: the pipeline suite's stage-0 activations in flight, predicted
    against the trainer's `activation_peak_bytes`."""
    rows = ctx.rows("pipeline", "activations in flight, stage 0")
    if not rows:
        return "`llmscale bench --what pipeline` has not been run yet (make results)"
    worst = max(abs(r["predicted"] / r["measured"] - 1) for r in rows.values())
    exact = sorted({k.split()[1] for k, r in rows.items() if r["predicted"] == r["measured"]})
    every = [
        s for s in exact
        if all(r["predicted"] == r["measured"] for k, r in rows.items() if k.split()[1] == s)
    ]  # fmt: skip
    pps = sorted({int(k.split()[0].removeprefix("pp=")) for k in rows})
    return (
        f"of `llmscale bench --what pipeline` ({len(rows)} configurations, pp "
        f"{' and '.join(map(str, pps))}, {_when(ctx, 'pipeline')}) it is the prediction to within "
        f"{worst:.2%}" + (f" ({', '.join(every)}: exact)" if every else "")
    )


# Commands whose `--png` draws an image the pages show, from the planner or the schedule
# simulator alone (the same bytes at every run with the pinned matplotlib): `make docs` draws
# each again and keeps it where it changed; `--check` reports one that differs.
IMAGE_COMMANDS: list[str] = [f"{DEMO_PLAN} --png docs/img/plan-llama2-70b-h200.png"]


def gantt(label: str, command: str) -> Callable[[Context], str]:
    """A schedule's bubble and text Gantt chart as `llmscale schedule` prints them (the `--png`
    of the shown command draws the image beside it: `IMAGE_COMMANDS`; rendering does not)."""
    IMAGE_COMMANDS.append(command)

    def render(ctx: Context) -> str:
        argv = command.split()[1:]
        if "--png" in argv:
            i = argv.index("--png")
            argv = argv[:i] + argv[i + 2 :]
        out = _run(tuple(argv)).splitlines()
        bubble = next(line.split()[1] for line in out if line.startswith("bubble "))
        chart = [line for line in out if line.startswith("rank ")]
        return f"{label}: bubble {bubble} (`{command}`)\n\n```\n" + "\n".join(chart) + "\n```"

    return render


def zero_stage_collectives(ctx: Context) -> str:
    """docs/parallel.md: per step, the FSDP2 collectives of the tiny model under each zero stage
    (dp_shard 2, 4 micro-batches per rank) by the rule `stack.residency.predict_collectives`,
    which tests/parallel/test_zero_stages.py checks equal to the runtime's counts."""
    from llmscale.model.config import get_preset
    from llmscale.stack.residency import predict_collectives

    keys = ("param_allgathers", "grad_reduces", "param_allgather_bytes", "grad_reduce_bytes")
    lines = ["| zero_stage | " + " | ".join(keys) + " |", "|---|---|---|---|---|"]
    for z in (1, 2, 3):
        got = predict_collectives(
            get_preset("tiny"), dp_shard=2, zero_stage=z, microbatches=4
        ).to_dict()
        lines.append(f"| {z} | " + " | ".join(f"{got[k]:,}" for k in keys) + " |")
    return "\n".join(lines)


@functools.cache
def _networks(gpus: int) -> Any:
    """`llmscale network --gpus N --gpu h100`'s rows (Llama 2 70B's best plan), once per process."""
    from llmscale.model.config import get_preset
    from llmscale.report.network_report import network_report

    return network_report(get_preset("llama2-70b"), gpus, "h100").rows


def _rail_vs_fat(gpus: int) -> tuple[Any, Any]:
    rows = _networks(gpus)
    fat = next(r for r in rows if r.design.kind == "fat-tree")
    rail = next(r for r in rows if r.design.kind == "rail-only")
    return fat, rail


def rail_only_cost(ctx: Context) -> str:
    """docs/planner.md: what rail-only saves over the fat-tree at 4,096 and 1,024 H100s
    (`llmscale network`)."""
    fat, rail = _rail_vs_fat(4096)
    small_fat, small_rail = _rail_vs_fat(1024)
    saving = small_rail.design.cost_usd / small_fat.design.cost_usd - 1
    same = small_fat.design.tiers == small_rail.design.tiers
    return (
        f"4096 H100: {rail.design.cost_usd / fat.design.cost_usd - 1:+.0%}; at 1024 "
        + (f"both fit in {small_fat.design.tiers} tiers and it saves " if same else "it saves ")
        + ("nothing" if abs(saving) < 0.005 else f"{-saving:.0%}")
    )


def rail_only_a2a(ctx: Context) -> str:
    """docs/planner.md: rail-only's all-to-all overhead at 1,024 and 4,096 H100s, 256 MB per
    GPU (`llmscale network`)."""
    out = []
    for gpus in (1024, 4096):
        fat, rail = _rail_vs_fat(gpus)
        out.append(f"{rail.all_to_all_seconds / fat.all_to_all_seconds - 1:+.1%} at {gpus}")
    return f"{out[0]} GPUs with 256 MB per GPU, {out[1]}"


def tied_copy_memory(ctx: Context) -> str:
    """docs/parallel.md: the last stage's fp32 parameters of a tied model under pp = 2, with
    and without its `vocab x dim` copy of the embedding (`plan.params.rank_params`)."""
    from llmscale.model.config import get_preset
    from llmscale.plan.params import rank_params

    model = get_preset("gpt2-124m")
    held = rank_params(model, 1, 2, 1).numel
    copy = model.vocab_size * model.dim
    return (
        f"{model.name}, `pp = 2`: rank 1 holds {4 * held / 2**30:.2f} GiB of fp32 parameters "
        f"instead of {4 * (held - copy) / 2**30:.2f} GiB"
    )


def kv_per_token(ctx: Context) -> str:
    """docs/inference.md: Llama 2 70B's KV cache per token in bf16 (`plan.inference
    .kv_bytes_per_token`) against the same model with a KV head per query head."""
    from llmscale.model.config import get_preset
    from llmscale.plan.inference import kv_bytes_per_token

    model = get_preset("llama2-70b")
    gqa = kv_bytes_per_token(model, "bf16")
    mha = kv_bytes_per_token(model.with_overrides(n_kv_heads=model.n_heads), "bf16")
    return (
        f"Llama 2 70B's {model.n_kv_heads} KV heads make it {gqa:,} bytes in bf16, "
        f"1/{mha // gqa} of what {model.n_heads} heads would"
    )


def _hid(share: float) -> str:
    """A hidden share as a percentage; none where overlapping cost more than it hid."""
    return f"{share:.0%}" if share >= 0 else f"none (its threads cost {-share:.0%} more)"


def params_offload_times(ctx: Context) -> str:
    """docs/offload.md: what parameter offload costs at a simulated 1 GB/s link, from the offload
    bench's record (docs/results/offload.json), against "optimizer" in the same record."""
    from llmscale.bench import offload

    rec = ctx.record("offload.json", offload.SUITE)
    runs = {(r["offload"], r["link_gbps"]): r for r in (rec or {}).get("runs", [])}
    p, o, native = (runs.get(k) for k in (("optimizer+params", 1.0), ("optimizer", 1.0),
                                          ("optimizer+params", 0.0)))  # fmt: skip
    if rec is None or p is None or o is None:
        return "Not measured yet: `python -m llmscale.bench.offload --offload optimizer " \
            "optimizer+params --link-gbps 0 1 --json-out docs/results/offload.json`"  # fmt: skip

    def ms(x: float) -> str:
        return f"{1e3 * x:.0f} ms"

    step = p["step_s"]
    out = (
        f"In the offload bench's record ({rec['measured_at'][:10]}, the table below), at a "
        f"simulated 1 GB/s link the offloaded step took {ms(step['serial'])} serially and "
        f"{ms(step['overlap'])} overlapped against {ms(step['off'])} without offload: the "
        "parameter fetches add 2 × (forward + backward) uploads per micro-step to the offload "
        f"work ({ms(p['offload_work_s'])} per step against {ms(o['offload_work_s'])} for "
        f'"optimizer"), and overlap hid {_hid(p["hidden_wall"])} of it by wall time, '
        f"{_hid(p['hidden_timeline'])} by the timeline"
    )
    if native is not None:
        out += f". With real memcpy on this CPU host the work is {ms(native['offload_work_s'])}"
    return out


def schedule_idle(ctx: Context) -> str:
    """docs/parallel.md: idle time per rank of the Gantt charts above (makespan less the rank's
    busy time, `llmscale schedule --json`), the split schedules against 1F1B."""
    import json
    from fractions import Fraction

    def idle(*argv: str) -> float:
        out = json.loads(_run(("schedule", "--pp", "4", "--microbatches", "8", *argv, "--json")))
        seconds: float = max(out["makespan"] - b for b in out["busy"])
        return seconds

    zb = idle("--schedule", "zero_bubble", "--chunks", "2")
    zbv, base = idle("--schedule", "zbv"), idle()
    split = f"{zb:g}" if abs(zb - zbv) < 1e-9 else f"{zb:g} and {zbv:g}"
    share = Fraction(zbv / base).limit_denominator(100)
    words = {2: "a half", 3: "a third", 4: "a quarter", 6: "a sixth"}
    frac = words.get(share.denominator, str(share)) if share.numerator == 1 else str(share)
    return (
        f"Interleaved zero bubble and ZB-V leave {split} of idle per rank here, (p-1) chunk "
        f"forwards, against 1F1B's {base:g}, (p-1)(F + B + W) of a whole rank slice: {frac}"
    )


def inflight_table(ctx: Context) -> str:
    """docs/schedule.md: activations in flight on stage 0 per schedule, from the pipeline suite."""
    rows = ctx.rows("pipeline", "activations in flight, stage 0")
    scheds = ("gpipe", "1f1b", "interleaved v=2", "zero_bubble v=2", "zbv", "dualpipev")
    lines = ["| | " + " | ".join(scheds) + " |", "|---|" + "---:|" * len(scheds)]
    for pp, m in ((2, 4), (4, 8)):
        cells = [rows.get(f"pp={pp} {s} m={m}") for s in scheds]
        if not any(cells):
            continue
        lines.append(
            f"| pp {pp}, m {m}, measured | "
            + " | ".join(f"{c['measured'] / 2**20:.2f} MiB" if c else "-" for c in cells)
            + " |"
        )
        lines.append(f"| pp {pp}, m {m}, pred/meas | " + " | ".join(
            f"{c['predicted'] / c['measured']:.3f}" if c else "-" for c in cells) + " |")  # fmt: skip
    return "\n".join(lines) if len(lines) > 2 else "Not measured yet: `make results`."


# ---- what pipeline ranks hold besides activations (bench/pipeline_memory.py) ------------------

PIPELINE_MEMORY_RUNS = ((2, 4), (4, 8))  # docs/schedule.md's two commands


def _pipeline_memory(ctx: Context) -> dict[tuple[int, int], dict[str, dict[int, dict[str, Any]]]]:
    """{(pp, m): {schedule: {rank: {quantity: row}}}} of docs/results/pipeline_memory.json."""
    path = ctx.results_path.parent / "pipeline_memory.json"
    out: dict[tuple[int, int], dict[str, dict[int, dict[str, Any]]]] = {}
    for r in (Results(path).suite("pipeline_memory") or {}).get("rows", []):
        pp, m, sched, _, rank = r["config"].split()  # "pp=2 m=4 zbv rank 1"
        key = (int(pp[3:]), int(m[2:]))
        out.setdefault(key, {}).setdefault(sched, {}).setdefault(int(rank), {})[r["quantity"]] = r
    return out


def _schedule_label(pp: int, schedule: str, m: int) -> str:
    from llmscale.bench.pipeline import PipeConfig

    return PipeConfig(pp, schedule, m).label.split(" ", 1)[1].rsplit(" m=", 1)[0]


def pipeline_memory_table(ctx: Context) -> str:
    """docs/schedule.md: pending weight gradients / receive buffers per rank and schedule, as
    `python -m llmscale.bench.pipeline_memory --json-out` measured them."""
    runs = _pipeline_memory(ctx)
    if not runs:
        return "Not measured yet: `python -m llmscale.bench.pipeline_memory --json-out ...`."
    keys = ("pending_weight_grad_bytes", "pipeline_buffer_bytes")
    rows = [r for scheds in runs.values() for ranks in scheds.values()
            for q in ranks.values() for k, r in q.items() if k in keys]  # fmt: skip
    exact = all(r["measured"] == r["predicted"] for r in rows)
    worst = max(abs(r["predicted"] / r["measured"] - 1) for r in rows if r["measured"])
    at = " and ".join(f"pp {pp} m {m}" for pp, m in runs)
    lines = [
        "Each cell is `pending_weight_grad_bytes / pipeline_buffer_bytes` in bytes, measured. "
        + (
            "Predicted = measured **to the byte** in every cell"
            if exact
            else f"Predicted within {worst:.1%} of measured in every cell"
        )  # fmt: skip
        + f", at {at}:",
        "",
        "| pp, m | schedule | "
        + " | ".join(f"rank {r}" for r in range(max(pp for pp, _ in runs)))
        + " |",
        "|---|---|" + "---:|" * max(pp for pp, _ in runs),
    ]
    width = max(pp for pp, _ in runs)
    for (pp, m), scheds in runs.items():
        merged: list[tuple[list[str], list[str]]] = []
        for sched, ranks in scheds.items():
            cells = [
                f"{int(ranks[r][keys[0]]['measured']):,} / {int(ranks[r][keys[1]]['measured']):,}"
                if r in ranks
                else ""
                for r in range(width)
            ]
            if merged and merged[-1][1] == cells:
                merged[-1][0].append(_schedule_label(pp, sched, m))
            else:
                merged.append(([_schedule_label(pp, sched, m)], cells))
        for names, cells in merged:
            lines.append(f"| {pp}, {m} | {', '.join(names)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pipeline_memory_reading(ctx: Context) -> str:
    """docs/schedule.md: what B keeps against the saved activations, and the activation peak's
    error, from the same rows."""
    runs = _pipeline_memory(ctx)
    held = [
        (q["pending_weight_grad_bytes"]["measured"], q["activation_peak_bytes"]["measured"],
         pp, sched, rank)
        for (pp, _), scheds in runs.items() for sched, ranks in scheds.items()
        for rank, q in ranks.items() if q["pending_weight_grad_bytes"]["measured"]
    ]  # fmt: skip
    if not held:
        return "Not measured yet."
    share = [h / a for h, a, *_ in held]
    acts = [a for _, a, *_ in held]
    h, a, pp, sched, rank = max(held)
    parts = [
        f"Against the saved activations on the same rank ({min(acts) / 1e6:.2f}-"
        f"{max(acts) / 1e6:.2f} MB), what B keeps adds {min(share):.0%}-{max(share):.0%}: "
        f"{_schedule_label(pp, sched, 2)}'s rank {rank} at pp {pp} holds {h / 1e6:.2f} MB more "
        f"than its {a / 1e6:.2f} MB of activations."
    ]
    for (pp, _), scheds in runs.items():
        err = max(
            ((q["activation_peak_bytes"]["measured"] / q["activation_peak_bytes"]["predicted"] - 1,
              sched, rank) for sched, ranks in scheds.items() for rank, q in ranks.items()),
            key=lambda e: abs(e[0]),
        )  # fmt: skip
        parts.append(
            f"At pp {pp}, `activation_peak_bytes` is furthest from the planner under "
            f"{_schedule_label(pp, err[1], 2)} on rank {err[2]}: {abs(err[0]):.1%} "
            f"{'above' if err[0] > 0 else 'below'} it."
        )
    return " ".join(parts)


def pipeline_memory_times(ctx: Context) -> str:
    """docs/schedule.md: how long each of the two commands took (`bench/timed.py`)."""
    cmd = "python -m llmscale.bench.pipeline_memory --pp {} --microbatches {}"
    took = [(pp, m, ctx.timing(cmd.format(pp, m))) for pp, m in PIPELINE_MEMORY_RUNS]
    if not all(r for *_, r in took):
        return "Not timed yet (`python -m llmscale.bench.timed NAME -- CMD`)."
    return "; ".join(
        f"pp {pp}: {r['measured']:.0f} s ({r['measured_at'][:10]}; {r['note']})"  # type: ignore[index]
        for pp, m, r in took
    )


# ---- measured vs predicted --------------------------------------------------------------------


def _ratios(rows: dict[str, dict[str, Any]]) -> list[float]:
    return [r["predicted"] / r["measured"] for r in rows.values() if r.get("measured")]


def _within(ratios: list[float]) -> str:
    return f"{100 * max(abs(r - 1) for r in ratios):.1f}%"


def _when(ctx: Context, suite: str) -> str:
    at = (ctx.results.suite(suite) or {}).get("measured_at", "")
    return at[:10] or "undated"


def _compile_speedup(ctx: Context, precision: str, key: str) -> str:
    """The compile suite's steady step, eager over compiled ("x1.08"; `key`: measured or
    predicted)."""
    comp = ctx.rows("compile", "step time")
    e, c = comp.get(f"{precision} mbs=4 eager"), comp.get(f"{precision} mbs=4 compiled")
    return f"x{e[key] / c[key]:.2f}" if e and c else "-"


def compile_results(ctx: Context) -> str:
    """docs/parallel.md: `train.compile` on this CPU, from the compile suite (make results)."""
    ctime = ctx.rows("compile", "compile time (first step - steady)")
    if not ctx.rows("compile", "step time"):
        return "Not measured yet: `make results` (`--what compile`)."
    cold = " and ".join(
        f"{ctime[k]['measured']:.0f} s" for k in ("fp32 mbs=4", "bf16 mbs=4") if k in ctime
    )
    return (
        f"Measured by `make results` ({_when(ctx, 'compile')}; small model, 4 x 128 tokens, eager "
        f"and compiled steps in turn): steady step {_compile_speedup(ctx, 'fp32', 'measured')} "
        f"faster compiled in fp32, {_compile_speedup(ctx, 'bf16', 'measured')} in bf16 "
        f"(predicted {_compile_speedup(ctx, 'fp32', 'predicted')} and "
        f"{_compile_speedup(ctx, 'bf16', 'predicted')}); the cold compile took {cold}."
    )


def measured_vs_predicted(ctx: Context) -> str:
    """README's table: each row's figures from results.json (`make results`)."""
    rows: list[tuple[str, str]] = []
    mem = ctx.results.suite("memory") or {}
    states = [
        r for r in mem.get("rows", [])
        if r["quantity"] != "activations" and r["predicted"] is not None
    ]  # fmt: skip
    if states:
        exact = all(r["measured"] == r["predicted"] for r in states)
        rows.append((
            "parameters, gradients, optimizer states, host bytes under offload",
            ("exact, to the byte" if exact else f"within {_within(_ratios({str(i): r for i, r in enumerate(states)}))}")
            + f" ({len(states)} rows: fp32, bf16, offload; FSDP2 in the tests)",
        ))  # fmt: skip
    act = ctx.rows("memory", "activations")
    if act:
        rows.append((
            "saved activations, every recompute mode (selective_op too) and micro-batch",
            f"within {_within(_ratios(act))} in {len(act)} configurations (goal 3%); 2-rank TP, "
            "SP and 1F1B layouts in the tests",
        ))  # fmt: skip
    rec = ctx.rows("recompute", "step time / none")
    if rec:
        parts = [
            f"{k.split('=')[1]} x{r['predicted']:.3f} predicted, x{r['measured']:.3f} measured"
            for k, r in sorted(rec.items(), key=lambda kv: -kv[1]["predicted"])
        ]
        rows.append((
            "recomputation's step-time cost",
            "; ".join(parts) + f" (each within {_within(_ratios(rec))})",
        ))  # fmt: skip
    bub = ctx.rows("pipeline", "bubble (simulator)")
    pair = [bub.get(f"pp=2 1f1b m={m}") for m in (2, 4)]
    if all(pair):
        order = all(r["note"].startswith("order = simulator") for r in bub.values())
        rows.append((
            "pipeline bubble, pp=2 1F1B m=2/4",
            f"{pair[0]['predicted']:.1f}/{pair[1]['predicted']:.1f}% simulated, "  # type: ignore[index]
            f"{pair[0]['measured']:.1f}/{pair[1]['measured']:.1f}% measured; op order "  # type: ignore[index]
            + ("equal to the simulator's in every run" if order else "differs from the simulator's in some runs"),
        ))  # fmt: skip
    fl = ctx.rows("pipeline", "activations in flight, stage 0")
    if fl:
        r = _ratios(fl)
        rows.append((
            "pipeline activations in flight (stage 0), GPipe / 1F1B / interleaved, pp=2 and 4",
            f"pred/meas {value_range(r, 3)} in all {len(fl)} configurations (planner: "
            "in-flight units × one micro-batch)",
        ))  # fmt: skip
    st = ctx.rows("time", "step time")
    if st:

        def rr(k: str) -> str:
            return f"{st[k]['predicted'] / st[k]['measured']:.3f}" if k in st else "-"

        rows.append((
            "step time on the CPU",
            f"pred/meas fp32 {rr('fp32 mbs=4')} / {rr('fp32 mbs=16')} (micro-batch 4 / 16), "
            f"bf16 {rr('bf16 mbs=4')} / {rr('bf16 mbs=16')} in `make results` "
            f"({_when(ctx, 'time')}). The device is micro-benchmarked on the runtime's own "
            "kernels at the run's shape (`train/calibration.py`); a busy machine moves single "
            "rows",
        ))  # fmt: skip
    from llmscale.validation.published import all_rows

    pub = all_rows()
    pr = [p.ratio for p in pub]
    rows.append((
        "published runs (Narayanan 2021, Korthikanti 2022, torchtitan H100)",
        f"{sum(p.within for p in pub)} of {len(pub)} rows within 10% ({min(pr):.3f} .. "
        f"{max(pr):.3f}): [docs/planner-validation.md](docs/planner-validation.md)",
    ))  # fmt: skip
    comp = ctx.rows("compile", "step time")
    ctime = ctx.rows("compile", "compile time (first step - steady)")
    if comp:

        def speed(p: str, key: str) -> str:
            return _compile_speedup(ctx, p, key)

        cold = " / ".join(
            f"{ctime[k]['measured']:.0f} s" for k in ("fp32 mbs=4", "bf16 mbs=4") if k in ctime
        )
        rows.append((
            "`train.compile`, small model, mbs 4 × 128 tokens",
            f"steady step eager/compiled measured {speed('fp32', 'measured')} (fp32) and "
            f"{speed('bf16', 'measured')} (bf16), predicted {speed('fp32', 'predicted')} / "
            f"{speed('bf16', 'predicted')} (each step within {_within(_ratios(comp))}; the planner "
            "fuses the element-wise bytes but does not model the CPU's per-op dispatch a "
            f"compiled block saves); cold compile {cold} ({_when(ctx, 'compile')})",
        ))  # fmt: skip
    cp = ctx.rows("cp", "step time")
    cpr = ctx.rows("cp", "step time ratio")
    if cp and cpr:
        ratio = next(iter(cpr.values()))
        base, ring = cp.get("dp_replicate=2, b=2"), cp.get("cp=2, b=4")
        rows.append((
            "context parallelism, cp=2 vs dp_replicate=2 on 2 CPU ranks (`--what cp`)",
            f"cp/baseline ratio pred/meas {ratio['predicted'] / ratio['measured']:.2f} (median "
            "over repetitions); step time pred/meas "
            + (f"{base['predicted'] / base['measured']:.2f} (baseline) and " if base else "")
            + (f"{ring['predicted'] / ring['measured']:.2f} (cp=2)" if ring else "")
            + f" ({_when(ctx, 'cp')}): the per-rank calibration does not capture two processes "
            "sharing 2 cores; the runtime's ring priced from its own micro-benchmarked blocks "
            "and a measured gloo link ([docs/parallel.md](docs/parallel.md#context-parallelism))",
        ))  # fmt: skip
    acc = ctx.rows("accum", "step time")
    if acc:
        grads = ctx.results.table("accum", "gradient equivalence")
        worst = max(float(r[1]) for r in grads[1]) if grads else float("nan")
        acts = _ratios(ctx.rows("accum", "activations"))
        exact = bool(acts) and all(a == 1 for a in acts)
        rows.append((
            "accumulation " + " vs ".join(k.replace("b=", "b=").replace(" k=", "×") for k in acc),
            "step time pred/meas "
            + " / ".join(f"{r['predicted'] / r['measured']:.3f}" for r in acc.values())
            + f"; gradients equal to {worst:.0e}; activations scale with the micro-batch "
            + ("exactly" if exact else f"within {_within(acts)}"),
        ))  # fmt: skip
    lsp = _lsp_figures(ctx)
    if lsp:
        rows.append((
            "LSP-Offload vs ZeRO-Offload, fine-tuning the small model (`--what finetune`)",
            f"{lsp} ([docs/offload.md](docs/offload.md#lsp-offload-offload--lsp))",
        ))  # fmt: skip
    lines = ["| what | predicted vs measured |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


# ---- the blocks -------------------------------------------------------------------------------


class Block(NamedTuple):
    """A rendered part of a file: `name` None renders the whole file. `timed`: holds search
    timings (masked when comparing)."""

    file: str
    name: str | None
    render: Callable[[Context], str]
    timed: bool = False


def _claims_md(ctx: Context) -> str:
    return to_markdown(ctx.claims, "docs/results/results.json")


def _planner_validation(ctx: Context) -> str:
    from llmscale.bench.published import markdown
    from llmscale.validation.published import all_rows

    return markdown(all_rows())


def _reliability_md(ctx: Context) -> str:
    """docs/reliability.md from the fault suite's record, docs/results/reliability.json (`make
    reliability`), with that command's own renderer; without the record, the command to run."""
    from llmscale.bench.reliability import markdown, read_rows

    path = ctx.results_path.parent / "reliability.json"
    if not path.is_file():
        return "# Reliability: faults and bad input\n\nNo record yet: run `make reliability`.\n"
    return markdown(read_rows(path))


def _results_md(ctx: Context) -> str:
    """docs/results.md from results.json with `make results`' own renderer (bench.report
    .markdown); its header (the command, date and machine of that run, which results.json does
    not hold) is kept as `make results` wrote it."""
    import dataclasses

    from llmscale.bench.report import Row, SuiteResult, markdown

    page = ctx.results_path.parent.parent / "results.md"
    text = page.read_text() if page.is_file() else "# Measured vs predicted\n"
    header = text[: text.index("\n## ")] if "\n## " in text else text.rstrip("\n")
    fields = {f.name for f in dataclasses.fields(Row)}
    suites = [
        SuiteResult(
            name, s["title"],
            rows=[Row(**{k: v for k, v in r.items() if k in fields}) for r in s["rows"]],
            figures=[Path(f) for f in s["figures"]],
            tables={k: (v["header"], v["rows"]) for k, v in s["tables"].items()},
            notes=s["notes"],
        )
        for name, s in ctx.results.data.items()
        if isinstance(s, dict)
    ]  # fmt: skip
    return markdown(suites, header=header, base=Path("docs"))


BLOCKS: tuple[Block, ...] = (
    Block("README.md", "demo-wall", demo_wall),
    Block("README.md", "demo-fit", demo_fit),
    Block("README.md", "demo-run", demo_run),
    Block("README.md", "test-time", test_time),
    Block("README.md", "plan-demo", plan_demo, timed=True),
    Block("README.md", "megatron-ratios", megatron_ratios),
    Block("README.md", "plan-speed", plan_speed, timed=True),
    Block("README.md", "roofline-training", roofline_training),
    Block("README.md", "fp16-underflow", fp16_underflow),
    Block("README.md", "loader-memory", loader_memory),
    Block("README.md", "overhead-ratio", overhead_ratio),
    Block("README.md", "serving-ratio", serving_ratio),
    Block("README.md", "claims-summary", claims_summary),
    Block("README.md", "measured-vs-predicted", measured_vs_predicted),
    Block("README.md", "preset-params", preset_params),
    Block("docs/planner.md", "plan-demo-wide", plan_demo_wide, timed=True),
    Block("docs/planner.md", "hw-compare", commands("llmscale hw --compare nvlink5 pcie5")),
    Block(
        "docs/planner.md", "roofline", commands("llmscale roofline --gpu h200 --model llama2-70b")
    ),
    Block("docs/planner.md", "network", commands("llmscale network --gpus 4096 --gpu h100")),
    Block("docs/planner.md", "rail-only-cost", rail_only_cost),
    Block("docs/planner.md", "rail-only-a2a", rail_only_a2a),
    Block(
        "docs/schedule.md",
        "schedule-1f1b",
        commands(
            "llmscale schedule --pp 4 --microbatches 8",
            "llmscale schedule --pp 4 --microbatches 8 --schedule interleaved --chunks 2",
        ),
    ),
    Block(
        "docs/schedule.md",
        "schedule-zbv",
        commands("llmscale schedule --pp 4 --microbatches 8 --schedule zbv"),
    ),
    Block("docs/planner.md", "plan-speed-cases", plan_speed_cases, timed=True),
    Block("docs/planner.md", "plan-costed", plan_costed),
    Block("docs/planner.md", "stack-errors", stack_errors),
    Block("docs/planner.md", "validation-misses", validation_misses),
    Block("docs/schedule.md", "bubble-estimate", bubble_estimate),
    Block("docs/inference.md", "serving-table", serving_table),
    Block("docs/inference.md", "serving-reading", serving_reading),
    Block("docs/inference.md", "kv-per-token", kv_per_token),
    Block("docs/schedule.md", "inflight-table", inflight_table),
    Block("docs/schedule.md", "schedule-bubbles", schedule_bubbles),
    Block("docs/memory-model.md", "selective-kernels", selective_kernels),
    Block("docs/memory-model.md", "llama70b-block", llama70b_block),
    Block("docs/memory-model.md", "memory-selective-op", memory_selective_op),
    Block("docs/memory-model.md", "inflight-accuracy", inflight_accuracy),
    Block("docs/schedule.md", "pipeline-memory-table", pipeline_memory_table),
    Block("docs/schedule.md", "pipeline-memory-reading", pipeline_memory_reading),
    Block("docs/schedule.md", "pipeline-memory-times", pipeline_memory_times),
    Block("docs/parallel.md", "cp-results", cp_results),
    Block("docs/parallel.md", "tied-copy-memory", tied_copy_memory),
    Block("docs/parallel.md", "zero-stage-collectives", zero_stage_collectives),
    Block("docs/parallel.md", "schedule-idle", schedule_idle),
    Block(
        "docs/parallel.md",
        "gantt-1f1b",
        gantt(
            "1F1B, for comparison",
            "llmscale schedule --pp 4 --microbatches 8 --png docs/img/gantt-1f1b.png",
        ),
    ),
    Block(
        "docs/parallel.md",
        "gantt-zero-bubble",
        gantt(
            "interleaved zero bubble, 2 chunks",
            "llmscale schedule --pp 4 --microbatches 8 --schedule zero_bubble --chunks 2 "
            "--png docs/img/gantt-zero_bubble.png",
        ),
    ),
    Block(
        "docs/parallel.md",
        "gantt-zbv",
        gantt(
            "ZB-V",
            "llmscale schedule --pp 4 --microbatches 8 --schedule zbv --png docs/img/gantt-zbv.png",
        ),
    ),
    Block(
        "docs/parallel.md",
        "gantt-dualpipev",
        gantt(
            "DualPipeV",
            "llmscale schedule --pp 4 --microbatches 8 --schedule dualpipev "
            "--png docs/img/gantt-dualpipev.png",
        ),
    ),
    Block("docs/parallel.md", "compile-results", compile_results),
    Block("docs/offload.md", "lsp-finetune", lsp_finetune),
    Block("docs/offload.md", "finetune-table", finetune_table),
    Block("docs/offload.md", "offload-modes", offload_modes),
    Block("docs/offload.md", "params-offload-times", params_offload_times),
    Block("docs/offload.md", "lsp-traffic", lsp_traffic),
    Block("docs/offload.md", "lsp-plan-7b", lsp_plan_7b),
    Block("docs/pipeline-bench.md", "pipeline-configs", pipeline_configs),
    Block("docs/pipeline-bench.md", "pipeline-op-range", pipeline_op_range),
    Block("docs/pipeline-bench.md", "pipeline-p2p-range", pipeline_p2p_range),
    Block("docs/pipeline-bench.md", "pipeline-results", pipeline_results),
    Block("docs/claims.md", None, _claims_md),
    Block("docs/results.md", None, _results_md),
    Block("docs/planner-validation.md", None, _planner_validation),
    Block("docs/reliability.md", None, _reliability_md),
    # README's prose (docs_pages.py)
    Block("README.md", "startup-calibration", pages.startup_calibration),
    Block("README.md", "startup-probe", pages.startup_probe),
    Block("README.md", "startup-verify", pages.startup_verify),
    Block("README.md", "params-window", pages.params_window),
    Block("README.md", "memcheck-need", pages.memcheck_need),
    Block("README.md", "korthikanti-fit", pages.korthikanti_fit),
    # docs/parallel.md, schedule.md, pipeline-bench.md, planner.md prose (llmscale.docs_parallel)
    Block("docs/parallel.md", "demo-losses", par.demo_losses),
    Block("docs/parallel.md", "replica-allreduces", par.replica_allreduces),
    Block("docs/parallel.md", "pipeline-gathers", par.pipeline_gathers_table),
    Block("docs/parallel.md", "interleaved-inflight", par.interleaved_inflight),
    Block("docs/parallel.md", "zbh1-idle", par.zbh1_idle),
    Block("docs/parallel.md", "inflight-limit", par.inflight_limit),
    Block("docs/schedule.md", "inflight-rest", par.inflight_rest),
    Block("docs/pipeline-bench.md", "pipeline-step-cost", par.pipeline_step_cost),
    Block("docs/pipeline-bench.md", "pipeline-send-bytes", par.pipeline_send_bytes),
    Block("docs/planner.md", "decode-ridge", par.decode_ridge),
    Block("docs/planner.md", "cp-rows", par.cp_rows),
    Block("docs/planner.md", "vanilla-tp", par.vanilla_tp),
    Block("docs/planner.md", "gb200-fsdp-memory", par.gb200_fsdp_memory),
    Block("docs/memory-model.md", "n340-memory", par.n340_memory),
    Block("docs/parallel.md", "init-rate", par.init_rate),
    Block("docs/planner.md", "stack-fits", par.stack_fits),
    Block("docs/planner.md", "fitted-note", par.fitted_note_example),
    Block("docs/planner.md", "nvlink-achieved", par.nvlink_achieved),
    Block("docs/planner.md", "run-counts", par.run_counts),
    Block("docs/planner.md", "time-defaults", par.time_defaults),
    Block("docs/planner.md", "step-overhead", par.step_overhead),
    # docs/offload.md's prose (docs_offload.py)
    Block("docs/offload.md", "lsp-fit", docs_offload.lsp_fit),
    Block("docs/offload.md", "lsp-compress-times", docs_offload.lsp_compress_times),
    Block("docs/offload.md", "params-offload-bytes", docs_offload.params_offload_bytes),
    Block("docs/offload.md", "host-adamw-kernels", docs_offload.host_adamw_kernels),
    Block("docs/offload.md", "offload-reading", docs_offload.offload_reading),
    Block("docs/offload.md", "zero-offload-link", docs_offload.zero_offload_link),
    Block("docs/offload.md", "lsp-regime", docs_offload.lsp_regime),
    Block("docs/offload.md", "params-offload-traffic", docs_offload.params_offload_traffic),
)


def _span(text: str, name: str) -> tuple[int, int]:
    """Where block `name`'s content starts and ends in `text` (between its markers)."""
    begin, end = f"<!-- generated: {name} (make docs) -->", f"<!-- end: {name} -->"
    i = text.find(begin)
    j = text.find(end, i + len(begin)) if i >= 0 else -1
    if i < 0 or j < 0:
        raise ValueError(f"no '{begin}' ... '{end}' markers")
    return i + len(begin), j


def _content(text: str, b: Block) -> str:
    if b.name is None:
        return text
    i, j = _span(text, b.name)
    return text[i:j]


def _rendered(b: Block, ctx: Context, have: str) -> str:
    """The block's new content: a whole file, or what goes between its markers (on lines of
    its own unless the markers are inline, as `have` shows)."""
    out = b.render(ctx)
    return out if b.name is None or not have.startswith("\n") else f"\n{out}\n"


def _masked(text: str, b: Block) -> str:
    return TIMING.sub("<timed>", text) if b.timed else text


def _drawn(command: str) -> tuple[str, bytes]:
    """(the image's path in the repository, the bytes `command` draws there now)."""
    import contextlib
    import tempfile

    from llmscale.cli import main

    argv = command.split()[1:]
    i = argv.index("--png")
    path = argv[i + 1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / Path(path).name
        argv[i + 1] = str(out)
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
        if rc != 0:
            raise RuntimeError(f"{command} exited {rc}")
        return path, out.read_bytes()


def _changed_images(root: Path) -> list[tuple[str, bytes]]:
    """(path, the bytes its command draws now) of each image of `IMAGE_COMMANDS` that differs
    from the file under `root`."""
    out = []
    for command in IMAGE_COMMANDS:
        path, want = _drawn(command)
        have = (root / path).read_bytes() if (root / path).is_file() else b""
        if have != want:
            out.append((path, want))
    return out


def stale_images(root: Path = SOURCE_ROOT) -> list[str]:
    """`path: the image` of each drawn image (`IMAGE_COMMANDS`) that differs from its command's."""
    return [f"{path}: the image" for path, _ in _changed_images(root)]


def write_images(root: Path = SOURCE_ROOT) -> list[str]:
    """Draw every image of `IMAGE_COMMANDS` again and keep those that changed."""
    out = []
    for path, want in _changed_images(root):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(want)
        out.append(f"{path}: the image")
    return out


def stale(root: Path = SOURCE_ROOT, ctx: Context | None = None) -> list[str]:
    """`file: block` of each block whose text differs from its rendering (timings masked)."""
    ctx = ctx or Context(root / "docs" / "results" / "results.json", measure=False)
    out = []
    for b in BLOCKS:
        have = _content((root / b.file).read_text(), b)
        if _masked(have, b) != _masked(_rendered(b, ctx, have), b):
            out.append(f"{b.file}: {b.name or 'the whole file'}")
    return out


def write(root: Path = SOURCE_ROOT, only: Collection[str] = (), retime: bool = False) -> list[str]:
    """Rewrite every stale block (timed ones measured afresh), or those named in `only`;
    `retime`: also the timed blocks whose only change is their seconds (masked otherwise, as a
    timing differs from run to run); returns what changed."""
    check = Context(root / "docs" / "results" / "results.json", measure=False)
    measure = Context(root / "docs" / "results" / "results.json", measure=True)  # timed blocks
    changed = []
    for b in BLOCKS:
        if only and b.name not in only:
            continue
        path = root / b.file
        text = path.read_text()
        have = _content(text, b)
        want = _rendered(b, check, have)
        if _masked(have, b) == _masked(want, b) and not (retime and b.timed):
            continue
        if b.timed:
            want = _rendered(b, measure, have)
            if want == have:
                continue
        if b.name is None:
            path.write_text(want)
        else:
            i, j = _span(text, b.name)
            path.write_text(text[:i] + want + text[j:])
        changed.append(f"{b.file}: {b.name or 'the whole file'}")
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.docs",
        description="Render every figure of README.md and docs/ from results.json, the planner "
        "and the commands (make docs); --check: exit 1 when a block is stale.",
    )
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    ap.add_argument(
        "--block",
        action="append",
        default=[],
        choices=sorted(b.name for b in BLOCKS if b.name),
        help="rewrite only this block (repeatable; make demo: its own)",
    )
    ap.add_argument(
        "--retime",
        action="store_true",
        help="measure the timed blocks (the plan searches' seconds) afresh and write them even "
        "when nothing else in them changed",
    )
    args = ap.parse_args(argv)
    if args.check:
        bad = stale() + stale_images()
        for s in bad:
            print(f"stale: {s} (run make docs)", file=sys.stderr)
        return 1 if bad else 0
    for s in write(only=args.block, retime=args.retime):
        print(f"wrote {s}")
    if args.block:
        return 0
    for s in write_images():
        print(f"wrote {s}")
    notice = results_notice(RESULTS_JSON)
    if notice:  # as `llmscale claims` says it: the figures are rendered from the file as it is
        print(f"llmscale docs: note: {notice}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
