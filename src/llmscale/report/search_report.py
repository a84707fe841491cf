"""What `llmscale plan` prints: the question, the search's counts, the table and how to read it."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from llmscale.config import (
    LOOP_MULTI_CHUNK_SCHEDULES,
    OFFLOAD_MODES,
    PP_SCHEDULES,
    RECOMPUTE_MODES,
    V_SCHEDULES,
    ZERO_STAGES,
    Float8Recipe,
    Precision,
    load_model,
)
from llmscale.errors import ConfigError, UsageError
from llmscale.model.config import ModelConfig, pp_layer_counts_problem, pp_layers_problem
from llmscale.plan import memory as mem
from llmscale.plan.cluster import Cluster
from llmscale.plan.search import DEFAULT_SPACE, SearchResult, SearchSpace, search, tight_note
from llmscale.plan.time import time_params
from llmscale.report import report
from llmscale.stack import LLMSCALE, fitted_note, get_stack, layout_problem
from llmscale.stack.options import in_effect, options_text, with_options

# How to read the table's memory columns; {unit}: the table's (report.memory_unit), {over}: the
# stack's allocator overhead (`Stack.allocator_overhead`).
MEMORY_LEGEND = (
    "memory columns are the fullest GPU, {unit}: states = params + grads + optimizer;\n"
    "working = bf16 weight copies or FSDP-unsharded params; transient includes the allocator's "
    "{over}{marks}"
)
NARROW_LEGEND = (
    "{unit}: the fullest GPU, with the allocator's {over}{marks}; --wide shows its parts"
)


def memory_legend(result: SearchResult, wide: bool) -> str:
    """The legend under `report.search_table(result, wide)`, in its unit."""
    unit, _ = report.memory_unit(result)
    over = f"{100 * result.stack.allocator_overhead.value:g}%"
    marks = "".join(
        mark
        for shown, mark in (
            (any(not c.fits for c in result.shown), "; ! = does not fit"),
            (any(c.tight for c in result.shown), "; ~ = fits tightly (below)"),
        )
        if shown
    )
    return (MEMORY_LEGEND if wide else NARROW_LEGEND).format(unit=unit, over=over, marks=marks)


class PlanReport(NamedTuple):
    """A search and the inputs that asked for it (as `--json` prints them)."""

    result: SearchResult
    inputs: dict[str, Any]

    def json(self) -> dict[str, Any]:
        return report.search_json(self.result, self.inputs)

    def headline(self) -> str:
        """Two lines (each under 100 columns for the catalog's names): the question, the counts."""
        i, res = self.inputs, self.result
        fixed = ", ".join(f"{k}={v}" for k, v in i.get("fixed", {}).items())
        f8 = i.get("float8_recipe", "tensorwise")
        recipe = f" {f8}" if i["precision"] == "fp8" and f8 != "tensorwise" else ""
        lines = [
            f"{i['model']} on {i['gpus']} x {res.cluster.gpu.display} ({i['node']}, {i['nic']})",
            f"seq {i['seq']}, global batch {i['global_batch']}, {i['precision']}{recipe}: "
            f"{res.evaluated:,} plans costed, {res.feasible:,} fit, {res.seconds:.2f} s",
        ]
        if fixed:
            lines += textwrap.wrap("fixed: " + fixed, 100, subsequent_indent="       ")
        settings = options_text(i.get("stack_settings", {}))
        if settings:
            lines.append(f"{i['stack']} settings: {settings}")
        fitted = fitted_note(res.stack, res.cluster.gpu.name, i["precision"], f8)
        if fitted:
            lines += textwrap.wrap(fitted, 100, subsequent_indent="       ", break_on_hyphens=False)
        return "\n".join(lines)

    def unfit_lines(self) -> list[str]:
        """Why each shown plan does not fit, and what fitting tightly means for each that
        does (empty when they fit with room)."""
        res = self.result
        return [
            f"#{n}! {c.why}" if not c.fits else f"#{n}~ {tight_note(c.memory, res.cluster)}"
            for n, c in enumerate(res.shown, 1)
            if not c.fits or c.tight
        ]

    def best_command(self, width: int = 100) -> str:
        """The `llmscale train` overrides of the fastest plan (there must be one), as a shell
        command continued over lines of at most `width` characters. Under another `--stack`
        the plan was costed as that software runs it, so the line says so: the command runs
        the layout with llmscale, whose own figures `--stack llmscale` gives."""
        stack = self.inputs.get("stack", "llmscale")
        head = (
            "best"
            if stack == "llmscale"
            else f"best layout (costed as {stack} runs it); in llmscale"
        )
        plan = self.result.candidates[0].plan
        if plan.precision not in LLMSCALE.precisions:  # nvfp4: llmscale's nearest is fp8
            head += f" (which trains no {plan.precision}: fp8)"
            plan = replace(plan, precision="fp8")
        elif plan.fp8_matmuls and plan.float8_recipe not in LLMSCALE.float8_recipes:
            head += f" (which trains no {plan.float8_recipe}: tensorwise)"  # mxfp8
            plan = replace(plan, float8_recipe="tensorwise")
        lines, line = [], f"{head}: llmscale train"
        for part in plan.overrides():
            if len(line) + len(part) + 3 > width:
                lines.append(line + " \\")
                line = "     "
            line += " " + part
        return "\n".join([*lines, line])


def plan_report(
    model: str | ModelConfig,
    gpus: int,
    gpu: str,
    seq: int = 4096,
    global_batch: int = 1024,
    precision: Precision = "bf16",
    top: int = 10,
    node: str | None = None,
    nic: str | None = None,
    space: SearchSpace = DEFAULT_SPACE,
    fixed: dict[str, Any] | None = None,
    stack: str = "llmscale",
    compiled: bool = False,
    float8_recipe: Float8Recipe = "tensorwise",
    stack_options: Mapping[str, bool | str] | None = None,
) -> PlanReport:
    """Search the layouts of `model` (a shape, or a spec `config.load_model` reads: preset
    NAME, FILE.toml or a Hugging Face DIR) on `gpus` x `gpu` within `space`; keep the `top`
    fastest that fit (or the closest, flagged). `fixed` names the flags that narrowed `space`;
    `stack` the training stack whose kernels, gathers and overlaps are modelled; `compiled`
    its blocks under torch.compile (fused element-wise kernels); `stack_options` the stack's
    own settings given (`llmscale.stack.options`: name -> on or off)."""
    cfg = model if isinstance(model, ModelConfig) else load_model(model)
    pp_layers_check(cfg, fixed or {})
    if space.offload_activations >= cfg.n_layers:
        raise ConfigError(
            "offload_activations", space.offload_activations, f"< the model's {cfg.n_layers} layers"
        )
    cluster = Cluster.of(gpu, node=node, nic=nic)
    st = with_options(get_stack(stack), stack_options or {})
    # A policy or schedule fixed by a flag that the stack lacks is refused; in a search it is
    # left out.
    refused = layout_problem(
        st,
        recompute=space.recompute[0] if len(space.recompute) == 1 else None,
        schedule=space.schedules[0] if len(space.schedules) == 1 else None,
        pp=1,  # a tied pipeline the stack refuses is left out of the search, with its reason
        tied=cfg.tie_embeddings,
        offload_activations=space.offload_activations,
        precision=precision,
        float8_recipe=float8_recipe,
        offload=space.offload[0] if len(space.offload) == 1 else None,
        cp=space.cp or 1,
    )
    if refused:
        raise ConfigError(*refused)
    space = replace(
        space,
        recompute=tuple(r for r in space.recompute if r in st.recompute),
        schedules=tuple(s for s in space.schedules if s in st.schedules),
        offload=tuple(o for o in space.offload if o in st.offloads),
    )
    options = mem.memory_options(st, compiled=compiled)
    res = search(
        cfg, gpus, cluster, seq, global_batch, precision, top, space=space,
        memory_options=options, time_params=time_params(st, compiled=compiled),
        float8_recipe=float8_recipe,
    )  # fmt: skip
    inputs = {
        "model": model if isinstance(model, str) else cfg.name, "gpu": gpu, "gpus": gpus,
        "seq": seq, "global_batch": global_batch,
        "precision": precision, "node": cluster.node.name, "nic": cluster.fabric.inter.name,
        "stack": stack, "compiled": compiled, "fixed": fixed or {},
        "float8_recipe": float8_recipe, "stack_options": dict(stack_options or {}),
        # every setting of the stack as the plans assume it: its defaults and those given
        "stack_settings": in_effect(st),
    }  # fmt: skip
    return PlanReport(res, inputs)


# The flags of `llmscale plan` that fix one dimension of the search, in the order they print.
FIXABLE = (
    "tp", "pp", "dp_shard", "dp_replicate", "cp", "mbs", "recompute", "every_k", "schedule",
    "chunks", "pp_layers", "zero_stage", "sp", "offload", "offload_activations",
)  # fmt: skip
_DEGREES = ("tp", "pp", "dp_shard", "dp_replicate")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fixed_space(gpus: int, given: dict[str, Any]) -> tuple[SearchSpace, dict[str, Any]]:
    """The search space with each given flag's dimension fixed (None: not given), and the
    fixed values by name. Raises ConfigError for a bad value, UsageError for degrees whose
    product (with cp) cannot make `gpus`. --pp-layers fixes --pp (its entries are pp x chunks);
    its sum is checked against the model in `plan_report` (`pp_layers_check`)."""
    fixed = {k: given[k] for k in FIXABLE if given.get(k) is not None}
    for k in ("tp", "pp", "dp_shard", "dp_replicate", "cp", "mbs", "every_k", "chunks"):
        v = fixed.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(k, v, "a positive integer")
    _one("recompute", fixed, RECOMPUTE_MODES)
    _one("schedule", fixed, PP_SCHEDULES)
    _one("zero_stage", fixed, ZERO_STAGES)
    _one("offload", fixed, OFFLOAD_MODES)
    changes: dict[str, Any] = {}
    if "pp_layers" in fixed:
        layers = _pp_layers(fixed["pp_layers"])
        fixed["pp_layers"] = ",".join(map(str, layers))
        changes["pp_layers"] = layers
        _pp_from_layers(len(layers), fixed)
    if "cp" in fixed:
        changes["cp"] = fixed["cp"]
    degrees = {k: fixed[k] for k in _DEGREES if k in fixed}
    cp = fixed.get("cp", 1)
    product = math.prod(degrees.values()) * cp
    if gpus % product or (len(degrees) == len(_DEGREES) and product != gpus):
        parts = [_degree_text(k, v, given, fixed) for k, v in degrees.items()]
        parts += [f"--cp {cp}"] if cp > 1 else []
        verb = "do not divide" if gpus % product else "do not make"
        raise UsageError(f"{' x '.join(parts)} = {product} GPUs {verb} --gpus {gpus}")
    changes |= degrees
    degrees = {k: fixed[k] for k in _DEGREES if k in fixed}
    if "mbs" in fixed:
        changes["micro_batch_sizes"] = (fixed["mbs"],)
    rec = fixed.get("recompute")
    if "every_k" in fixed:
        if rec is not None and rec != "every_k":
            raise ConfigError("every_k", fixed["every_k"], "only with --recompute every_k")
        rec = "every_k"
        changes["recompute_every_k"] = fixed["every_k"]
    if rec is not None:
        changes["recompute"] = (rec,)
    changes |= _schedule_changes(fixed.get("schedule"), fixed.get("chunks"))
    if "zero_stage" in fixed:
        changes["zero_stages"] = (fixed["zero_stage"],)
    if "sp" in fixed:
        if fixed["sp"] and fixed.get("tp") == 1:
            raise ConfigError("sp", True, "--no-sp with --tp 1 (the runtime's rule)")
        changes["sequence_parallel"] = (bool(fixed["sp"]),)
    if "offload" in fixed:
        changes["offload"] = (fixed["offload"],)
    changes |= _activation_offload_changes(fixed)
    return replace(DEFAULT_SPACE, **changes), fixed


def _activation_offload_changes(fixed: dict[str, Any]) -> dict[str, Any]:
    """--offload-activations N: N >= 0; N > 0 runs with pp 1 and no recompute (the runtime's and
    Megatron-Core's rule), which it fixes where they are not given; 0: no activation offload
    (not given, the search tries the fewest blocks that make a plan fit)."""
    n = fixed.get("offload_activations")
    if n is None:
        return {}
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError("offload_activations", n, "an integer >= 0")
    if n == 0:
        return {"search_offload_activations": False}
    if fixed.get("pp", 1) != 1:
        raise ConfigError("pp", fixed["pp"], "1 with --offload-activations (no pipeline)")
    if fixed.get("recompute", "none") != "none":
        raise ConfigError(
            "recompute",
            fixed["recompute"],
            "none with --offload-activations (offload or recompute)",
        )
    return {"offload_activations": n, "pp": 1, "recompute": ("none",)}


def _schedule_changes(sched: str | None, chunks: int | None) -> dict[str, Any]:
    """The search space's schedules and chunks for --schedule and --chunks: > 1 chunks with
    the loop-style multi-chunk schedules (interleaved_1f1b, zero_bubble; both when no schedule
    is given, and the V ones too for 2), unset or 2 with zbv and dualpipev, 1 with the rest."""
    multi = " | ".join(LOOP_MULTI_CHUNK_SCHEDULES + V_SCHEDULES)
    if sched in V_SCHEDULES:
        if chunks not in (None, 2):
            raise ConfigError("chunks", chunks, f"unset or 2 with --schedule {sched}")
        return {"schedules": (sched,)}
    if chunks is not None and chunks > 1:
        if sched is None:
            scheds = LOOP_MULTI_CHUNK_SCHEDULES + (V_SCHEDULES if chunks == 2 else ())
            return {"schedules": scheds, "chunks": (chunks,)}
        if sched not in LOOP_MULTI_CHUNK_SCHEDULES:
            raise ConfigError("chunks", chunks, f"1 unless --schedule is {multi}")
        return {"schedules": (sched,), "chunks": (chunks,)}
    if chunks == 1:
        if sched in LOOP_MULTI_CHUNK_SCHEDULES:
            raise ConfigError("chunks", chunks, f">= 2 with --schedule {sched}")
        return {"schedules": (sched,) if sched else ("1f1b", "gpipe")}
    return {"schedules": (sched,)} if sched is not None else {}


def _degree_text(name: str, value: int, given: dict[str, Any], fixed: dict[str, Any]) -> str:
    """How a fixed degree was asked for: `--pp 4`, or `--pp-layers 20,20,20 (pp 3)`."""
    if name == "pp" and given.get("pp") is None and "pp_layers" in fixed:
        return f"--pp-layers {fixed['pp_layers']} (pp {value})"
    return f"{_flag(name)} {value}"


def _pp_layers(text: Any) -> tuple[int, ...]:
    """`--pp-layers 3,4,4,3` (or "[3, 4, 4, 3]") as layer counts, one integer >= 0 per stage
    (0 only on the first or last stage: `model.config.pp_layers_problem`)."""
    parts = str(text).strip().strip("[]").replace(" ", "").split(",")
    try:
        layers = tuple(int(p) for p in parts)
    except ValueError:
        layers = ()
    if not layers or pp_layer_counts_problem(layers):
        raise ConfigError(
            "pp_layers", text,
            "layer counts >= 0, one per pipeline stage: 3,4,4,3 (0 only first or last: 0,5,5,4)",
        )  # fmt: skip
    return layers


def _pp_from_layers(stages: int, fixed: dict[str, Any]) -> None:
    """Fix --pp (and --chunks) from the number of --pp-layers entries (pp x chunks of them)."""
    pp, chunks = fixed.get("pp"), fixed.get("chunks")
    if chunks is None and fixed.get("schedule") in V_SCHEDULES:
        chunks = 2  # zbv, dualpipev: two stages per rank
    if pp is None:
        pp = stages // (chunks or 1)
    if chunks is None and stages % pp == 0 and stages // pp > 1:
        chunks = stages // pp  # several stages per rank: interleaved
    if pp * (chunks or 1) != stages:
        raise ConfigError(
            "pp_layers", fixed["pp_layers"],
            f"{pp * (chunks or 1)} entries (pp {pp} x chunks {chunks or 1}), got {stages}",
        )  # fmt: skip
    fixed["pp"] = pp
    if chunks is not None and chunks > 1:
        fixed["chunks"] = chunks


def pp_layers_check(model: ModelConfig, fixed: dict[str, Any]) -> None:
    """Raise ConfigError when --pp-layers does not sum to the model's layers."""
    if "pp_layers" not in fixed:
        return
    layers = _pp_layers(fixed["pp_layers"])
    problem = pp_layers_problem(layers, model.n_layers, len(layers))
    if problem:
        raise ConfigError("pp_layers", fixed["pp_layers"], f"{problem} ({model.name})")


def _one(name: str, fixed: dict[str, Any], allowed: tuple[Any, ...]) -> None:
    v = fixed.get(name)
    if v is not None and not any(type(v) is type(a) and v == a for a in allowed):
        raise ConfigError(name, v, " | ".join(map(str, allowed)))
