"""Every claim of the article, checked: `llmscale claims`.

The article is "Distributed Solutions: Practical Approaches to Scale LLM Compute, Part 2"; each
row names the primary source behind a claim where there is one. A row's figures are computed on
the spot from the hardware catalog, the planner (memory, network), the pipeline-schedule
simulator or the serving model (plan/inference.py), or read from `docs/results/results.json`
(what `make results` measured on this project's machine, with the time it was measured). Nothing
here trains: the whole table takes well under a second.

Each row states its rule as data (`Rule`): the figures it computes, each next to the published
value with a comparison (`Check`: within a relative tolerance, at least, at most), and the
verdict follows from them alone:

- `does not hold here`: a claim's check fails on llmscale's figure;
- `not measured`: every figure the claim rests on is a measurement `make results` has not made;
- `restates its source`: the figure is the catalog's copy of the very source that states the
  claim (nothing independent to check it against); its arithmetic still has to agree;
- `holds with a caveat`: the claim's checks pass but a condition check fails or is unmeasured
  (the why says which, with its figure), or a measured figure lies within its run-to-run
  spread of the bar, so that another run could land on either side (`Check.in_noise`);
- `holds`: every check passes.

A row's `why` is its checks written out (figure, comparison, published value, outcome) followed
by a note on the mechanism, which never states an outcome.
"""

from __future__ import annotations

import datetime
import json
import math
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmscale.config import Offload
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import Catalog, GiB, default_catalog
from llmscale.model.config import get_preset
from llmscale.paths import RESULTS_JSON, SOURCE_ROOT
from llmscale.plan import inference
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import estimate_memory
from llmscale.plan.network import all_to_all_seconds, design
from llmscale.plan.plan import Plan
from llmscale.plan.schedule import simulate

HOLDS, CAVEAT, FAILS = "holds", "holds with a caveat", "does not hold here"
NOT_MEASURED_VERDICT, RESTATES = "not measured", "restates its source"
VERDICTS = (HOLDS, CAVEAT, FAILS, NOT_MEASURED_VERDICT, RESTATES)
ARTICLE = "Distributed Solutions: Practical Approaches to Scale LLM Compute, Part 2"
DEFAULT_RESULTS = RESULTS_JSON
NOT_MEASURED = "not measured yet"

Compare = Literal["within", "at least", "at most"]
YES_NO = "yes/no"  # a Check's fmt for a condition that is true (1) or false (0)


@dataclass(frozen=True)
class Check:
    """One figure llmscale computes, compared with the value the claim publishes (or implies).

    `within`: |figure / published - 1| <= tolerance; `at least` / `at most`: figure >= / <=
    published. A figure of None was not measured (results.json lacks it). `spread`: how far a
    measured figure moves from run to run (half the interquartile range of the samples behind
    it, bench/report.py `half_iqr`, carried through the arithmetic), in the figure's unit."""

    name: str
    figure: float | None
    published: float
    compare: Compare = "within"
    tolerance: float = 0.0
    fmt: str = "{:.3g}"
    spread: float | None = None

    def bars(self) -> tuple[float, ...]:
        """Where the outcome flips: the published value, or both ends of the tolerance."""
        if self.compare != "within":
            return (self.published,)
        if self.published == 0:
            return (-self.tolerance, self.tolerance)
        return (self.published * (1 - self.tolerance), self.published * (1 + self.tolerance))

    def in_noise(self) -> bool:
        """Whether a bar lies within the figure's run-to-run spread: the outcome is then one
        run's draw, not the mechanism's."""
        f, s = self.figure, self.spread
        if f is None or s is None or math.isnan(f) or self.fmt == YES_NO:
            return False
        return any(abs(f - bar) <= s for bar in self.bars())

    def passes(self) -> bool | None:
        f = self.figure
        if f is None or math.isnan(f):
            return None
        if self.compare == "at least":
            return f >= self.published
        if self.compare == "at most":
            return f <= self.published
        if self.published == 0:
            return abs(f) <= self.tolerance
        return abs(f / self.published - 1) <= self.tolerance + 1e-12

    def text(self) -> str:
        ok = self.passes()
        if ok is None:
            return f"{self.name}: {NOT_MEASURED}"
        if self.fmt == YES_NO:
            return f"{self.name}: {'yes' if self.figure else 'no'}"
        fig, pub = self.fmt.format(self.figure), self.fmt.format(self.published)
        if self.compare == "within":
            how = f"within {self.tolerance:.0%} of" if self.tolerance else "equal to"
        else:
            how = self.compare
        out = f"{self.name}: {fig} {'is' if ok else 'is not'} {how} {pub}"
        if self.in_noise():
            spread = self.fmt.format(self.spread).lstrip("x")
            out += f", within its run-to-run spread (+/- {spread}) of the bar"
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "figure": self.figure,
            "published": self.published,
            "compare": self.compare,
            "tolerance": self.tolerance,
            "spread": self.spread,
            "passes": self.passes(),
            "in_noise": self.in_noise(),
        }


@dataclass(frozen=True)
class Rule:
    """How a row's verdict follows from its figures: the claim's checks, the conditions under
    which it holds (a failing or unmeasured one is a caveat), and whether the figure only
    restates the claim's own source."""

    claim: tuple[Check, ...]
    conditions: tuple[Check, ...] = ()
    restates: bool = False

    def verdict(self) -> str:
        """A claim check failing outside its spread fails the claim; a check (of the claim or a
        condition) within its spread of the bar, passing or not, is a caveat (another run could
        flip it)."""
        got = [c.passes() for c in self.claim]
        if any(ok is False and not c.in_noise() for ok, c in zip(got, self.claim, strict=True)):
            return FAILS
        if all(ok is None for ok in got):
            return NOT_MEASURED_VERDICT
        if self.restates:
            return RESTATES
        if any(ok is None for ok in got) or any(c.in_noise() for c in self.claim):
            return CAVEAT
        if any(c.passes() is not True or c.in_noise() for c in self.conditions):
            return CAVEAT
        return HOLDS

    def why(self) -> str:
        """The checks written out: the caveats first when the verdict has one."""
        failing = [c for c in self.conditions if c.passes() is not True or c.in_noise()]
        parts = [c.text() for c in self.claim]
        if failing:
            parts = [f"caveat: {c.text()}" for c in failing] + parts
        parts += [c.text() for c in self.conditions if c not in failing]
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "claim": [c.as_dict() for c in self.claim],
            "conditions": [c.as_dict() for c in self.conditions],
            "restates": self.restates,
        }


@dataclass(frozen=True)
class Claim:
    """One row: the claim, its primary source, how llmscale checks it, its figure and its rule.
    The verdict and the why come from the rule (`note` says how the mechanism works, not what
    came out)."""

    claim: str
    source: str
    command: str
    figure: str
    rule: Rule
    note: str = ""
    verdict: str = field(init=False)
    why: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", self.rule.verdict())
        why = self.rule.why()
        object.__setattr__(self, "why", f"{why}. {self.note}" if self.note else why)
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
        """{config: row} of a suite's rows of one quantity (a `rows` entry may name a suite of
        its own, as finetune's timing rows do)."""
        s = self.suite(suite)
        return {r["config"]: r for r in (s or {}).get("rows", []) if r["quantity"] == quantity}

    def suite_rows(self, suite: str, quantity: str) -> dict[str, dict[str, Any]]:
        """Rows of one quantity whose own `suite` field is `suite`, in whichever suite's list."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.data.values():
            if isinstance(s, dict):
                for r in s.get("rows", []):
                    if r.get("suite") == suite and r.get("quantity") == quantity:
                        out[r["config"]] = r
        return out


# The packages whose code produces results.json's figures: the measurements (bench, train and
# what they run) and the predictions next to them (plan, stack, hardware).
PRODUCERS = ("bench", "train", "plan", "stack", "hardware", "model", "parallel", "offload")


def results_notice(path: Path | None) -> str | None:
    """A one-line notice when `path` is missing, or older than the last commit that changed the
    code producing it (git, when this is a checkout); None when it is current or cannot be told.
    A notice only: verdicts are computed from the file as it is."""
    if path is None or not path.is_file():
        return f"no results at {path}: measured rows say '{NOT_MEASURED}' (run make results)"
    try:
        stamps = [
            datetime.datetime.fromisoformat(s["measured_at"])
            for s in json.loads(path.read_text()).values()
            if isinstance(s, dict) and s.get("measured_at")
        ]
    except (OSError, ValueError, json.JSONDecodeError, TypeError):
        return None  # Results() says what is wrong with it
    if not stamps:
        return f"{path} has no measured_at: its age is unknown (run make results)"
    oldest = min(stamps)
    changed = _last_change(SOURCE_ROOT, [f"src/llmscale/{p}" for p in PRODUCERS])
    if changed is None or changed[0] <= oldest:
        return None
    return (
        f"{path} is older than the code that produced it: measured from {oldest.isoformat()}, "
        f"code changed {changed[0].isoformat()} ({changed[1]}); verdicts use it as it is "
        "(make results to refresh)"
    )


def _last_change(root: Path, paths: list[str]) -> tuple[datetime.datetime, str] | None:
    """The newest commit touching `paths` in the git checkout at `root`: (its time, hash)."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%cI %h", "--", *paths],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if len(out) != 2:
        return None
    return datetime.datetime.fromisoformat(out[0]), out[1]


def _spread(row: dict[str, Any]) -> float | None:
    """A results.json row's run-to-run spread (bench/report.py `Row.spread`), if recorded."""
    x = row.get("spread")
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _summed_spread(rows: tuple[dict[str, Any], ...], scale: float) -> float | None:
    """The spread of a sum or difference of rows' figures, divided by `scale`: their spreads
    added (a bound, not a quadrature: the runs share one host's load); None if one lacks it."""
    spreads = [_spread(r) for r in rows]
    if any(x is None for x in spreads):
        return None
    return sum(x for x in spreads if x is not None) / scale


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _share(cell: str) -> float:
    """'1.53%' -> 0.0153."""
    return float(cell.rstrip("%")) / 100


# ---- hardware ---------------------------------------------------------------------------------


def h200_spec(cat: Catalog, res: Results) -> Claim:
    h200, h100 = cat.gpu("h200"), cat.gpu("h100")
    ratio = h200.hbm_bandwidth / h100.hbm_bandwidth
    peaks = h200.peak_flops("bf16") / h100.peak_flops("bf16")
    return Claim(
        "H200: 141 GB HBM3e, 4.8 TB/s, 1.4x the H100's bandwidth",
        "NVIDIA H200 product page",
        "llmscale hw --compare h200 h100",
        f"{h200.memory_GiB.value:g} GB, {h200.hbm_TBps.value:g} TB/s; x{ratio:.2f} the H100 SXM's "
        f"{h100.hbm_TBps.value:g} TB/s; dense bf16 peak x{peaks:.2f} the H100's",
        Rule(
            (
                Check("H200 memory (GB)", h200.memory_GiB.value, 141),
                Check("H200 bandwidth (TB/s)", h200.hbm_TBps.value, 4.8),
                Check("bandwidth vs H100 SXM", ratio, 1.4, tolerance=0.05, fmt="x{:.2f}"),
            )
        ),
        "the catalog's datasheet figures; the ratio is against the H100 SXM's own datasheet",
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
    x = "x{:.2f}"
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
        Rule(
            (Check("predicted H200/H100 at NVIDIA's batches", r_nv, 1.9, tolerance=0.15, fmt=x),),
            (
                Check("at the largest batch each fits", r_fit, 1.9, tolerance=0.15, fmt=x),
                Check("MLPerf-shaped, 8 GPUs", r_ml, 1.9, tolerance=0.15, fmt=x),
            ),
        ),
        "the ratio comes from the batch the larger HBM allows (decode reads the weights once per "
        f"step for the whole batch) plus x{cat.gpu('h200').hbm_bandwidth / cat.gpu('h100').hbm_bandwidth:.2f} "
        "bandwidth; the largest batch keeps a 10% memory reserve",
    )
    share = nv200.prefill_s / nv200.batch_seconds
    regime = Claim(
        "there the H200 is compute-bound rather than memory-bound",
        "the article, on NVIDIA's MLPerf Inference v4.0 result",
        "llmscale infer --model llama2-70b --gpu h200 --gpus 1 --input-len 2048 --output-len 128 "
        "--precision fp8 --batch 32",
        f"prefill {nv200.prefill.bound} ({nv200.prefill.intensity:,.0f} FLOP/B vs ridge "
        f"{nv200.prefill.ridge:,.0f}), {_pct(share)} of the time; decode {nv200.decode.bound} "
        f"({nv200.decode.intensity:,.0f} FLOP/B vs ridge {nv200.decode.ridge:,.0f})",
        Rule(
            (
                Check(
                    "share of the time in compute-bound prefill",
                    share,
                    0.5,
                    "at least",
                    fmt="{:.1%}",
                ),
            ),
            (
                Check(
                    "decode FLOP/B over the ridge point",
                    nv200.decode.intensity / nv200.decode.ridge,
                    1,
                    "at least",
                    fmt="x{:.2f}",
                ),
            ),
        ),  # fmt: skip
        "a phase is compute-bound when its FLOP per byte read exceeds the GPU's ridge point; the "
        "H200's extra bandwidth helps only the memory-bound phase",
    )
    return [speed, regime]


def mi325x(cat: Catalog, res: Results) -> Claim:
    g = cat.gpu("mi325x")
    n = cat.node_for_gpu("mi325x").gpus_per_node
    mem, bw = g.memory_GiB.value, g.hbm_TBps.value
    return Claim(
        "MI325X: 256 GB HBM3E at 6 TB/s; eight of them 2 TB and 48 TB/s",
        "AMD Instinct MI325X product page",
        "llmscale hw",
        f"{mem:g} GB, {bw:g} TB/s; x{n}: {n * mem:,.0f} GB, {n * bw:g} TB/s",
        Rule(
            (
                Check("memory (GB)", mem, 256),
                Check("bandwidth (TB/s)", bw, 6.0),
                Check("the platform's memory (TB)", n * mem / 1000, 2.0, tolerance=0.05),
                Check("the platform's bandwidth (TB/s)", n * bw, 48.0),
            )
        ),
        f"the catalog's datasheet figures times the {n}-GPU platform (nodes.toml)",
    )


def nvlink5(cat: Catalog, res: Results) -> list[Claim]:
    nv, pcie = cat.link("nvlink5"), cat.link("pcie5")
    links = nv.links_per_gpu.value if nv.links_per_gpu else float("nan")
    per_link = 2 * (nv.per_link_bandwidth or float("nan")) / 1e9
    total = 2 * nv.bandwidth / 1e12
    ratio = nv.bandwidth / pcie.bandwidth
    link = Claim(
        "NVLink 5: 100 GB/s per link, 18 links, 1.8 TB/s per GPU, 14x PCIe Gen5",
        "NVIDIA NVLink page",
        "llmscale hw --compare nvlink5 pcie5",
        f"{per_link:g} GB/s x {links:g} links = {total:g} TB/s (both directions); x{ratio:.1f} a "
        "PCIe Gen5 x16 slot",
        Rule(
            (
                Check("per link (GB/s)", per_link, 100, tolerance=0.01),
                Check("links", links, 18),
                Check("per GPU (TB/s)", total, 1.8, tolerance=0.01),
                Check("vs PCIe Gen5 x16 (PCI-SIG)", ratio, 14, tolerance=0.05, fmt="x{:.1f}"),
            )
        ),
        "catalog figures, both directions; the PCIe slot's rate is PCI-SIG's (63 GB/s each way)",
    )
    nvl = cat.node("nvl576")
    g = cat.gpu(nvl.gpu)
    agg = nvl.gpus_per_node * 2 * nv.bandwidth / 1e15
    # The catalog's memory sizes are the datasheets' figures (decimal GB): NVIDIA's 240 TB is
    # decimal too.
    fast_tb = (nvl.gpus_per_node * g.memory_GiB.value + nvl.host_memory_GiB.value) / 1000
    system = Claim(
        "an NVLink Switch System joins 576 GPUs with 1 PB/s in total and 240 TB of fast memory",
        "NVIDIA NVLink page; DGX SuperPOD with DGX GB200 announcement (GTC 2024)",
        "llmscale hw",
        f"{nvl.gpus_per_node} GPUs x {2 * nv.bandwidth / 1e12:g} TB/s = {agg:.2f} PB/s; HBM + "
        f"Grace LPDDR5X = {fast_tb:,.0f} TB (datasheet GB, decimal)",
        Rule(
            (
                Check("GPUs", nvl.gpus_per_node, 576),
                Check("NVLink in total (PB/s)", agg, 1.0, "at least", fmt="{:.2f}"),
                Check("fast memory (TB)", fast_tb, 240, tolerance=0.05, fmt="{:,.0f}"),
            )
        ),
        "sums of the per-GPU datasheet figures; the planner treats the 576 GPUs as one scale-up "
        "domain with NVL72's per-GPU link, not a two-level switch tree",
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
        Rule(
            (
                Check("per link (GB/s)", per_link, 128),
                Check("aggregate (GB/s)", agg, 896),
                Check("links x per link (GB/s)", links * per_link, 896),
            )
        ),
        "896 GB/s is one GPU's 7 links busy at once, to its 7 peers: one GPU reaches one peer at "
        "the catalog's pair_GBps each way",
    )


def optics(cat: Catalog, res: Results) -> list[Claim]:
    sw = cat.switch("cpo-800g-144")
    dens = sw.bandwidth_density_vs_pluggable
    cpo = Claim(
        "co-packaged optics give 6x bandwidth density",
        "IBM Research co-packaged optics announcement (December 2024)",
        "llmscale hw --sources",
        f"x{dens.value:g} (catalog: switch cpo-800g-144, from IBM's announcement)"
        if dens
        else "not in the catalog",
        Rule(
            (Check("catalog density", dens.value if dens else None, 6, fmt="x{:g}"),),
            restates=True,
        ),
        "the catalog copies IBM's own figure (a research prototype's fibre density at the chip "
        "edge); nothing in llmscale measures density: its network cost uses CPO only to drop "
        "the switch-side transceivers",
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
        Rule(
            (
                Check("channels", channels, 64),
                Check("Gb/s per channel", gbps, 32),
                Check("pJ/bit", pj, 5),
                Check("vs the pluggable optic", pj / plug, 1 / 3, tolerance=0.05, fmt="{:.3f}"),
            ),
            restates=True,
        ),
        "the catalog's figures (links.toml intel-oci; the pluggable optic's 15 pJ/bit, "
        "network.toml pluggable-energy) are Intel's announcement's; no node in the catalog uses "
        "the chiplet",
    )
    return [cpo, chip]


# ---- precision --------------------------------------------------------------------------------


def mixed_precision_speed(cat: Catalog, res: Results) -> Claim:
    parts, over_fp32 = [], []
    for name in ("a100-80g", "h100"):
        g = cat.gpu(name)
        over_fp32.append(g.peak_flops("bf16") / g.peak_flops("fp32"))
        parts.append(
            f"{name} bf16/fp32 x{over_fp32[-1]:.1f}, "
            f"bf16/tf32 x{g.peak_flops('bf16') / g.peak_flops('tf32'):.0f}"
        )
    tok = res.rows("precision", "tokens/s")
    measured = None
    if "fp32" in tok and "bf16" in tok:
        measured = tok["bf16"]["measured"] / tok["fp32"]["measured"]
        meas = f"; this CPU: bf16 x{measured:.2f} fp32 tokens/s ({res.when('precision')})"
    else:
        meas = f"; this CPU: {NOT_MEASURED}"
    return Claim(
        "mixed precision speeds matmuls up to 8x over fp32",
        "NVIDIA mixed-precision training guide (Volta: 125 vs 15.7 TFLOP/s)",
        "llmscale hw; llmscale bench --what precision",
        "; ".join(parts) + meas,
        Rule(
            (
                Check(
                    "datasheet bf16/fp32 matmul peak, least of A100/H100",
                    min(over_fp32),
                    8,
                    "at least",
                    fmt="x{:.1f}",
                ),
            ),
            (
                Check(
                    "a whole training step, bf16/fp32 tokens/s on this CPU",
                    measured,
                    8,
                    "at least",
                    fmt="x{:.2f}",
                ),
            ),
        ),  # fmt: skip
        "the datasheet ratio is over plain fp32; fp32 matmuls on tensor cores use TF32 when "
        "allowed, and a step also runs memory-bound ops and the optimizer",
    )


def _bits(fmt: str, raw: int) -> float:
    return float(struct.unpack("<" + fmt, raw.to_bytes(struct.calcsize(fmt), "little"))[0])


def number_formats(cat: Catalog, res: Results) -> Claim:
    tiny = _bits("e", 0x0001)  # smallest fp16 subnormal
    big = _bits("e", 0x7BFF)  # largest finite fp16
    # bf16 is the top half of an fp32: its largest finite value is 0x7F7F0000 as fp32.
    bf16_max, fp32_max = _bits("f", 0x7F7F0000), _bits("f", 0x7F7FFFFF)
    bf16_min = _bits("f", 0x00800000)  # smallest normal: the same exponent field as fp32
    # fp16's field widths: the exponent is the bits of 0x7C00 (infinity), the fraction those of
    # 0x03FF (the largest subnormal's).
    exp_bits, frac_bits = bin(0x7C00).count("1"), bin(0x03FF).count("1")
    return Claim(
        "fp16 has 5 exponent and 10 fraction bits and spans 2^-24 to 2^15; bf16 keeps fp32's range",
        "IEEE 754-2008 binary16; Google's bfloat16 format",
        "python: struct 'e' (binary16) and fp32 bit patterns",
        f"fp16 smallest subnormal 2^{math.log2(tiny):.0f}, largest {big:g} (top power of two "
        f"2^{math.floor(math.log2(big))}); bf16 largest {bf16_max:.3e} vs fp32 {fp32_max:.3e}, "
        f"smallest normal {bf16_min:.2e} in both",
        Rule(
            (
                Check("fp16 exponent bits", exp_bits, 5),
                Check("fp16 fraction bits", frac_bits, 10),
                Check("log2 of fp16's smallest subnormal", math.log2(tiny), -24),
                Check("fp16's top power of two", math.floor(math.log2(big)), 15),
                Check("bf16's largest / fp32's", bf16_max / fp32_max, 1, tolerance=0.01),
            )
        ),
        "decoded from the bit patterns by Python's own binary16 and binary32 codecs",
    )


def fp16_underflow(cat: Catalog, res: Results) -> list[Claim]:
    t = res.table("precision", "fp16 gradient underflow")
    cmd = "llmscale bench --what precision (make results)"
    src = "arXiv:2209.04881 (as the article cites it)"
    by: dict[str, dict[str, str]] = {}
    if t is not None:
        head, rows = t
        by = {r[0]: dict(zip(head, r, strict=True)) for r in rows}
    when = res.when("precision")

    def share(scale: str, col: str) -> float | None:
        return _share(by[scale][col]) if scale in by else None

    cast0, back0 = share("2^0", "cast: underflow"), share("2^0", "fp16 backward: underflow")
    if cast0 is None:
        fig0 = NOT_MEASURED
    else:
        fig0 = (
            f"{by['2^0']['cast: underflow']} cast to fp16 (runs {by['2^0']['cast: range']}), "
            f"{by['2^0']['fp16 backward: underflow']} with an fp16 backward ({when}; model small)"
        )
    vanish = Claim(
        "31% of gradient values vanish in fp16 without loss scaling",
        src,
        cmd,
        fig0,
        Rule(
            (
                Check(
                    "gradients lost cast to fp16, unscaled",
                    cast0,
                    0.31,
                    tolerance=0.3,
                    fmt="{:.2%}",
                ),
                Check("with an fp16 backward, unscaled", back0, 0.31, tolerance=0.3, fmt="{:.2%}"),
            )
        ),  # fmt: skip
        "the share depends on the gradients' magnitudes: it counts the small model's non-zero "
        "fp32 gradients below fp16's 2^-24 after 30 steps; deeper or wider models late in "
        "training, or activation gradients as the source measured, have more small values",
    )
    # The claim: some scale in 8..32K brings underflow down to a tenth of the unscaled share
    # with no overflow, and 2^15 itself does not overflow.
    lo, hi = 3, 15
    ok_scales = [
        k
        for k in range(lo, hi + 1)
        if f"2^{k}" in by
        and cast0 is not None
        and _share(by[f"2^{k}"]["fp16 backward: underflow"]) <= max(cast0, back0 or 0) / 10
        and _share(by[f"2^{k}"]["fp16 backward: overflow (max)"]) == 0
    ]
    if t is None:
        fig_fix = NOT_MEASURED
    else:
        fig_fix = (
            "; ".join(
                f"at {s}: {by[s]['cast: underflow']} (fp16 backward {by[s]['fp16 backward: underflow']}"
                f", overflow {by[s]['fp16 backward: overflow (max)']})"
                for s in (f"2^{lo}", f"2^{hi}")
                if s in by
            )
            + f" ({when})"
        )
    fix = Claim(
        "loss-scale factors of 8 to 32K fix it",
        "the article; dynamic loss scaling (Micikevicius et al. 2018, arXiv:1710.03740)",
        cmd,
        fig_fix,
        Rule(
            (
                Check(
                    f"scales in 2^{lo}..2^{hi} with underflow under a tenth of the unscaled "
                    "share and no overflow",
                    None if t is None else len(ok_scales),
                    1,
                    "at least",
                    fmt="{:g}",
                ),
            ),
            (
                Check(
                    f"of the {hi - lo + 1} scales, those that do",
                    None if t is None else len(ok_scales),
                    hi - lo + 1,
                    "at least",
                    fmt="{:g}",
                ),
                Check(
                    "overflow at 2^15",
                    share("2^15", "fp16 backward: overflow (max)"),
                    0,
                    "at most",
                    fmt="{:.3%}",
                ),
            ),
        ),  # fmt: skip
        "the runtime's dynamic scaler (precision.initial_scale 32768, min_scale 8) spans the "
        "same range, halving on overflow",
    )
    return [vanish, fix]


# ---- training techniques ----------------------------------------------------------------------


def accumulation(cat: Catalog, res: Results) -> list[Claim]:
    cmd = "llmscale bench --what accum (make results)"
    t = res.table("accum", "gradient equivalence")
    steps = res.rows("accum", "step time")
    when = res.when("accum")
    grad: float | None = None
    if t is None:
        same_fig = NOT_MEASURED
    else:
        rows = {r[0]: r for r in t[1]}
        pair = next((r for k, r in rows.items() if "k=4" in k), t[1][0])
        grad = float(pair[1])
        same_fig = (
            f"{pair[0]}: gradients differ by {pair[1]} (relative), loss by {pair[2]} ({when})"
        )
    same = Claim(
        "accumulating 4 micro-batches of 64 trains like one batch of 256",
        "the article",
        cmd,
        same_fig,
        Rule(
            (Check("largest relative gradient difference", grad, 1e-5, "at most", fmt="{:.2e}"),)
        ),  # fmt: skip
        "fp32 rounding alone differs by about 1e-7 per sum; here 4 x 8 vs 32 sequences (the "
        "small model), the same arithmetic as 4 x 64 vs 256",
    )
    cut: float | None = None
    if "b=32 k=1" in steps and "b=8 k=4" in steps:
        base = steps["b=32 k=1"]["measured"]
        k4 = steps["b=8 k=4"]["measured"]
        cut = 1 - k4 / base
        less = f"{_pct(cut)} less" if cut >= 0 else f"{_pct(-cut)} more"
        fig = f"b=8 k=4 step {k4:.3f} s vs b=32 k=1 {base:.3f} s: {less} ({when})"
    else:
        fig = NOT_MEASURED
    faster = Claim(
        "accumulation cuts training time by 31%",
        "the article",
        cmd,
        fig,
        Rule(
            (Check("time cut, b=8 k=4 vs b=32 k=1", cut, 0.31, tolerance=0.3, fmt="{:.1%}"),)
        ),  # fmt: skip
        "at a fixed global batch accumulation does the same FLOPs in smaller pieces and holds a "
        "quarter of the activations; the comparison is one process, so no per-micro-batch "
        "gradient sync is saved",
    )
    return [same, faster]


def recompute(cat: Catalog, res: Results) -> Claim:
    model = get_preset("llama2-70b")
    seq = 4096
    extra = model.train_flops_per_token(seq, 1.0) / model.train_flops_per_token(seq) - 1
    full = res.rows("recompute", "step time / none").get("recompute=full")
    measured = full["measured"] - 1 if full else None
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
        Rule(
            (
                Check("extra FLOPs of full recompute", extra, 0.33, tolerance=0.1, fmt="{:.1%}"),
                Check("extra step time measured", measured, 0.33, tolerance=0.3, fmt="{:.1%}"),
            )
        ),
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
        Rule(
            (
                Check(
                    "model states, none / optimizer offload", states, 4, "at least", fmt="x{:.1f}"
                ),
            ),
            (
                Check(
                    "whole device, with one 4k sequence's activations",
                    total,
                    4,
                    "at least",
                    fmt="x{:.1f}",
                ),
            ),
        ),  # fmt: skip
        "fp32 Adam moments, master weights and gradients move to the host; activations stay",
    )
    # The overlap: with the transfers hidden, a slower link costs the step nothing. From the
    # finetune suite's simulated links: the share of lsp's transfer time (bytes / link rate)
    # that did not show up in its step time.
    t_rows = res.suite_rows("finetune-time", "step time (median)")
    moved = res.rows("finetune", "bytes moved per step").get("lsp")
    hidden: float | None = None
    hidden_spread: float | None = None
    # A CPU host has no separate device: "GPU compute" and the copies share its cores.
    on_cpu = any("on cpu" in n for n in (res.suite("finetune") or {}).get("notes", []))
    if moved and "lsp @ native" in t_rows and "lsp @ 0.1 GB/s" in t_rows:
        slow, native = t_rows["lsp @ 0.1 GB/s"], t_rows["lsp @ native"]
        transfer = moved["measured"] / 0.1e9
        slower = slow["measured"] - native["measured"]
        hidden = 1 - max(slower, 0.0) / transfer
        hidden_spread = _summed_spread((slow, native), transfer)
        fig = (
            f"lsp at a simulated 0.1 GB/s: {moved['measured'] / 1e6:.2f} MB a step = "
            f"{1e3 * transfer:.0f} ms of transfers, step {1e3 * slower:+.0f} ms vs native: "
            f"{_pct(hidden)} hidden ({res.when('finetune')}, small model, CPU host)"
        )
    else:
        fig = f"{NOT_MEASURED} (llmscale bench --what finetune)"
    overlap = Claim(
        "LSP-Offload-style layer-wise transfers overlap CPU compute, GPU compute and both copy "
        "directions",
        "the article (LSP-Offload)",
        "llmscale bench --what finetune (make results); llmscale plot --timeline",
        fig,
        Rule(
            (
                Check(
                    "share of the transfer time hidden",
                    hidden,
                    0.8,
                    "at least",
                    fmt="{:.1%}",
                    spread=hidden_spread,
                ),
            ),
            (
                Check(
                    "measured on an accelerator rather than a CPU host",
                    None if hidden is None else float(not on_cpu),
                    1,
                    fmt=YES_NO,
                ),
            ),
        ),  # fmt: skip
        "the runtime overlaps four lanes (compute, device-to-host copy, CPU Adam, host-to-device "
        "copy: offload/engine.py, docs/offload.md); on a CPU host the link is simulated (each "
        "copy sleeps as long as over the link)",
    )
    return [cut, overlap]


def interleaved(cat: Catalog, res: Results) -> Claim:
    pp, m = 4, 8
    gpipe = simulate("gpipe", pp, m).bubble_fraction
    f1b = simulate("1f1b", pp, m).bubble_fraction
    intl = simulate("interleaved_1f1b", pp, m, 2).bubble_fraction
    rows = res.rows("pipeline", "bubble (simulator)")
    meas_1f1b, meas_intl = rows.get("pp=4 1f1b m=8"), rows.get("pp=4 interleaved v=2 m=8")
    measured: float | None = None
    spread: float | None = None
    if meas_1f1b and meas_intl:
        measured = meas_intl["measured"] / meas_1f1b["measured"]
        s_intl, s_1f1b = _spread(meas_intl), _spread(meas_1f1b)
        if s_intl is not None and s_1f1b is not None:  # relative spreads add under a ratio
            spread = measured * (s_intl / meas_intl["measured"] + s_1f1b / meas_1f1b["measured"])
        meas = (
            f"; measured on 2 CPU cores: 1F1B {meas_1f1b['measured']:.1f}%, interleaved "
            f"{meas_intl['measured']:.1f}% ({res.when('pipeline')})"
        )
    else:
        meas = f"; measured: {NOT_MEASURED}"
    # "Significantly": at most four fifths of the bubble it replaces.
    x = "x{:.2f}"
    return Claim(
        "interleaved pipeline schedules reduce the bubble significantly against GPipe/1F1B",
        "Narayanan et al. 2021 (arXiv:2104.04473)",
        "llmscale schedule --schedule interleaved_1f1b --pp 4 --microbatches 8 --chunks 2",
        f"simulator, pp 4, 8 micro-batches: GPipe {_pct(gpipe)}, 1F1B {_pct(f1b)}, interleaved "
        f"v=2 {_pct(intl)}{meas}",
        Rule(
            (
                Check("simulated bubble, interleaved / 1F1B", intl / f1b, 0.8, "at most", fmt=x),
                Check(
                    "measured bubble, interleaved / 1F1B",
                    measured,
                    1.0,
                    "at most",
                    fmt=x,
                    spread=spread,
                ),
            ),
            (
                Check(
                    "measured reduction significant: interleaved / 1F1B",
                    measured,
                    0.8,
                    "at most",
                    fmt=x,
                    spread=spread,
                ),
            ),
        ),  # fmt: skip
        "the simulator's bubble falls from (p-1)/(m+p-1) to (p-1)/(v m+p-1); the measured one "
        "also pays each extra p2p hop, and on this 2-core CPU the 4 ranks share cores",
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
    a2a = all_to_all_seconds(256e6, 256, base, "rail-only") / all_to_all_seconds(
        256e6, 256, base, "fat-tree"
    )
    x = "x{:.2f}"
    return Claim(
        "rail-only networks cut network cost without slowing LLM training",
        "Wang et al. 2023, 'How to Build Low-cost Networks for Large Language Models' "
        "(arXiv:2307.12169)",
        "llmscale network --gpus 256 --gpu h100; llmscale network --gpus 32768 --gpu h100",
        f"saves {_pct(saved[256])} of network cost at 256 H100s, {_pct(saved[32768])} at 32,768 "
        f"(radix-{sw.radix} NDR switches: {tiers[32768][0]} fat-tree tiers, {tiers[32768][1]} "
        f"per rail), {_pct(big)} at 32,768 with {xsw.radix}-port XDR switches; 256 MB all-to-all "
        f"x{a2a:.2f} at 256 GPUs",
        Rule(
            (Check("cost saved at 256 GPUs", saved[256], 0, "at least", fmt="{:.1%}"),),
            (
                Check(
                    f"cost saved at 32,768 GPUs, radix {sw.radix}",
                    saved[32768],
                    0.01,
                    "at least",
                    fmt="{:.1%}",
                ),
                Check("all-to-all (MoE) time, rail-only / fat-tree", a2a, 1.0, "at most", fmt=x),
            ),
        ),  # fmt: skip
        "rail-only saves a switch tier only while a rail needs fewer tiers than the whole "
        "fat-tree; the planner takes a dense model's traffic as same-rail (plan/network.py), so "
        "it prices dense steps alike on both (an assumption, not a check) and charges cross-rail "
        "all-to-all an NVLink hop",
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
    keys = ("claim", "source", "command", "figure", "verdict", "why")
    return {
        "article": ARTICLE,
        "claims": [{**{k: getattr(r, k) for k in keys}, "rule": r.rule.as_dict()} for r in rows],
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(rows: list[Claim], results: Path | str = "docs/results/results.json") -> str:
    """docs/claims.md: the table, generated by `llmscale claims --markdown docs/claims.md`."""
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    lines = [
        "# The article's claims, checked",
        "",
        "Generated by `llmscale claims --markdown docs/claims.md` (`make docs`; do not edit by "
        f'hand). The article is "{ARTICLE}"; each row names the primary source of its claim. '
        "Figures are computed from the hardware catalog (`llmscale hw`), the planner, the "
        "pipeline-schedule simulator and the serving model (`llmscale infer`, "
        "[docs/inference.md](inference.md)), or read from "
        f"`{results}` (what `make results` measured, with when). Each verdict follows from "
        "the row's checks, written out in its why: `holds` when all pass, `holds with a caveat` "
        "when a condition fails or is unmeasured or a measured figure lies within its "
        "run-to-run spread of the bar (where results.json records one), `does not hold here` "
        "when a check of the claim fails beyond that spread, `not measured` when its figures "
        "are all unmeasured, `restates its source` when the figure is the catalog's copy of the "
        "claim's own source.",
        "",
        f"{len(rows)} claims: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n) + ".",
        "",
        "| # | claim | source | llmscale command | llmscale's figure | verdict | why |",
        "|---:|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        cells = [r.claim, r.source, f"`{r.command}`", r.figure, f"**{r.verdict}**", r.why]
        lines.append(f"| {i} | " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"
