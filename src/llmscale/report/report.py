"""Rendering planner results: rich tables for people, JSON for machines, a PNG bar chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from llmscale.hardware.catalog import Catalog, GiB
from llmscale.plan.memory import MemoryEstimate, RankMemory
from llmscale.plan.plan import Plan
from llmscale.plan.predict import plan_collectives
from llmscale.plan.roofline import Roofline
from llmscale.plan.search import Candidate, SearchResult
from llmscale.stack import LLMSCALE, Stack, fitted_values

# The memory parts every table and picture shows: RankMemory's own breakdown, in its order.
MEMORY_PARTS = tuple(
    RankMemory(
        pp_rank=0, params=0, grads=0, optimizer=0, working_params=0, activations=0, transient=0,
        allocator=0, host=0, inflight=0,
    ).breakdown()
)  # fmt: skip


def gib(x: float) -> str:
    return f"{x / GiB:.1f}"


# A table's byte figures share one unit, the largest in which its largest figure reads >= 1.
BYTE_UNITS = (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10))


def byte_unit(largest: float) -> tuple[str, int]:
    """(name, bytes) of the unit for a table whose largest figure is `largest` bytes: GiB from
    1 GiB up, else MiB, KiB or B, so that a tiny model's table does not read 0.00 throughout."""
    for name, size in BYTE_UNITS:
        if largest >= size:
            return name, size
    return "B", 1


# ---- hardware -----------------------------------------------------------------------------


# The dense peaks the catalog lists, in the order the tables print them.
PEAK_COLUMNS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")


def hardware_tables(cat: Catalog) -> list[Table]:
    gpus = Table(title="Accelerators (dense peak, no sparsity)")
    for col in ("name", "GPU", "HBM GiB", "HBM TB/s", *PEAK_COLUMNS,
                "ridge bf16 FLOP/B", "scale-up"):  # fmt: skip
        gpus.add_column(col, justify="left" if col in ("name", "GPU", "scale-up") else "right")
    for g in cat.gpus.values():
        tf = [f"{g.dense_TFLOPS[d].value:g}" if d in g.dense_TFLOPS else "-"
              for d in PEAK_COLUMNS]  # fmt: skip
        gpus.add_row(g.name, g.display, f"{g.memory_GiB.value:g}", f"{g.hbm_TBps.value:g}", *tf,
                     f"{g.ridge_point('bf16'):.0f}", g.scale_up)  # fmt: skip
    links = Table(title="Links (bandwidth each direction, per GPU or NIC port; latency = alpha)")
    for col in ("name", "link", "kind", "GB/s", "GPU-to-GPU GB/s", "latency us"):
        links.add_column(col, justify="right" if "GB/s" in col or "us" in col else "left")
    for lk in cat.links.values():
        pair = f"{lk.pair_GBps.value:g}" if lk.pair_GBps else "-"
        links.add_row(lk.name, lk.display, lk.kind, f"{lk.bandwidth_GBps.value:g}", pair,
                      f"{lk.latency_us.value:g}")  # fmt: skip
    nodes = Table(title="Node shapes")
    for col in ("name", "node", "GPU", "GPUs", "scale-up", "NICs", "NIC"):
        nodes.add_column(col, justify="right" if col in ("GPUs", "NICs") else "left")
    for n in cat.nodes.values():
        nodes.add_row(n.name, n.display, n.gpu, str(n.gpus_per_node), n.scale_up,
                      str(n.nics_per_node), n.nic)  # fmt: skip
    topo = Table(title="Network topologies and switches (prices are assumptions)")
    for col in ("name", "description"):
        topo.add_column(col)
    for t in cat.topologies.values():
        topo.add_row(t.name, t.display)
    for s in cat.switches.values():
        topo.add_row(s.name, f"{s.display}; ${s.price_usd.value:,.0f} (assumption)")
    return [gpus, links, nodes, topo]


def sources_table(cat: Catalog) -> Table:
    t = Table(title="Where every number comes from")
    for col in ("entry", "field", "value", "source"):
        t.add_column(col)
    for g in cat.gpus.values():
        t.add_row(g.name, "memory_GiB", f"{g.memory_GiB.value:g}", g.memory_GiB.source)
        t.add_row(g.name, "hbm_TBps", f"{g.hbm_TBps.value:g}", g.hbm_TBps.source)
        for d, num in g.dense_TFLOPS.items():
            t.add_row(g.name, f"dense_TFLOPS.{d}", f"{num.value:g}", num.source)
    for lk in cat.links.values():
        t.add_row(
            lk.name, "bandwidth_GBps", f"{lk.bandwidth_GBps.value:g}", lk.bandwidth_GBps.source
        )
        t.add_row(lk.name, "latency_us", f"{lk.latency_us.value:g}", lk.latency_us.source)
    for n in cat.nodes.values():
        t.add_row(n.name, "gpus", f"{n.gpus.value:g}", n.gpus.source)
    for sw in cat.switches.values():
        t.add_row(sw.name, "ports", f"{sw.ports.value:g}", sw.ports.source)
        t.add_row(sw.name, "price_usd", f"{sw.price_usd.value:g}", sw.price_usd.source)
    return t


def compare_table(cat: Catalog, a: str, b: str) -> Table:
    """Ratios of two links (bandwidth, latency) or of two GPUs (memory, bandwidth, peaks)."""
    t = Table(title=f"{a} vs {b}")
    for col in ("quantity", a, b, f"{a} / {b}"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    if a in cat.links or b in cat.links:
        la, lb = cat.link(a), cat.link(b)
        rows = [
            ("bandwidth GB/s (each way)", la.bandwidth_GBps.value, lb.bandwidth_GBps.value),
            ("GPU-to-GPU GB/s", la.pair_bandwidth / 1e9, lb.pair_bandwidth / 1e9),
            ("latency us (alpha)", la.latency_us.value, lb.latency_us.value),
            ("1 GB transfer ms", 1e3 * (la.latency + 1e9 / la.bandwidth),
             1e3 * (lb.latency + 1e9 / lb.bandwidth)),
        ]  # fmt: skip
    else:
        ga, gb = cat.gpu(a), cat.gpu(b)
        rows = [
            ("HBM GiB", ga.memory_GiB.value, gb.memory_GiB.value),
            ("HBM TB/s", ga.hbm_TBps.value, gb.hbm_TBps.value),
        ]
        for d in PEAK_COLUMNS:
            if d in ga.dense_TFLOPS and d in gb.dense_TFLOPS:
                rows.append((f"{d} TFLOP/s", ga.dense_TFLOPS[d].value, gb.dense_TFLOPS[d].value))
    for name, x, y in rows:
        t.add_row(name, f"{x:g}", f"{y:g}", f"{x / y:.3g}")
    return t


# ---- plans --------------------------------------------------------------------------------


def plan_label(p: Plan, stack: Stack = LLMSCALE) -> dict[str, str]:
    """The plan's fields as the tables print them; the data-parallel kind as `stack` names it
    (Megatron's distributed optimizer "distopt", FSDP, replicas "ddp")."""
    dp = f"{p.dp_replicate}x{p.dp_shard}" if p.dp_replicate > 1 and p.dp_shard > 1 else str(p.dp)
    kind = stack.sharded_dp_name(p.zero_stage) if p.dp_shard > 1 else ("ddp" if p.dp > 1 else "-")
    sched = (
        "-"
        if p.pp == 1
        else p.pp_schedule.replace("interleaved_1f1b", f"interleaved v={p.pp_chunks}")
    )
    if p.pp > 1 and p.pp_schedule == "zero_bubble":
        sched = f"zero_bubble v={p.pp_chunks}"
    rec = p.recompute if p.recompute != "every_k" else f"every_{p.recompute_every_k}"
    offload = str(p.offload)
    if p.offload_activations:  # the first N blocks' activations on the host
        acts = f"act {p.offload_activations}"
        offload = acts if p.offload == "none" else f"{p.offload}, {acts}"
    return {
        "tp": str(p.tp), "pp": str(p.pp),
        "dp": f"{dp} {kind}" + (f" cp{p.cp}" if p.cp > 1 else ""),  # cp ranks: inside dp
        "zero": str(p.zero_stage) if p.dp_shard > 1 else "-", "mbs": str(p.micro_batch_size),
        "recompute": rec, "schedule": sched, "sp": "y" if p.sequence_parallel else "-",
        "offload": offload,
    }  # fmt: skip


def bar_label(c: Candidate, stack: Stack = LLMSCALE) -> str:
    """A plan named fully under its bar: degrees and data-parallel kind, ZeRO stage, micro-batch
    and recompute, schedule, offload, step time, and whether it fits only tightly (without the
    caching allocator's share, which then stands over the capacity line) or not at all."""
    lab = plan_label(c.plan, stack)
    zero = f" z{lab['zero']}" if lab["zero"] != "-" else ""
    sp = " sp" if lab["sp"] == "y" else ""
    off = "" if lab["offload"] == "none" else f"\noffload {lab['offload']}"
    fit = ", does not fit" if not c.fits else ", tight" if c.tight else ""
    return (
        f"tp{lab['tp']} pp{lab['pp']}{sp}\ndp {lab['dp']}{zero}\nmbs {lab['mbs']} {lab['recompute']}"
        f"\n{lab['schedule']}{off}\n{c.time.seconds:.1f}s{fit}"
    )


# Short labels for the default (100-column) table; --wide shows plan_label's own.
_SHORT = {"interleaved": "intl", "optimizer+params": "opt+par", "optimizer": "opt", "none": "-"}
_NARROW = ("#", "tp", "pp", "dp", "zero", "mbs", "recompute", "schedule", "sp", "offload",
           "step s", "tok/s", "MFU", "GiB")  # fmt: skip
_WIDE = ("#", "tp", "pp", "dp", "zero", "mbs", "recompute", "schedule", "sp", "offload",
         "step s", "tok/s", "MFU", "states", "working", "activ.", "B to W", "recv", "transient",
         "total GiB")  # fmt: skip
_LEFT = ("dp", "recompute", "schedule", "offload")


def _si(x: float) -> str:
    """3 significant digits with a k/M/G suffix: 95.6k, 4.02M."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _short_label(lab: dict[str, str]) -> dict[str, str]:
    out = dict(lab)
    out["schedule"] = lab["schedule"].replace("interleaved v=", "intl v")
    out["schedule"] = out["schedule"].replace("zero_bubble v=", "zb v")
    out["offload"] = _SHORT.get(lab["offload"], lab["offload"])
    return out


def memory_unit(result: SearchResult) -> tuple[str, int]:
    """`byte_unit` of the plans `search_table` shows (their fullest GPUs' totals)."""
    return byte_unit(max((c.memory.worst.total for c in result.shown), default=GiB))


def search_table(result: SearchResult, wide: bool = False) -> Table:
    """The shown plans (those that fit, else the closest, flagged): at most 100 columns, or
    every column with `wide`."""
    gpu = result.cluster.gpu
    head = "Top plans" if result.candidates else "Closest plans (none fits)"
    cols = _WIDE if wide else _NARROW
    t = Table(
        title=f"{head} on {result.gpus} x {gpu.name} ({gpu.memory_GiB.value:g} GiB each)",
        box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1),
    )  # fmt: skip
    unit, size = memory_unit(result)

    def b(x: float) -> str:
        return f"{x / size:.1f}"

    for c in cols:
        c = c.replace("GiB", unit)
        t.add_column(c, justify="left" if c in _LEFT else "right")
    for i, cand in enumerate(result.shown, 1):
        w = cand.memory.worst
        full = plan_label(cand.plan, result.stack)
        lab = full if wide else _short_label(full)
        mem_cols = (
            [b(w.states), b(w.working_params), b(w.activations), b(w.pending_weight_grads),
             b(w.pipeline_buffers), b(w.transient + w.allocator), b(w.total)]
            if wide else [b(w.total)]
        )  # fmt: skip
        t.add_row(
            f"{i}{'!' if not cand.fits else '~' if cand.tight else ''}",
            *[lab[k] for k in cols[1:10]],
            f"{cand.time.seconds:.2f}",
            f"{cand.time.tokens_per_s:,.0f}" if wide else _si(cand.time.tokens_per_s),
            f"{cand.time.mfu:.1%}", *mem_cols,
        )  # fmt: skip
    return t


def _stage_dict(s: RankMemory) -> dict[str, Any]:
    return {**s.breakdown(), "total": s.total, "allocated": s.allocated, "host": s.host,
            "inflight_microbatches": s.inflight, "stage": s.pp_rank}  # fmt: skip


def memory_json(est: MemoryEstimate) -> dict[str, Any]:
    return {"worst_stage": _stage_dict(est.worst), "stages": [_stage_dict(s) for s in est.per_rank]}


def candidate_json(c: Candidate) -> dict[str, Any]:
    p = c.plan
    fields = {k: getattr(p, k) for k in ("seq_len", "micro_batch_size", "global_batch_size",
              "recompute", "recompute_every_k", "precision", "offload", "dp_replicate",
              "dp_shard", "tp", "pp", "pp_schedule", "pp_chunks", "sequence_parallel",
              "zero_stage", "cp", "offload_activations")}  # fmt: skip
    fields["pp_layers"] = list(p.pp_layers)  # [] = the automatic split
    return {
        "plan": {"model": p.model.name, **fields},
        "overrides": " ".join(p.overrides()),
        "fits": c.fits,
        "tight": c.tight,
        "why": c.why,
        "memory_bytes": memory_json(c.memory),
        "step_time": {
            "seconds": c.time.seconds, "tokens_per_s": c.time.tokens_per_s, "mfu": c.time.mfu,
            "hfu": c.time.hfu, "bubble_fraction": c.time.bubble_fraction,
            "breakdown_seconds": c.time.breakdown,
        },
    }  # fmt: skip


def _collectives(c: Candidate, stack: str) -> dict[str, Any]:
    """The llmscale runtime's four collective counts per step on pipeline rank 0, as its
    metrics rows carry them (`plan.predict.plan_collectives`; None where not predicted);
    another stack's plans carry none."""
    if stack != "llmscale":
        return {}
    return {"collectives": plan_collectives(c.plan, 0)}


def search_json(result: SearchResult, inputs: dict[str, Any]) -> dict[str, Any]:
    fitted = fitted_values(result.stack, result.cluster.gpu.name, inputs.get("precision", ""),
                           inputs.get("float8_recipe", "tensorwise"))  # fmt: skip
    return {
        "inputs": inputs,
        "search": {"evaluated": result.evaluated, "feasible": result.feasible,
                   "seconds": result.seconds},
        "fitted": [{"scales": what, "value": num.value, "source": num.source}
                   for what, num in fitted],
        "candidates": [
            {**candidate_json(c), **_collectives(c, inputs.get("stack", "llmscale"))}
            for c in result.shown
        ],
        "why": result.why_none(),
    }  # fmt: skip


def memory_png(result: SearchResult, path: str | Path) -> Path:
    """Stacked bars of the fullest GPU's memory for each candidate, against its capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    shown = result.shown
    # wide enough for the longest bar label ("offload optimizer+params") at 6 pt
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(shown) + 2), 4.5))
    xs = list(range(1, len(shown) + 1))
    bottom = [0.0] * len(xs)
    for part in MEMORY_PARTS:
        vals = [c.memory.worst.breakdown()[part] / GiB for c in shown]
        if not any(vals):
            continue
        ax.bar(xs, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    cap = result.cluster.gpu.memory_GiB.value
    ax.axhline(
        cap,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"{result.cluster.gpu.name} {cap:g} GiB",
    )
    labels = []
    for c in shown:
        labels.append(bar_label(c, result.stack))
    ax.set_xticks(xs, labels, fontsize=6)
    ax.set_ylabel("GiB on the fullest GPU")
    ax.set_title("Memory per GPU of the top plans (step time under each bar)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---- roofline -----------------------------------------------------------------------------


def roofline_table(rows: list[Roofline]) -> Table:
    t = Table(title="Roofline: arithmetic intensity vs the ridge point (peak / HBM bandwidth)")
    for col in (
        "workload",
        "FLOPs",
        "HBM bytes",
        "FLOP/byte",
        "ridge",
        "bound",
        "attainable TFLOP/s",
    ):
        t.add_column(col, justify="left" if col in ("workload", "bound") else "right")
    for r in rows:
        t.add_row(r.workload, f"{r.flops:.3g}", f"{r.bytes:.3g}", f"{r.intensity:.1f}",
                  f"{r.ridge:.1f}", r.bound, f"{r.attainable_flops / 1e12:.0f}")  # fmt: skip
    return t


def network_table(rows: list[Any], gpus: int, gpu: str) -> Table:
    base = rows[0]
    t = Table(
        title=f"Networks for {gpus} x {gpu} (prices are assumptions: hardware/data/network.toml)"
    )
    cols = ("topology", "switch", "tiers", "switches", "links", "transceivers", "cost $M",
            "vs fat-tree", "plan step s", "all-to-all ms")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c in ("topology", "switch") else "right")
    for r in rows:
        d = r.design
        t.add_row(d.kind, d.switch.name, str(d.tiers), f"{d.switches:,}", f"{d.links:,}",
                  f"{d.transceivers:,}", f"{d.cost_usd / 1e6:.2f}",
                  f"{d.cost_usd / base.design.cost_usd - 1:+.0%}", f"{r.step_seconds:.2f}",
                  f"{r.all_to_all_seconds * 1e3:.1f}")  # fmt: skip
    return t
