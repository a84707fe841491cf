"""docs/offload.md's rendered figures (`make docs`; the blocks are listed in `docs.BLOCKS`).

Each renderer reads a record under docs/results/ and says how to make it when it is missing:
- `offload-lsp.json` (`python -m llmscale.bench.offload_lsp`): LSP-Offload's fits and losses;
- `offload-kernels.json` (`python -m llmscale.bench.offload_kernels`): the host AdamW kernels
  and LSP's compression, timed;
- `offload.json` (`python -m llmscale.bench.offload`): step times, bytes and device parameter
  bytes of each offload mode and link;
- results.json's finetune suite (`make results`);
or computes from the model's shapes (`plan.lsp`: the factored compression's cost ratios).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from llmscale.ui import value_range

if TYPE_CHECKING:
    from llmscale.docs import Context


def _ms(seconds: float) -> str:
    """Milliseconds to two significant figures or more: 0.24 ms, 4.6 ms, 173 ms."""
    ms = 1e3 * seconds
    return f"{ms:.2f} ms" if ms < 1 else f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


def _measured(rec: dict[str, Any]) -> str:
    """When and under what load a record was measured ("measured 2026-12-05 09:30 UTC, load
    average 1.2 at the start, 2.3 at the end")."""
    a, b = rec["load_average"]
    return (
        f"measured {rec['measured_at'][:16].replace('T', ' ')} UTC, load average {a:.1f} at the "
        f"start, {b:.1f} at the end"
    )


# ---- offload-lsp.json ----------------------------------------------------------------------------

LSP_CMD = "python -m llmscale.bench.offload_lsp --json-out docs/results/offload-lsp.json"


def lsp_fit(ctx: Context) -> str:
    """The fits of the tiny model's matrices (error before and after), the loss of lsp against
    ZeRO-Offload over the same steps, and the rank-3 test gradient's fit."""
    from llmscale.bench import offload_lsp

    rec = ctx.record("offload-lsp.json", offload_lsp.SUITE)
    if rec is None:
        return f"Not measured yet: `{LSP_CMD}`"
    st, fits = rec["settings"], rec["fits"]
    first = min(f["step"] for f in fits)
    refits = sorted({f["step"] for f in fits} - {first})
    at = {s: [f for f in fits if f["step"] == s] for s in (first, *refits)}
    ds = sorted({f["d"] for f in fits})
    dims = f"{ds[0]}–{ds[-1]}" if len(ds) > 1 else f"{ds[0]}"
    after = statistics.mean(f["after"] for f in at[first])
    out = (
        f"On the tiny model with {st['n_blocks']} blocks (d = {dims}, s = {st['lsp_nonzeros']}) "
        f"a fit at the first step takes each matrix's error from {value_range([f['before'] for f in at[first]], 2)} "
        f"(a random sketch) to {value_range([f['after'] for f in at[first]], 2)} (mean {after:.2f})"
    )  # fmt: skip
    for s in refits:
        out += (
            f"; at step {s} (a check every {st['lsp_check_every']} steps) {len(at[s])} of the "
            f"{len(at[first])} matrices read {value_range([f['before'] for f in at[s]], 2)} with their old "
            f"projectors on the new gradient, above the threshold of "
            f"{st['lsp_refit_threshold']:g}, and were refitted to "
            f"{value_range([f['after'] for f in at[s]], 2)} (mean "
            f"{statistics.mean(f['after'] for f in at[s]):.2f})"
        )
    lsp, opt = rec["loss"]["lsp"], rec["loss"]["optimizer"]
    r = rec["rank3"]
    return out + (
        f". Over {len(lsp)} steps the loss went {lsp[0]:.2f} → {lsp[-1]:.2f} against "
        f"ZeRO-Offload's {opt[0]:.2f} → {opt[-1]:.2f}, the approximation's price on so short a "
        f"run. On a rank-{r['rank']} test gradient ({r['m']} x {r['n']}, d = {r['d']}) a fit goes "
        f"from {r['before']:.2f} to {r['after']:.2f} (`{rec['command']}`, "
        f"{rec['measured_at'][:10]})"
    )


# ---- offload-kernels.json ------------------------------------------------------------------------

KERNELS_CMD = (
    "python -m llmscale.bench.offload_kernels --json-out docs/results/offload-kernels.json"
)


def _kernels(ctx: Context) -> dict[str, Any] | None:
    from llmscale.bench import offload_kernels

    return ctx.record("offload-kernels.json", offload_kernels.SUITE)


def _compression(c: dict[str, Any]) -> str:
    return (
        f"a {c['m']} x {c['n']} compression at d = {c['d']} takes {_ms(c['sparse_s'])} against "
        f"{_ms(c['dense_s'])} dense"
    )


def lsp_compress_times(ctx: Context) -> str:
    """The sparse and dense compression of each timed shape."""
    rec = _kernels(ctx)
    if rec is None:
        return f"Not measured yet: `{KERNELS_CMD}`"
    parts = [_compression(c) for c in rec["compression"]]
    return (
        f"On this CPU ({rec['threads']} torch threads, {_measured(rec)}; `{rec['command']}`) "
        + ", and ".join(parts)
        + "."
    )


def host_adamw_kernels(ctx: Context) -> str:
    """The host AdamW step per kernel, and how far fused drifts from exact."""
    rec = _kernels(ctx)
    if rec is None:
        return f"Not measured yet: `{KERNELS_CMD}`"
    s = rec["adamw_s"]
    fe, foreach = s["exact"] / s["fused"], s["foreach"]
    than = "slower still" if foreach > s["exact"] else "faster than exact but slower than fused" \
        if foreach > s["fused"] else "faster than fused"  # fmt: skip
    drift = rec["fused_vs_exact"]
    return (
        f'The default `"fused"` kernel (`torch._fused_adamw_` on CPU) takes {_ms(s["fused"])} a '
        f'step on the host against {_ms(s["exact"])} for "exact" ({fe:.1f}x) over '
        f"{rec['n_params'] / 1e6:.1f} M parameters of the {rec['model']} model, and torch's "
        f"foreach kernel, {_ms(foreach)}, is {than} on this CPU ({rec['threads']} torch "
        f"threads, {_measured(rec)}; `{rec['command']}`). It rounds differently: from the same "
        f"state on the same random gradients its weights differ from exact's by {drift[0]:.0e} "
        f"of what the first step changed and {drift[-1]:.0e} after {len(drift)} steps"
    )


# ---- offload.json --------------------------------------------------------------------------------

OFFLOAD_CMD = (
    "python -m llmscale.bench.offload --offload optimizer optimizer+params --link-gbps 0 1 0.1 "
    "--json-out docs/results/offload.json"
)


def _offload(ctx: Context) -> tuple[dict[str, Any], dict[tuple[str, float], dict[str, Any]]] | None:
    from llmscale.bench import offload

    rec = ctx.record("offload.json", offload.SUITE)
    if rec is None:
        return None
    return rec, {(r["offload"], r["link_gbps"]): r for r in rec["runs"]}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def params_offload_bytes(ctx: Context) -> str:
    """The device's parameter bytes between steps and at most during a step under
    optimizer+params, against the whole model's without parameter offload."""
    got = _offload(ctx)
    runs = [r for r in (got[1] if got else {}).values() if r.get("param_peak_bytes")]
    if got is None or not runs:
        return f"Not measured yet: `{OFFLOAD_CMD}`"
    r = runs[0]
    between = {r["param_bytes"][m] for m in ("serial", "overlap")}
    peak = {r["param_peak_bytes"][m] for m in ("serial", "overlap")}
    return (
        f"the device holds **{' / '.join(_mib(b) for b in sorted(between))} of parameters "
        f"between steps and at most {' / '.join(_mib(b) for b in sorted(peak))} during a step, "
        f"against {_mib(r['param_bytes']['off'])}** without parameter offload"
    )


def params_offload_traffic(ctx: Context) -> str:
    """How many more bytes optimizer+params moves than optimizer, and optimizer's overlapped
    step at 1 GB/s against no offload."""
    got = _offload(ctx)
    if got is None:
        return f"Not measured yet: `{OFFLOAD_CMD}`"
    rec, runs = got
    p = next((r for (m, _), r in runs.items() if m == "optimizer+params"), None)
    o = next((r for (m, _), r in runs.items() if m == "optimizer"), None)
    if p is None or o is None:
        return f"Not measured yet: `{OFFLOAD_CMD}`"
    pb, ob = p["bytes_moved"]["overlap"], o["bytes_moved"]["overlap"]
    out = (
        f"`optimizer+params` moves {pb / ob:.2f}x the bytes of `optimizer` here ({_mib(pb)} "
        f"against {_mib(ob)} a step): each micro-step fetches every unit for its forward and "
        f"all but the head for its backward, instead of one upload of the "
        f"{_mib(o['param_bytes']['off'])} of weights per step"
    )
    g1 = runs.get(("optimizer", 1.0))
    if g1 is not None:
        st = g1["step_s"]
        out += (
            f". At 1 GB/s the overlapped `optimizer` step took {_ms(st['overlap'])} against "
            f"{_ms(st['off'])} without offload ({st['overlap'] / st['off'] - 1:+.0%}; serially "
            f"{st['serial'] / st['off'] - 1:+.0%})"
        )
    return out


def offload_reading(ctx: Context) -> str:
    """The offload bench's `optimizer` runs read: memcpy, 1 GB/s and 0.1 GB/s."""
    got = _offload(ctx)
    if got is None:
        return f"Not measured yet: `{OFFLOAD_CMD}`"
    rec, runs = got
    links = [(g, r) for (m, g), r in runs.items() if m == "optimizer"]
    if not links:
        return f"Not measured yet: `{OFFLOAD_CMD}`"
    n = links[0][1].get("n_params")
    size = f"; the model has {n / 1e6:.1f} M parameters" if n else ""
    lines = [
        f"In the offload bench's record ({_measured(rec)}; {rec['notes'][0]}{size}), per link, "
        "for `optimizer`:",
        "",
    ]
    for g, r in links:
        st, work = r["step_s"], r["offload_work_s"]
        what = 'real memcpy (the CPU is the "device")' if g <= 0 else f"a simulated {g:g} GB/s link"
        line = (
            f"- {what}: {_ms(work)} of offload work per step beside a {_ms(st['off'])} step "
            f"without offload; against it, the step serially {st['serial'] / st['off'] - 1:+.0%}, "
            f"overlapped {st['overlap'] / st['off'] - 1:+.0%}"
        )
        if g > 0:
            moved = r["bytes_moved"]["overlap"]
            line += (
                f"; the link moves {moved / 1e6:.0f} MB a step, {_ms(moved / (g * 1e9))} at "
                f"{g:g} GB/s"
            )
        hw = r["hidden_wall"]
        hidden = f"{hw:.0%} by wall time" if hw == hw and hw >= 0 else "nothing by wall time"
        line += f"; overlap hid {hidden}, {r['hidden_timeline']:.0%} by the timeline"
        if "update_after_backward_s" in r:
            line += (
                f"; the first update starts {1e3 * r['update_after_backward_s']:+.0f} ms and the "
                f"last upload ends {1e3 * r['last_after_backward_s']:+.0f} ms after backward ends"
            )
        lines.append(line + ".")
    return "\n".join(lines)


# ---- results.json's finetune suite ---------------------------------------------------------------


def zero_offload_link(ctx: Context) -> str:
    """ZeRO-Offload's bytes per step in the finetune suite, their time at 1 GB/s, and its step
    at 1 GB/s against native copies."""
    moved = ctx.rows("finetune", "bytes moved per step").get("optimizer")
    wall = ctx.results.suite_rows("finetune-time", "step time (median)")
    if moved is None:
        return "The finetune suite has not been measured yet (`make results`)"
    b = moved["measured"]
    out = f"At 1 GB/s, ZeRO-Offload's {b / 1e6:.0f} MB of copies a step take {_ms(b / 1e9)}"
    g1, nat = wall.get("optimizer @ 1 GB/s"), wall.get("optimizer @ native")
    if g1 and nat:
        out += (
            f", and its overlapped step took {_ms(g1['measured'])} against {_ms(nat['measured'])}"
            " with native copies in the finetune suite above"
        )
    return out


# ---- the regime: the model's shapes --------------------------------------------------------------


def lsp_regime(ctx: Context) -> str:
    """The factored compression's multiply-adds against the weight gradient's, T d (m + n + d)
    / (T m n), per block matrix of the small model at its d, and at the paper's proportions;
    the sparse and dense 4096 x 4096 compression from offload-kernels.json."""
    from llmscale.model.config import get_preset
    from llmscale.plan.lsp import matrix_dims, one_process_split
    from llmscale.plan.plan import Plan

    model = get_preset("small")
    plan = Plan(model=model, seq_len=128, micro_batch_size=1, global_batch_size=1, offload="lsp")
    mats = sorted({
        (s, matrix_dims(s, plan.lsp_dim, plan.lsp_nonzeros)[0])
        for s in one_process_split(model).matrices
    })  # fmt: skip
    ratio: dict[float, list[str]] = {}
    for (m, n), d in mats:
        r = round(d * (m + n + d) / (m * n), 2)
        if f"{n} x {m}" not in ratio.get(r, []):
            ratio.setdefault(r, []).append(f"{m} x {n}")
    widths = sorted({w for (m, n), _ in mats for w in (m, n)})
    ds = sorted({d for _, d in mats}, reverse=True)
    items = [f"- {r:.2f} of it for the {' and '.join(s)} matrices;" for r, s in ratio.items()]
    items[-1] = items[-1][:-1] + "."
    d, s, w = plan.lsp_dim, plan.lsp_nonzeros, 4096
    paper = d * (2 * w + d) / (w * w)
    out = [
        f"**The regime.** The small model's matrices are {widths[0]} to {widths[-1]} wide, and "
        f"`lsp_dim` {plan.lsp_dim} is capped at d = {' or '.join(map(str, ds))}, half their "
        "smaller side. So the factored compression costs T d (m + n + d) multiply-adds against "
        "the weight gradient's T m n:",
        *items,
        "",
        f"At the paper's proportions (d = {d} against {w}-wide matrices) the factored "
        f"compression costs {paper:.2f} of the weight gradient, and the sketches take "
        f"s/d = 1/{d // s} of a dense projection's multiply-adds",
    ]
    rec = _kernels(ctx)
    big = [c for c in (rec or {}).get("compression", []) if (c["m"], c["n"], c["d"]) == (w, w, d)]
    if big:
        out[-1] += (
            f": {_ms(big[0]['dense_s'])} dense against {_ms(big[0]['sparse_s'])} sparse for one "
            f"{w} x {w} compression on this CPU (`{rec['command']}`)"  # type: ignore[index]
        )
    out[-1] += "."
    return "\n".join(out)
