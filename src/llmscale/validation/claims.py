"""Every claim of the article, checked: `llmscale claims`.

The article is "Distributed Solutions: Practical Approaches to Scale LLM Compute, Part 2"; each
row names the primary source behind a claim where there is one. A row's figure is computed on
the spot from the hardware catalog, the planner (memory, network), the pipeline-schedule
simulator or the serving model (plan/inference.py), or read from `docs/results/results.json`
(what `make results` measured on this project's machine, with the time it was measured). Nothing
here trains: the whole table takes well under a second.

Verdicts: `holds` (llmscale's figure agrees), `holds with a caveat` (it agrees under conditions
the row states), `does not hold here` (llmscale's figure disagrees; the row says under which
conditions the claim could hold).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmscale.config import Offload
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import Catalog, GiB, default_catalog
from llmscale.model.config import get_preset
from llmscale.plan import inference
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import estimate_memory
from llmscale.plan.network import all_to_all_seconds, design
from llmscale.plan.plan import Plan
from llmscale.plan.schedule import simulate

VERDICTS = ("holds", "holds with a caveat", "does not hold here")
ARTICLE = "Distributed Solutions: Practical Approaches to Scale LLM Compute, Part 2"
DEFAULT_RESULTS = Path("docs/results/results.json")
NOT_MEASURED = "not measured yet"


@dataclass(frozen=True)
class Claim:
    """One row: the claim, its primary source, how llmscale checks it, and the verdict."""

    claim: str
    source: str
    command: str
    figure: str
    verdict: str
    why: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")


class Results:
    """docs/results/results.json, or nothing when it is missing (rows say "not measured yet")."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {}
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(
                    "results", str(path), f"a JSON file from make results ({e})"
                ) from None
            if not isinstance(data, dict):
                raise ConfigError("results", str(path), "a JSON object of suites (make results)")
            self.data = data

    def suite(self, name: str) -> dict[str, Any] | None:
        s = self.data.get(name)
        return s if isinstance(s, dict) else None

    def when(self, name: str) -> str:
        """When a suite was measured: its `measured_at`, or a note that the file predates it."""
        s = self.suite(name) or {}
        at = s.get("measured_at")
        return f"measured {at}" if at else "measured before results.json kept a timestamp"

    def table(self, suite: str, starts: str) -> tuple[list[str], list[list[str]]] | None:
        s = self.suite(suite)
        for title, t in (s or {}).get("tables", {}).items():
            if title.startswith(starts):
                return list(t["header"]), [list(r) for r in t["rows"]]
        return None

    def rows(self, suite: str, quantity: str) -> dict[str, dict[str, Any]]:
        s = self.suite(suite)
        return {r["config"]: r for r in (s or {}).get("rows", []) if r["quantity"] == quantity}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# ---- hardware ---------------------------------------------------------------------------------


def h200_spec(cat: Catalog, res: Results) -> Claim:
    h200, h100 = cat.gpu("h200"), cat.gpu("h100")
    ratio = h200.hbm_bandwidth / h100.hbm_bandwidth
    ok = h200.memory_GiB.value == 141 and h200.hbm_TBps.value == 4.8 and round(ratio, 1) == 1.4
    return Claim(
        "H200: 141 GB HBM3e, 4.8 TB/s, 1.4x the H100's bandwidth",
        "NVIDIA H200 product page",
        "llmscale hw --compare h200 h100",
        f"{h200.memory_GiB.value:g} GB, {h200.hbm_TBps.value:g} TB/s; x{ratio:.2f} the H100 SXM's "
        f"{h100.hbm_TBps.value:g} TB/s",
        "holds" if ok else "does not hold here",
        "the catalog's datasheet figures (same dense peaks as the H100: the gain is memory only)",
    )


def _serving_pair(
    gpus: int, inp: int, out: int, precision: str, batches: tuple[int | None, int | None]
) -> tuple[inference.ServingPrediction, inference.ServingPrediction]:
    model = get_preset("llama2-70b")
    h100 = inference.predict(model, "h100", gpus, inp, out, precision, batch=batches[0])
    h200 = inference.predict(model, "h200", gpus, inp, out, precision, batch=batches[1])
    return h100, h200


def h200_inference(cat: Catalog, res: Results) -> list[Claim]:
    # NVIDIA's 1.9x: TensorRT-LLM's H200 launch post, Llama 2 70B, ISL/OSL 2048/128, one GPU,
    # FP8, largest power-of-two batch: 8 on H100, 32 on H200.
    fit100, fit200 = _serving_pair(1, 2048, 128, "fp8", (None, None))
    nv100, nv200 = _serving_pair(1, 2048, 128, "fp8", (8, 32))
    # MLPerf Inference v4.0 Llama 2 70B: OpenOrca prompts capped at 1,024 tokens, 294.45
    # generated tokens per sample on average; 8 GPUs per system.
    ml100, ml200 = _serving_pair(8, 1024, 294, "fp8", (None, None))
    r_fit = fit200.tokens_per_s / fit100.tokens_per_s
    r_nv = nv200.tokens_per_s / nv100.tokens_per_s
    r_ml = ml200.tokens_per_s / ml100.tokens_per_s
    holds = abs(r_nv / 1.9 - 1) <= 0.15
    speed = Claim(
        "H200 runs Llama 2 70B inference 1.9x faster than H100",
        "NVIDIA TensorRT-LLM H200 launch post (TensorRT-LLM v0.5.0, FP8, ISL/OSL 2048/128, one "
        "GPU, batch 8 on H100, 32 on H200); MLPerf Inference v4.0 (Llama 2 70B, OpenOrca)",
        "llmscale infer --model llama2-70b --gpu h200 --gpus 1 --input-len 2048 --output-len 128 "
        "--precision fp8 --json (and --gpu h100)",
        f"x{r_nv:.2f} (vs NVIDIA's 1.9x) at NVIDIA's batches 8 vs 32 ({nv100.tokens_per_s:,.0f} vs "
        f"{nv200.tokens_per_s:,.0f} tok/s); x{r_fit:.2f} at the largest batch each fits "
        f"({fit100.batch} vs {fit200.batch}); MLPerf-shaped (8 GPUs, 1,024 prompt tokens, the "
        "dataset's cap, 294 generated, its mean): "
        f"x{r_ml:.2f}",
        "holds with a caveat" if holds else "does not hold here",
        "the ratio comes from the batch the larger HBM allows (decode reads the weights once per "
        "step for the whole batch) plus 1.43x bandwidth; at the batch memory allows with a 10% "
        "reserve, or with MLPerf's shorter prompts over 8 GPUs, llmscale predicts less",
    )
    share = nv200.prefill_s / nv200.batch_seconds
    regime = Claim(
        "there the H200 is compute-bound rather than memory-bound",
        "the article, on NVIDIA's MLPerf Inference v4.0 result",
        "llmscale infer --model llama2-70b --gpu h200 --gpus 1 --input-len 2048 --output-len 128 "
        "--precision fp8 --batch 32",
        f"prefill {nv200.prefill.bound} ({nv200.prefill.intensity:,.0f} FLOP/B vs ridge "
        f"{nv200.prefill.ridge:,.0f}), {_pct(share)} of the time; decode {nv200.decode.bound} "
        f"({nv200.decode.intensity:,.0f} FLOP/B)",
        "holds with a caveat" if share > 0.5 else "does not hold here",
        "with 2,048-token prompts most of the time is the compute-bound prefill; the decode "
        "steps, where the H200's gain is, stay memory-bound at batch 32",
    )
    return [speed, regime]


def mi325x(cat: Catalog, res: Results) -> Claim:
    g = cat.gpu("mi325x")
    n = cat.node_for_gpu("mi325x").gpus_per_node
    mem, bw = g.memory_GiB.value, g.hbm_TBps.value
    ok = (mem, bw, n * mem, n * bw) == (256, 6.0, 2048, 48.0)
    return Claim(
        "MI325X: 256 GB HBM3E at 6 TB/s; eight of them 2 TB and 48 TB/s",
        "AMD Instinct MI325X product page",
        "llmscale hw",
        f"{mem:g} GB, {bw:g} TB/s; x{n}: {n * mem:,.0f} GB, {n * bw:g} TB/s",
        "holds" if ok else "does not hold here",
        "the catalog's datasheet figures times the 8-GPU platform",
    )


def nvlink5(cat: Catalog, res: Results) -> list[Claim]:
    nv, pcie = cat.link("nvlink5"), cat.link("pcie5")
    links = nv.links_per_gpu.value if nv.links_per_gpu else float("nan")
    per_link = 2 * (nv.per_link_bandwidth or float("nan")) / 1e9
    total = 2 * nv.bandwidth / 1e12
    ratio = nv.bandwidth / pcie.bandwidth
    ok = (round(per_link), round(links), total) == (100, 18, 1.8) and ratio >= 14
    link = Claim(
        "NVLink 5: 100 GB/s per link, 18 links, 1.8 TB/s per GPU, 14x PCIe Gen5",
        "NVIDIA NVLink page",
        "llmscale hw --compare nvlink5 pcie5",
        f"{per_link:g} GB/s x {links:g} links = {total:g} TB/s (both directions); x{ratio:.1f} a "
        "PCIe Gen5 x16 slot",
        "holds" if ok else "does not hold here",
        "catalog figures; 14x compares with one x16 slot (63 GB/s each way)",
    )
    nvl = cat.node("nvl576")
    g = cat.gpu(nvl.gpu)
    agg = nvl.gpus_per_node * 2 * nv.bandwidth / 1e15
    fast = nvl.gpus_per_node * g.memory_GiB.value + nvl.host_memory_GiB.value  # GiB
    system = Claim(
        "an NVLink Switch System joins 576 GPUs with 1 PB/s in total and 240 TB of fast memory",
        "NVIDIA NVLink page; DGX SuperPOD with DGX GB200 announcement (GTC 2024)",
        "llmscale hw",
        f"{nvl.gpus_per_node} GPUs x 1.8 TB/s = {agg:.2f} PB/s; HBM + Grace LPDDR5X = "
        f"{fast / 1024:,.1f} TiB ({fast * GiB / 1e12:,.0f} TB decimal)",
        "holds with a caveat",
        "the 240 TB matches in binary units (TiB); the planner treats the 576 GPUs as one "
        "scale-up domain with NVL72's per-GPU link, not a two-level switch tree",
    )
    return [link, system]


def infinity_fabric(cat: Catalog, res: Results) -> Claim:
    f = cat.link("infinity-fabric")
    per_link, agg = 2 * f.pair_bandwidth / 1e9, 2 * f.bandwidth / 1e9
    links = f.links_per_gpu.value if f.links_per_gpu else float("nan")
    return Claim(
        "Infinity Fabric: 128 GB/s bidirectional per link, 896 GB/s aggregate",
        "AMD Instinct MI300X product page",
        "llmscale hw --compare infinity-fabric nvlink4",
        f"{per_link:g} GB/s per link x {links:g} links = {agg:g} GB/s per GPU (both directions)",
        "holds" if (per_link, agg) == (128, 896) else "does not hold here",
        "catalog figures; 896 GB/s is one GPU's 7 links busy at once, to its 7 peers: one GPU "
        "reaches one peer at 64 GB/s each way (the catalog's pair_GBps)",
    )


def optics(cat: Catalog, res: Results) -> list[Claim]:
    sw = cat.switch("cpo-800g-144")
    dens = sw.bandwidth_density_vs_pluggable
    cpo = Claim(
        "co-packaged optics give 6x bandwidth density",
        "IBM Research co-packaged optics announcement (December 2024)",
        "llmscale hw --sources",
        f"x{dens.value:g} (catalog: switch cpo-800g-144)" if dens else "not in the catalog",
        "holds with a caveat",
        "a research prototype's fibre density at the chip edge, not a product datasheet; "
        "llmscale's network cost uses CPO only to drop the switch-side transceivers",
    )
    oci, optic = cat.link("intel-oci"), cat.optic("ib-ndr")
    channels = oci.links_per_gpu.value if oci.links_per_gpu else float("nan")
    gbps = (oci.per_link_bandwidth or float("nan")) * 8 / 1e9
    pj = oci.energy_pJ_per_bit.value if oci.energy_pJ_per_bit else float("nan")
    plug = optic.energy_pJ_per_bit.value if optic.energy_pJ_per_bit else float("nan")
    watts = 2 * oci.bandwidth * 8 * pj * 1e-12
    chip = Claim(
        "an optical compute interconnect chiplet runs 64 channels at 32 Gb/s at 5 pJ/bit, a third "
        "of a pluggable transceiver's energy",
        "Intel OCI chiplet announcement (June 2024)",
        "llmscale hw --sources",
        f"{channels:g} x {gbps:g} Gb/s = {oci.bandwidth * 8 / 1e12:.3f} Tb/s each way; {pj:g} vs "
        f"{plug:g} pJ/bit (x{pj / plug:.2f}); {watts:.1f} W at full rate both ways",
        "holds"
        if (round(channels), round(gbps), round(3 * pj / plug, 3)) == (64, 32, 1)
        else "holds with a caveat",
        "Intel's figures for a demonstrated chiplet; no node in the catalog uses it yet",
    )
    return [cpo, chip]


# ---- precision --------------------------------------------------------------------------------


def mixed_precision_speed(cat: Catalog, res: Results) -> Claim:
    parts = []
    for name in ("a100-80g", "h100"):
        g = cat.gpu(name)
        parts.append(
            f"{name} bf16/fp32 x{g.peak_flops('bf16') / g.peak_flops('fp32'):.1f}, "
            f"bf16/tf32 x{g.peak_flops('bf16') / g.peak_flops('tf32'):.0f}"
        )
    tok = res.rows("precision", "tokens/s")
    if "fp32" in tok and "bf16" in tok:
        meas = (
            f"; this CPU: bf16 x{tok['bf16']['measured'] / tok['fp32']['measured']:.2f} fp32 "
            f"tokens/s ({res.when('precision')})"
        )
    else:
        meas = f"; this CPU: {NOT_MEASURED}"
    return Claim(
        "mixed precision speeds matmuls up to 8x over fp32",
        "NVIDIA mixed-precision training guide (Volta: 125 vs 15.7 TFLOP/s)",
        "llmscale hw; llmscale bench --what precision",
        "; ".join(parts) + meas,
        "holds with a caveat",
        "the datasheet ratio over plain fp32 is 15-16x on A100/H100 (8x on V100), but only 2x "
        "over TF32 tensor cores, which fp32 matmuls use when allowed; end to end a step gains "
        "far less (memory-bound ops, the optimizer)",
    )


def _bits(fmt: str, raw: int) -> float:
    return float(struct.unpack("<" + fmt, raw.to_bytes(struct.calcsize(fmt), "little"))[0])


def number_formats(cat: Catalog, res: Results) -> Claim:
    tiny = _bits("e", 0x0001)  # smallest fp16 subnormal
    big = _bits("e", 0x7BFF)  # largest finite fp16
    # bf16 is the top half of an fp32: its largest finite value is 0x7F7F0000 as fp32.
    bf16_max, fp32_max = _bits("f", 0x7F7F0000), _bits("f", 0x7F7FFFFF)
    bf16_min = _bits("f", 0x00800000)  # smallest normal: the same exponent field as fp32
    ok = tiny == 2.0**-24 and 2.0**15 <= big < 2.0**16
    return Claim(
        "fp16 has 5 exponent and 10 fraction bits and spans 2^-24 to 2^15; bf16 keeps fp32's range",
        "IEEE 754-2008 binary16; Google's bfloat16 format",
        "python: struct 'e' (binary16) and fp32 bit patterns",
        f"fp16 smallest subnormal 2^{math.log2(tiny):.0f}, largest {big:g} (top power of two "
        f"2^{math.floor(math.log2(big))}); bf16 largest {bf16_max:.3e} vs fp32 {fp32_max:.3e}, "
        f"smallest normal {bf16_min:.2e} in both",
        "holds" if ok else "does not hold here",
        "decoded from the bit patterns; fp16's largest finite value is 65504 (just under 2^16)",
    )


def fp16_underflow(cat: Catalog, res: Results) -> list[Claim]:
    t = res.table("precision", "fp16 gradient underflow")
    cmd = "llmscale bench --what precision (make results)"
    src = "arXiv:2209.04881 (as the article cites it)"
    if t is None:
        figure = NOT_MEASURED
        vanish = Claim(
            "31% of gradient values vanish in fp16 without loss scaling",
            src, cmd, figure, "holds with a caveat",
            "docs/results/results.json has no precision suite yet: run make results",
        )  # fmt: skip
        fix = Claim(
            "loss-scale factors of 8 to 32K fix it", "the article", cmd, figure,
            "holds with a caveat", "not measured yet: run make results",
        )  # fmt: skip
        return [vanish, fix]
    head, rows = t
    by = {r[0]: dict(zip(head, r, strict=True)) for r in rows}
    r0, r3, r15 = by["2^0"], by["2^3"], by["2^15"]
    when = res.when("precision")
    vanish = Claim(
        "31% of gradient values vanish in fp16 without loss scaling",
        src,
        cmd,
        f"{r0['cast: underflow']} cast to fp16 (runs {r0['cast: range']}), "
        f"{r0['fp16 backward: underflow']} with an fp16 backward ({when}; model small)",
        "does not hold here",
        f"the share depends on the gradients' magnitudes: llmscale's small model after 30 steps "
        f"loses {r0['cast: underflow']}-{r0['fp16 backward: underflow']}; a share near 31% needs "
        "a third of the gradients below fp16's 2^-24, as in deeper or wider models late in "
        "training, or in the activation gradients the source measured",
    )
    fix = Claim(
        "loss-scale factors of 8 to 32K fix it",
        "the article; dynamic loss scaling (Micikevicius et al. 2018, arXiv:1710.03740)",
        cmd,
        f"at 2^3: {r3['cast: underflow']} (fp16 backward {r3['fp16 backward: underflow']}); "
        f"at 2^15: {r15['cast: underflow']} / {r15['fp16 backward: underflow']}, overflow "
        f"{r15['fp16 backward: overflow (max)']} ({when})",
        "holds",
        "underflow falls tenfold by 2^3 and to zero by 2^15 with no overflow; the runtime's "
        "dynamic scaler (precision.initial_scale 32768, min_scale 8) spans the same range",
    )
    return [vanish, fix]


# ---- training techniques ----------------------------------------------------------------------


def accumulation(cat: Catalog, res: Results) -> list[Claim]:
    cmd = "llmscale bench --what accum (make results)"
    t = res.table("accum", "gradient equivalence")
    steps = res.rows("accum", "step time")
    when = res.when("accum")
    if t is None:
        same_fig = NOT_MEASURED
        same_verdict, same_why = "holds with a caveat", "not measured yet: run make results"
    else:
        rows = {r[0]: r for r in t[1]}
        pair = next((r for k, r in rows.items() if "k=4" in k), t[1][0])
        same_fig = (
            f"{pair[0]}: gradients differ by {pair[1]} (relative), loss by {pair[2]} ({when})"
        )
        same_verdict = "holds"
        same_why = "equal to fp32 rounding; here 4 x 8 vs 32 sequences (the small model), the "
        same_why += "same arithmetic as 4 x 64 vs 256"
    same = Claim(
        "accumulating 4 micro-batches of 64 trains like one batch of 256",
        "the article",
        cmd,
        same_fig,
        same_verdict,
        same_why,
    )
    if "b=32 k=1" in steps and "b=8 k=4" in steps:
        base = steps["b=32 k=1"]["measured"]
        k4 = steps["b=8 k=4"]["measured"]
        fig = (
            f"b=8 k=4 step {k4:.3f} s vs b=32 k=1 {base:.3f} s: {_pct(1 - k4 / base)} less ({when})"
        )
        verdict = "does not hold here"
    else:
        fig, verdict = NOT_MEASURED, "holds with a caveat"
    faster = Claim(
        "accumulation cuts training time by 31%",
        "the article",
        cmd,
        fig,
        verdict,
        "at a fixed global batch accumulation does the same FLOPs in smaller pieces, so it saves "
        "memory, not time; it saves time only against a baseline that syncs gradients across a "
        "slow network every micro-batch or cannot fit the batch at all",
    )
    return [same, faster]


def recompute(cat: Catalog, res: Results) -> Claim:
    model = get_preset("llama2-70b")
    seq = 4096
    extra = model.train_flops_per_token(seq, 1.0) / model.train_flops_per_token(seq) - 1
    full = res.rows("recompute", "step time / none").get("recompute=full")
    meas = (
        f"; measured x{full['measured']:.3f} step time ({res.when('recompute')}, small, CPU)"
        if full
        else f"; measured: {NOT_MEASURED}"
    )
    return Claim(
        "activation checkpointing costs about 33% more compute",
        "Chen et al. 2016 (arXiv:1604.06174); Korthikanti et al. 2022 (arXiv:2205.05198)",
        "llmscale bench --what recompute; llmscale plan --recompute full",
        f"full recompute: +{_pct(extra)} FLOPs (llama2-70b, seq {seq}){meas}",
        "holds",
        "one extra forward per three forward-equivalents; selective recompute costs a few "
        "percent instead",
    )


def zero_offload(cat: Catalog, res: Results) -> list[Claim]:
    model = get_preset("llama2-7b")

    def plan(offload: Offload) -> Plan:
        return Plan(
            model=model, seq_len=4096, micro_batch_size=1, global_batch_size=1,
            precision="bf16", offload=offload,
        )  # fmt: skip

    none = estimate_memory(plan("none")).worst
    off = estimate_memory(plan("optimizer")).worst
    psi = model.num_params()
    states = none.states / off.states
    total = none.total / off.total
    cut = Claim(
        "ZeRO-Offload gives a 4x reduction in per-device memory",
        "Ren et al. 2021, 'ZeRO-Offload' (arXiv:2101.06840)",
        "llmscale plan --model llama2-7b --gpu h100 --gpus 1 --seq 4096 --offload optimizer "
        "(vs --offload none)",
        f"llama2-7b, one GPU, seq 4096: states {none.states / psi:.0f} -> {off.states / psi:.0f} "
        f"B/param (x{states:.0f}); device total {none.total / GiB:.1f} -> {off.total / GiB:.1f} "
        f"GiB (x{total:.1f})",
        "holds with a caveat" if total >= 3 else "does not hold here",
        f"the model states shrink x{states:.0f} (fp32 Adam and gradients to the host); what the "
        f"whole device saves depends on the activations: x{total:.1f} here with one 4k sequence",
    )
    overlap = Claim(
        "LSP-Offload-style layer-wise transfers overlap CPU compute, GPU compute and both copy "
        "directions",
        "the article (LSP-Offload)",
        "llmscale train --optimizer.offload optimizer --optimizer.offload_overlap true; "
        "python bench/offload.py",
        f"{NOT_MEASURED}: docs/results/results.json has no offload suite (the transfer timeline "
        "is drawn by llmscale plot --timeline)",
        "holds with a caveat",
        "the runtime overlaps four lanes (compute, device-to-host copy, CPU Adam, host-to-device "
        "copy: offload/engine.py, docs/offload.md) and the planner hides offload_overlap of the "
        "transfers; the measured overlap (bench/offload.py) is not among make results' suites",
    )
    return [cut, overlap]


def interleaved(cat: Catalog, res: Results) -> Claim:
    pp, m = 4, 8
    gpipe = simulate("gpipe", pp, m).bubble_fraction
    f1b = simulate("1f1b", pp, m).bubble_fraction
    intl = simulate("interleaved_1f1b", pp, m, 2).bubble_fraction
    rows = res.rows("pipeline", "bubble (simulator)")
    meas_1f1b, meas_intl = rows.get("pp=4 1f1b m=8"), rows.get("pp=4 interleaved v=2 m=8")
    if meas_1f1b and meas_intl:
        meas = (
            f"; measured on 2 CPU cores: 1F1B {meas_1f1b['measured']:.1f}%, interleaved "
            f"{meas_intl['measured']:.1f}% ({res.when('pipeline')})"
        )
    else:
        meas = f"; measured: {NOT_MEASURED}"
    return Claim(
        "interleaved pipeline schedules reduce the bubble significantly against GPipe/1F1B",
        "Narayanan et al. 2021 (arXiv:2104.04473)",
        "llmscale schedule --schedule interleaved_1f1b --pp 4 --microbatches 8 --chunks 2",
        f"simulator, pp 4, 8 micro-batches: GPipe {_pct(gpipe)}, 1F1B {_pct(f1b)}, interleaved "
        f"v=2 {_pct(intl)}{meas}",
        "holds with a caveat",
        "the simulator's bubble falls from (p-1)/(m+p-1) to (p-1)/(v m+p-1); on this 2-core "
        "CPU the 4 ranks share cores and the extra p2p hops eat the gain, so it holds where "
        "each rank has its own device and p2p is cheap against a chunk's compute",
    )


def rail_only(cat: Catalog, res: Results) -> Claim:
    base = Cluster.of("h100", catalog=cat)
    sw = cat.switch_for_link(base.fabric.inter.name)
    saved, tiers = {}, {}
    for gpus in (256, 32768):
        tree = design("fat-tree", gpus, base, sw, cat)
        rail = design("rail-only", gpus, base, sw, cat)
        saved[gpus] = 1 - rail.cost_usd / tree.cost_usd
        tiers[gpus] = (tree.tiers, rail.tiers)
    xdr = Cluster.of("h100", nic="ib-xdr", catalog=cat)
    xsw = cat.switch_for_link("ib-xdr")
    big = 1 - (
        design("rail-only", 32768, xdr, xsw, cat).cost_usd
        / design("fat-tree", 32768, xdr, xsw, cat).cost_usd
    )
    a2a_tree = all_to_all_seconds(256e6, 256, base, "fat-tree")
    a2a_rail = all_to_all_seconds(256e6, 256, base, "rail-only")
    return Claim(
        "rail-only networks cut network cost without slowing LLM training",
        "Wang et al. 2023, 'How to Build Low-cost Networks for Large Language Models' "
        "(arXiv:2307.12169)",
        "llmscale network --gpus 256 --gpu h100; llmscale network --gpus 32768 --gpu h100",
        f"saves {_pct(saved[256])} of network cost at 256 H100s, {_pct(saved[32768])} at 32,768 "
        f"(64-port NDR switches), {_pct(big)} at 32,768 with {xsw.radix}-port XDR switches; "
        f"dense step time unchanged; 256 MB all-to-all x{a2a_rail / a2a_tree:.2f} at 256 GPUs",
        "holds with a caveat" if saved[256] > 0 else "does not hold here",
        f"rail-only saves a switch tier only while a rail needs fewer tiers than the whole "
        f"fat-tree: at 32,768 GPUs both need {tiers[32768][0]} (fat-tree) and {tiers[32768][1]} "
        "(each rail) tiers of radix-64 switches, so nothing is saved; higher-radix switches "
        "restore the saving. Dense-model traffic stays on its rail; MoE all-to-all pays NVLink "
        "forwarding",
    )


CHECKS: tuple[Callable[[Catalog, Results], Claim | list[Claim]], ...] = (
    h200_spec,
    h200_inference,
    mi325x,
    mixed_precision_speed,
    number_formats,
    fp16_underflow,
    accumulation,
    recompute,
    zero_offload,
    interleaved,
    nvlink5,
    infinity_fabric,
    optics,
    rail_only,
)


def check_claims(
    results: Path | None = DEFAULT_RESULTS, catalog: Catalog | None = None
) -> list[Claim]:
    """Every claim's row, in the article's order."""
    cat = catalog or default_catalog()
    res = Results(results)
    out: list[Claim] = []
    for check in CHECKS:
        got = check(cat, res)
        out += got if isinstance(got, list) else [got]
    return out


def to_json(rows: list[Claim]) -> dict[str, Any]:
    return {"article": ARTICLE, "claims": [asdict(r) for r in rows]}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(rows: list[Claim], results: Path | None = DEFAULT_RESULTS) -> str:
    """docs/claims.md: the table, generated by `llmscale claims --markdown docs/claims.md`."""
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    lines = [
        "# The article's claims, checked",
        "",
        "Generated by `llmscale claims --markdown docs/claims.md` (`make claims`; do not edit by "
        f'hand). The article is "{ARTICLE}"; each row names the primary source of its claim. '
        "Figures are computed from the hardware catalog (`llmscale hw`), the planner, the "
        "pipeline-schedule simulator and the serving model (`llmscale infer`, "
        "[docs/inference.md](inference.md)), or read from "
        f"`{results or DEFAULT_RESULTS}` (what `make results` measured, with when).",
        "",
        f"{len(rows)} claims: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".",
        "",
        "| # | claim | source | llmscale command | llmscale's figure | verdict | why |",
        "|---:|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        cells = [r.claim, r.source, f"`{r.command}`", r.figure, f"**{r.verdict}**", r.why]
        lines.append(f"| {i} | " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"
