"""`make docs`' renderers for docs/parallel.md, docs/schedule.md, docs/pipeline-bench.md and
docs/planner.md's prose figures: each from a record under docs/results/ (what `make demo` and
`make results` measured) or from the planner's own rule for the layout the page describes,
never typed. `llmscale.docs` lists them in its `BLOCKS`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmscale.docs import Context

# docs/parallel.md's example of FSDP under a pipeline: the tiny model with 8 layers over
# pp 2 x dp_shard 2, 4 micro-batches per rank (tests/stack/test_residency.py's orders).
GATHER_PP, GATHER_M, GATHER_LAYERS = 2, 4, 8
GATHER_ROWS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("gpipe", "1f1b"), 1),
    (("interleaved_1f1b", "zero_bubble"), 2),
    (("zbv", "dualpipev"), 2),
    (("interleaved_1f1b",), 4),
)
INFLIGHT = "activations in flight, stage 0"


# ---- docs/parallel.md ------------------------------------------------------------------------


def demo_losses(ctx: Context) -> str:
    """parallel.md: how long `make demo`'s 4-rank run took and where its loss ended, from its
    record (docs/results/demo.json, `bench/demo.py`)."""
    from llmscale.bench import demo

    rec = ctx.demo
    steps = [s for s in ((rec or {}).get("run") or {}).get("steps", []) if s.get("kind") == "train"]
    if rec is None or not steps:
        return "`make demo` has not been recorded yet (docs/results/demo.json)"
    val = next(
        (m.group(1) for line in rec["run"]["closing"]
         if (m := re.match(r"validation loss ([\d.]+)", line))),
        None,
    )  # fmt: skip
    w = demo.wall(rec)
    took = f"{w['measured']:.0f} s, {w['note']}" if w else "not timed"
    return (
        f"for {steps[-1]['step']} steps ({took}; {rec['measured_at'][:10]}) and ends at loss "
        f"{steps[-1]['loss']:.4f}" + (f", validation loss {val}" if val else "")
    )


def _times(n: float) -> str:
    return {1: "once", 2: "twice"}.get(int(n), f"{n:g} times") if n == int(n) else f"{n:g} times"


def replica_allreduces(ctx: Context) -> str:
    """parallel.md: the all-reduces across replicas of the tiny model under dp_replicate 2 and
    HSDP 2 x 2 (`stack.residency.predict_collectives`, which tests/parallel/test_zero_stages.py
    checks equal to the runtime's counts and to prediction.json)."""
    from llmscale.model.config import get_preset
    from llmscale.stack.residency import predict_collectives, stage_units

    model = get_preset("tiny")
    units = len(stage_units(model, 0, 1))
    rep = predict_collectives(model, dp_shard=1, zero_stage=1, microbatches=4, replicas=2)
    hsdp = predict_collectives(model, dp_shard=2, zero_stage=2, microbatches=2, replicas=2)
    per_rs = hsdp.grad_allreduces / hsdp.grad_reduces
    return (
        f"The {model.name} model ({model.n_layers} blocks + root = {units} units), `dp_shard 2`, "
        "4 micro-batches per rank (no all-reduces); `dp_replicate 2` alone all-reduces each unit "
        f"{_times(rep.grad_allreduces / units)} per step ({rep.grad_allreduces}, "
        f"{rep.grad_allreduce_bytes:,} bytes), HSDP 2 x 2 with 2 micro-batches per rank under "
        f"zero 2 {_times(per_rs)} per reduce-scatter ({hsdp.grad_allreduces}, "
        f"{hsdp.grad_allreduce_bytes:,} bytes: each half a unit)"
    )


def _rank_gathers(
    model: Any, zero: int, schedule: str, chunks: int, rank: int
) -> tuple[int, int, int, set[int]]:
    """(gathers of the rank's blocks, gathers of its root, reduce-scatters per unit, the
    per-unit gather counts) in one step after the first."""
    from llmscale.config import V_SCHEDULES
    from llmscale.model.config import stage_ids
    from llmscale.plan.schedule import schedule_ops
    from llmscale.stack.residency import pipeline_gathers, predict_collectives, stage_units

    order = [
        (op.kind, op.stage) for op in schedule_ops(schedule, GATHER_PP, GATHER_M, chunks)[rank]
    ]
    per_stage = pipeline_gathers(zero, order)
    v = schedule in V_SCHEDULES
    n_stages = GATHER_PP * chunks
    blocks = root = units = 0
    for s in stage_ids(rank, GATHER_PP, chunks, v_shape=v):
        n = len(stage_units(model, s, n_stages, v_shape=v))
        has_root = int(s in (0, n_stages - 1))
        blocks += per_stage.get(s, 0) * (n - has_root)
        root += per_stage.get(s, 0) * has_root
        units += n
    c = predict_collectives(
        model, dp_shard=2, zero_stage=zero, microbatches=GATHER_M, pp=GATHER_PP,
        schedule=schedule, chunks=chunks, pp_rank=rank, order=order,
    )  # fmt: skip
    return blocks, root, c.grad_reduces // units, {per_stage.get(s, 0) for s in per_stage}


def pipeline_gathers_table(ctx: Context) -> str:
    """parallel.md: all-gathers and reduce-scatters per FSDP unit and step under each pipeline
    schedule, as `stack.residency.pipeline_gathers` replays them from each rank's compute order
    (`plan.schedule.schedule_ops`, which tests/plan/test_schedule_torch.py checks against
    torch's)."""
    from llmscale.model.config import get_preset

    model = get_preset("tiny").with_overrides(n_layers=GATHER_LAYERS)
    lines = [
        "| schedule | chunks per rank | zero 1, 2 | zero 3 | reduce-scatters |",
        "|---|---|---|---|---|",
    ]
    for schedules, chunks in GATHER_ROWS:
        cells, reduces = [], set()
        for zero in (1, 3):
            got = [
                _rank_gathers(model, zero, s, chunks, r)
                for s in schedules
                for r in range(GATHER_PP)
            ]
            reduces |= {g[2] for g in got}
            counts = set().union(*(g[3] for g in got))
            if len(counts) == 1:
                (n,) = counts
                cells.append(f"{n} (m + 1)" if zero == 3 and n == GATHER_M + 1 else str(n))
            else:
                per_rank = [got[r] for r in range(GATHER_PP)]  # one schedule per such row
                cells.append(
                    "; ".join(
                        f"rank {r}: {b} gathers of its blocks and {o} of the root"
                        for r, (b, o, _, _) in enumerate(per_rank)
                    )
                )
        v = " (V)" if schedules[0] in ("zbv", "dualpipev") else ""
        rs = ", ".join(map(str, sorted(reduces)))
        lines.append(f"| {', '.join(schedules)} | {chunks}{v} | {cells[0]} | {cells[1]} | {rs} |")
    return "\n".join(lines)


def interleaved_inflight(ctx: Context) -> str:
    """parallel.md's schedule table: interleaved 1F1B's peak chunk units in flight per rank at
    p = 2, v = 2, m = 4 (`plan.schedule.peak_inflight_closed_form`)."""
    from llmscale.plan.schedule import peak_inflight_closed_form

    peaks = peak_inflight_closed_form("interleaved_1f1b", 2, 4, 2)
    return (
        f"{' and '.join(map(str, peaks))} half-stage units on ranks 0 and 1 at p = 2, v = 2, m = 4"
    )


def zbh1_idle(ctx: Context) -> str:
    """parallel.md: ZB-H1 on one chunk per rank, the paper's closed form (`plan.schedule
    .bubble_time`), against 1F1B's (p-1)(F + B + W), at the Gantt charts' pp 4, t_fwd 1,
    t_bwd 2."""
    from llmscale.plan.schedule import bubble_time

    pp, t_fwd, t_bwd = 4, 1.0, 2.0
    zb = bubble_time("zero_bubble", pp, 1, t_fwd, t_bwd)
    assert zb is not None
    share = Fraction(zb / ((pp - 1) * (t_fwd + t_bwd))).limit_denominator(100)
    words = {2: "a half", 3: "a third", 4: "a quarter", 6: "a sixth"}
    frac = words.get(share.denominator, str(share)) if share.numerator == 1 else str(share)
    return f"{zb:g}, {frac}"


# ---- the pipeline suite (make results) -------------------------------------------------------


def _pipeline_setup(ctx: Context) -> tuple[str, int, int] | None:
    """(model, seq, sequences per micro-batch) of the pipeline suite's runs, from its note."""
    for note in (ctx.results.suite("pipeline") or {}).get("notes", []):
        m = re.search(r"Model (\S+) with .*?seq (\d+), micro-batch (\d+)", note)
        if m:
            return m.group(1), int(m.group(2)), int(m.group(3))
    return None


def inflight_rest(ctx: Context) -> str:
    """schedule.md: what the planner leaves out of the activations in flight, from the
    pipeline suite's rows: the bytes the meter saw beyond the prediction, in token-id blocks of
    a micro-batch ((seq + 1) int64 ids) and what is left (the 0-d losses)."""
    rows = ctx.rows("pipeline", INFLIGHT)
    setup = _pipeline_setup(ctx)
    if not rows or setup is None:
        return "Not measured yet: `make results`."
    ids = 8 * (setup[1] + 1) * setup[2]
    gaps = {k: r["measured"] - r["predicted"] for k, r in rows.items()}
    off = {k: g for k, g in gaps.items() if g != 0}
    if not off:
        return f"Every one of the {len(rows)} configurations is the prediction to the byte."
    worst = max(abs(g) / rows[k]["measured"] for k, g in off.items())
    blocks = sorted({int(g // ids) for g in off.values()} - {0})
    rest = sorted({int(g % ids) for g in off.values()} - {0})
    explained = all(g > 0 for g in off.values()) and all(r < ids // 8 for r in rest)
    out = (
        f"What is left in {len(off)} of the {len(rows)} configurations, "
        f"{min(off.values()):,.0f} to {max(off.values()):,.0f} bytes, at most {worst:.3%}"
    )
    if explained and blocks:
        out += (
            f": the token ids of {blocks[0]} to {blocks[-1]} micro-batches more ({ids:,} bytes "
            f"each, {setup[1]} + 1 int64 ids)"
            + (f" and {', '.join(map(str, rest))} bytes of 0-d losses" if rest else "")
        )
    return out + "; the others are exact."


def inflight_limit(ctx: Context) -> str:
    """parallel.md's limits: how close `activation_peak_bytes` was to the planner in the
    pipeline suite's run."""
    rows = ctx.rows("pipeline", INFLIGHT)
    if not rows:
        return "the planner's prediction: `make results` measures it"
    worst = max(abs(r["predicted"] / r["measured"] - 1) for r in rows.values())
    at = (ctx.results.suite("pipeline") or {}).get("measured_at", "")[:10]
    return f"the planner's prediction to {worst:.2%} in `make results`' {len(rows)} runs, {at}"


def pipeline_step_cost(ctx: Context) -> str:
    """pipeline-bench.md: what one more timed step adds to the suite, at least: the sum of its
    configurations' measured makespans in `make results`' run."""
    rows = ctx.rows("pipeline", "makespan")
    if not rows:
        return "a step of every configuration more (`make results` measures them)"
    total = sum(r["measured"] for r in rows.values())
    return (
        f"at least {total:.1f} s more per extra step, the sum of the {len(rows)} configurations' "
        "measured makespans in `make results`' run"
    )


def pipeline_send_bytes(ctx: Context) -> str:
    """pipeline-bench.md: the bytes of one activation hand-off in the suite's runs (a
    micro-batch of the residual stream, fp32)."""
    from llmscale.model.config import get_preset

    setup = _pipeline_setup(ctx)
    if setup is None:
        return "activations here are a micro-batch of the residual stream"
    name, seq, mbs = setup
    size = 4 * seq * mbs * get_preset(name).dim
    return f"activations here are {size / 1024:,.0f} KiB ({name}, seq {seq}, fp32)"


# ---- docs/planner.md -------------------------------------------------------------------------


def decode_ridge(ctx: Context) -> str:
    """planner.md: the decode batch above which Llama 2 70B on an H200 turns compute-bound with
    2048 tokens of context (`plan.roofline.decode_batch_at_ridge`, as `llmscale roofline` says)."""
    from llmscale.hardware.catalog import get_gpu
    from llmscale.model.config import get_preset
    from llmscale.plan.roofline import decode_batch_at_ridge

    b = decode_batch_at_ridge(get_preset("llama2-70b"), get_gpu("h200"), 2048)
    if b == float("inf"):
        return "at 2048 tokens of context 70B decoding on an H200 stays memory-bound at any batch"
    return f"at 2048 tokens of context 70B decoding on an H200 turns compute-bound above batch {b:,.0f}"


def _validation(prefix: str) -> list[Any]:
    from llmscale.validation.runs import all_results

    return [r for r in all_results() if r.id.startswith(prefix)]


def _cp(rid: str) -> int:
    m = re.search(r"-cp(\d+)-", rid)
    return int(m.group(1)) if m else 0


def cp_rows(ctx: Context) -> str:
    """planner.md: torchtitan's Llama 3.1 8B context-parallel rows, predicted / published
    throughput (`validation.runs`)."""
    rows = sorted(_validation("tt2412-8b-8gpu-cp"), key=lambda r: _cp(r.id))
    if not rows:
        return "no such rows in validation/data/runs.toml"
    return (
        f"predicted / published {rows[0].quantity} at cp "
        + ", ".join(str(_cp(r.id)) for r in rows)
        + ": "
        + ", ".join(f"{r.ratio:.2f}" for r in rows)
    )


def vanilla_tp(ctx: Context) -> str:
    """planner.md: the vanilla-TP twins of the async-TP rows of Llama 3 8B, predicted /
    published throughput (`validation.runs`)."""
    rows = [r for r in _validation("tt2506-8b-") if r.id.endswith("-tp")]
    return ", ".join(f"{r.id} {r.ratio:.2f}" for r in rows) + " predicted / published"


def gb200_fsdp_memory(ctx: Context) -> str:
    """planner.md: what Megatron-Bridge's GB200 Llama 3 70B Megatron-FSDP rows (activation
    offload) are predicted to need, against the GPU's usable memory (`validation.runs`)."""
    from llmscale.hardware.catalog import GiB, get_gpu
    from llmscale.plan.memory import memory_options, usable_bytes
    from llmscale.stack import MEGATRON_CORE

    rows = [r for r in _validation("mbridge-") if r.id.endswith("gb200-llama3-70b-fp8-fsdp")]
    usable = usable_bytes(get_gpu("gb200"), memory_options(MEGATRON_CORE)) / GiB
    need = max(r.memory_predicted for r in rows)
    return f"{need:.1f} GiB of the {usable:.1f} usable"


def n340_memory(ctx: Context) -> str:
    """memory-model.md: what NeMo 24.07's Nemotron-4 340B row is predicted to allocate and
    to need with the caching allocator's share, against the H100's usable memory."""
    from llmscale.hardware.catalog import GiB, get_gpu
    from llmscale.plan.memory import estimate_memory, memory_options, usable_bytes
    from llmscale.validation.runs import load_runs, run_plan

    (row,) = [r for r in load_runs() if r["id"] == "nemo2407-h100-nemotron-340b"]
    plan, stack, compiled = run_plan(row)
    opt = memory_options(stack, compiled=compiled)
    w = estimate_memory(plan, opt, validate=False).worst
    usable = usable_bytes(get_gpu(str(row["gpu"])), opt) / GiB
    return (
        f"{w.allocated / GiB:.1f} GiB allocated of the {usable:.1f} usable, "
        f"{w.total / GiB:.1f} with the share"
    )


def init_rate(ctx: Context) -> str:
    """parallel.md's limits: how fast one core draws initial values (docs/results/
    parallel-init.json, `python -m llmscale.bench.parallel_init`) and what that makes of
    Llama 2 70B drawn whole on a rank."""
    from llmscale.bench import parallel_init
    from llmscale.model.config import get_preset

    rec = ctx.record("parallel-init.json", parallel_init.SUITE)
    if rec is None:
        return "not measured yet: `python -m llmscale.bench.parallel_init --json-out " \
            "docs/results/parallel-init.json`"  # fmt: skip
    rate = rec["values_per_s"]
    n = get_preset("llama2-70b").num_params()
    load = rec["load_average"]
    return (
        f"{rate / 1e9:.2f} G values/s on one core (`python -m llmscale.bench.parallel_init`, "
        f"{rec['measured_at'][:10]}, load average {load[0]:.1f} to {load[1]:.1f}), so Llama 2 "
        f"70B's {n / 1e9:.0f} G values take {n / rate / 60:.0f} minutes on a rank that draws "
        "them all"
    )


# ---- docs/planner.md: the stacks' fitted values and the validation set ------------------------


def stack_fits(ctx: Context) -> str:
    """planner.md: each stack's fixed cost per step and the factors fitted on its published
    runs (`Stack.fitted`), from the stacks themselves."""
    from llmscale.hardware.catalog import default_catalog
    from llmscale.stack import STACKS, STEP_OVERHEAD

    parts = []
    for stack in STACKS.values():
        for fit in stack.fitted:
            gpu = default_catalog().gpu(fit.gpu).display
            parts.append(f"{stack.name} on {gpu} at {fit.scale.value:g}x ({', '.join(fit.fields)})")
        for recipe, share in stack.float8_gemm_shares:
            parts.append(f"{stack.name}'s {recipe} GEMMs at {share.value:g}x the FP8 GEMM's rate")
    return f"`Stack.step_overhead_ms`: {STEP_OVERHEAD.value:g} ms, an assumption; fitted: " + (
        "; ".join(parts) if parts else "none"
    )


def fitted_note_example(ctx: Context) -> str:
    """planner.md: the line a plan priced with fitted values prints (megatron-core, MXFP8 on
    GB200), from `stack.fitted_note`."""
    from llmscale.stack import MEGATRON_CORE, fitted_note

    note = fitted_note(MEGATRON_CORE, "gb200", "fp8", "mxfp8", page=False)
    assert note is not None
    return f"`{note}`"


def nvlink_achieved(ctx: Context) -> str:
    """planner.md: what NCCL's topology model reaches on NVLink 4 (`achieved_GBps`) against the
    datasheet, per link and per GPU, from the link catalog."""
    from llmscale.hardware.catalog import default_catalog

    link = default_catalog().link("nvlink4")
    assert link.achieved_GBps is not None and link.links_per_gpu is not None
    per_gpu, links = link.achieved_GBps.value, link.links_per_gpu.value
    return (
        f"{per_gpu / links:.1f} GB/s per NVLink 4 link, {per_gpu:g} GB/s per H100 against "
        f"{link.bandwidth_GBps.value:g} on the datasheet"
    )


def run_counts(ctx: Context) -> str:
    """planner.md: how many published runs validation/data/runs.toml holds, per stack and role."""
    from llmscale.validation.runs import load_runs

    runs = load_runs()
    by: dict[str, int] = {}
    for r in runs:
        by[r["stack"]] = by.get(r["stack"], 0) + 1
    cal = sum(r["role"] == "calibration" for r in runs)
    per = ", ".join(f"{n} {s}" for s, n in sorted(by.items()))
    return f"{len(runs)} runs: {per}; {cal} of them calibration"


def time_defaults(ctx: Context) -> str:
    """planner.md: the time model's default assumptions, read from `plan.time.DEFAULT_TIME`."""
    from llmscale.plan.time import DEFAULT_TIME as t

    tp = "no TP overlap" if t.tp_overlap == 0 else f"TP overlap {t.tp_overlap:g}"
    return (
        f"{t.fwd_passes:g} + {t.bwd_passes:g} memory passes, {tp}, FSDP/DP overlap efficiency "
        f"{t.dp_overlap:g}, offload {t.offload_overlap:.0%} hidden, host AdamW "
        f"{t.host_adam_GBps:g} GB/s"
    )


def step_overhead(ctx: Context) -> str:
    """planner.md: the fixed cost per step a stack assumes on a catalog GPU."""
    from llmscale.stack import STEP_OVERHEAD

    return f"{STEP_OVERHEAD.value:g} ms on a catalog GPU"
