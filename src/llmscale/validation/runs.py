"""Published training runs of today's stacks (Megatron-Core, torchtitan) against the planner.

The rows live in `validation/data/runs.toml`, each with its source (repository at a commit,
table and row) and an `assume` string for what the source leaves unsaid; runs_sources.md
beside it describes every source. Each row is driven as a user drives `llmscale plan`: the
published layout fixed, the stack that ran it (`--stack`), the GPU from the catalog; nothing is
fitted per row. A row's `role` says whether a value was fitted on it (`calibration`) or it is
only compared with (`validation`): errors are reported over validation rows only.

Throughput is compared as the source gives it (tokens/s per GPU, else model TFLOP/s per GPU,
else MFU), memory as the peak GiB torchtitan logs (max reserved), and every row's layout must be
predicted to fit (it ran).
"""

from __future__ import annotations

import math
import statistics
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from llmscale.config import PP_SCHEDULES, Precision, Recompute, model_from_table, toml_value
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GiB
from llmscale.model.config import ModelConfig, get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import estimate_memory, memory_options
from llmscale.plan.plan import Plan
from llmscale.plan.search import simulated
from llmscale.plan.time import estimate_step_time, time_params
from llmscale.stack import STACKS, Stack
from llmscale.stack.options import OPTIONS_BY_NAME, Value, options_text

RUNS = Path(__file__).parent / "data" / "runs.toml"
ROLES = ("calibration", "validation")
# Rows of a stack the planner has no record of (the Llama 3 paper's own stack): listed, not
# scored.
UNMODELLED = ("meta-llama3",)


@dataclass(frozen=True)
class RunResult:
    """One published run next to the planner's prediction."""

    id: str
    stack: str
    role: str
    layout: str
    quantity: str  # what the throughput figure is: tokens/s/GPU, TFLOP/s/GPU or MFU
    published: float
    predicted: float
    memory_published: float | None  # GiB
    memory_predicted: float  # GiB
    fits: bool
    source: str
    tight: bool = False  # it fits only without the caching allocator's share

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def error(self) -> float:
        """|predicted / published - 1| of the throughput."""
        return abs(self.ratio - 1)

    @property
    def memory_ratio(self) -> float | None:
        if self.memory_published is None:
            return None
        return self.memory_predicted / self.memory_published


def load_runs(path: str | Path = RUNS) -> list[dict[str, Any]]:
    """The rows of runs.toml, each checked for a source and a role."""
    with open(path, "rb") as f:
        rows: list[dict[str, Any]] = tomllib.load(f)["run"]
    for row in rows:
        rid = row.get("id", "?")
        if not str(row.get("source", "")).strip():
            raise ConfigError(f"run {rid}.source", row.get("source"), "a citation")
        if row.get("role") not in ROLES:
            raise ConfigError(f"run {rid}.role", row.get("role"), " | ".join(ROLES))
    return rows


def _model(row: dict[str, Any]) -> ModelConfig:
    spec = row["model"]
    model = (
        get_preset(spec) if isinstance(spec, str) else model_from_table(spec, f"run {row['id']}")
    )
    seq = int(row["seq_len"])
    return model if seq <= model.max_seq_len else replace(model, max_seq_len=seq)


def _recompute(text: str, n_layers: int) -> tuple[Recompute, int]:
    """The runtime's name for a row's recompute (and every_k's k): `full:N-layers` (Megatron's
    --recompute-num-layers N, block method) as one block in every n_layers // N."""
    if text.startswith("full:"):
        n = int(text.split(":")[1].split("-")[0])
        return "every_k", max(1, n_layers // n)
    if text == "full_every_2nd_layer":
        return "every_k", 2
    if text in ("none", "selective", "selective_op", "full"):
        return text, 2  # type: ignore[return-value]
    raise ConfigError("recompute", text, "none | selective | selective_op | full | full:N-layers")


def _choice(row: dict[str, Any], key: str, setting: str, field: str) -> str:
    """The value of the valued stack `setting` whose Stack `field` is the row's `key`
    (ConfigError naming the row's field where no value of the setting sets it)."""
    choices = OPTIONS_BY_NAME[setting].choices or {}
    values = {changes[field]: value for value, changes in choices.items()}
    if row[key] not in values:
        raise ConfigError(f"run {row['id']}.{key}", row[key], " | ".join(values))
    return values[row[key]]


LOSS_KERNEL_LABELS = {
    "torch": "torch",
    "megatron": "Megatron unfused",
    "megatron_fused": "Megatron fused",
    "te": "TransformerEngine",
}


class RowFact(NamedTuple):
    """A fact of a run's software at its date that a row may state (with its source in a
    comment): a stack setting (`llmscale.stack.options` NAME), whether the row states it, its
    label on the validation page, and the setting's value the row gives (on or off, or a
    valued setting's value). The row's stack takes it as that setting, and its `llmscale plan`
    command types it as the setting's flag."""

    setting: str
    stated: Callable[[dict[str, Any]], bool]
    label: Callable[[dict[str, Any]], str]
    value: Callable[[dict[str, Any]], Value]

    def apply(self, stack: Stack, row: dict[str, Any]) -> Stack:
        return OPTIONS_BY_NAME[self.setting].apply(stack, self.value(row))

    def flag(self, row: dict[str, Any]) -> str:
        return options_text({self.setting: self.value(row)})


ROW_FACTS: tuple[RowFact, ...] = (
    RowFact(  # torchtitan's micro-pipelined TP collectives
        "async-tp", lambda r: bool(r.get("async_tp")), lambda r: "async TP", lambda r: True,
    ),
    RowFact(  # torchtitan runs before 2026-01-27: K, V repeated before SDPA
        "repeat-kv", lambda r: bool(r.get("repeat_kv")), lambda r: "K/V repeated",
        lambda r: True,
    ),
    RowFact(  # a torchtitan of 2024-12: the loss ran eager
        "compile-loss", lambda r: r.get("compiled_loss") is False, lambda r: "loss eager",
        lambda r: False,
    ),
    RowFact(  # Megatron-Bridge's FP8 recipes: FP8 parameters (NeMo 1's runs: none)
        "fp8-param-gather", lambda r: "fp8_param_gather" in r,
        lambda r: "FP8 parameters" if r["fp8_param_gather"] else "no FP8 parameters",
        lambda r: bool(r["fp8_param_gather"]),
    ),
    RowFact(  # Megatron's main gradients: bf16 (the performance scripts) or fp32
        "grad-reduce-in-bf16", lambda r: "grad_reduce_in_fp32" in r,
        lambda r: "fp32 gradient reduce" if r["grad_reduce_in_fp32"] else "bf16 gradient reduce",
        lambda r: not r["grad_reduce_in_fp32"],
    ),
    RowFact(  # torch's pipelining of the run's date
        "pipeline-outputs-kept", lambda r: "pipeline_outputs_kept" in r,
        lambda r: f"stage outputs kept: {r['pipeline_outputs_kept']}",
        lambda r: _choice(
            r, "pipeline_outputs_kept", "pipeline-outputs-kept", "pipeline_outputs_kept"
        ),
    ),
    RowFact(  # the cross-entropy kernel of the run's Megatron / NeMo configuration
        "cross-entropy-fusion", lambda r: "loss_kernel" in r,
        lambda r: f"cross-entropy: {LOSS_KERNEL_LABELS.get(r['loss_kernel'], r['loss_kernel'])}",
        lambda r: _choice(r, "loss_kernel", "cross-entropy-fusion", "kernels.loss_kernel"),
    ),
    RowFact(  # PYTORCH_CUDA_ALLOC_CONF set by the run's launcher
        "expandable-segments", lambda r: bool(r.get("expandable_segments")),
        lambda r: "expandable segments", lambda r: True,
    ),
)  # fmt: skip


def row_facts(row: dict[str, Any]) -> list[RowFact]:
    """The `ROW_FACTS` that `row` states."""
    return [f for f in ROW_FACTS if f.stated(row)]


def _facts_text(row: dict[str, Any]) -> str:
    """The row's facts as the validation page lists them after its layout ("" for none)."""
    labels = [f.label(row) for f in row_facts(row)]
    return f"; {', '.join(labels)}" if labels else ""


def run_plan(row: dict[str, Any]) -> tuple[Plan, Stack, bool]:
    """The Plan of a published row, its stack, and whether its blocks are compiled."""
    stack = STACKS[row["stack"]]
    model = _model(row)
    tp, pp, cp, dp = (int(row[k]) for k in ("tp", "pp", "cp", "dp"))
    vp = int(row.get("vp", 1) or 1)
    recompute, k = _recompute(str(row.get("recompute", "none")), model.n_layers)
    sharded = bool(row.get("fsdp")) or bool(row.get("distributed_optimizer"))
    zero = 3 if row.get("fsdp") else (1 if sharded else 0)
    schedule = str(row.get("schedule") or ("interleaved_1f1b" if vp > 1 else "1f1b"))
    if schedule not in PP_SCHEDULES:
        raise ConfigError(f"run {row['id']}.schedule", schedule, " | ".join(PP_SCHEDULES))
    named = row.get("precision")
    precision: Precision = named if named in ("fp8", "nvfp4") else "bf16"
    plan = Plan(
        model=model,
        seq_len=int(row["seq_len"]),
        micro_batch_size=int(row.get("micro_batch", 1)),
        global_batch_size=int(row["global_batch"]),
        precision=precision,
        tp=tp,
        pp=pp,
        cp=cp,
        dp_shard=dp if sharded else 1,
        dp_replicate=1 if sharded else dp,
        zero_stage=zero,
        recompute=recompute,
        recompute_every_k=k,
        pp_schedule=schedule,
        pp_chunks=vp,
        sequence_parallel=bool(row.get("sp", tp > 1)),
        offload_activations=int(row.get("offload_activations", 0)),
        float8_recipe=row.get("float8_recipe", "tensorwise"),
    )
    for fact in row_facts(row):
        stack = fact.apply(stack, row)
    return plan, stack, bool(row.get("compile"))


def model_file(row: dict[str, Any]) -> str | None:
    """The `--model FILE.toml` a row's command needs, as one line of TOML (a `[model]` table
    inline): the row's own shape, or its preset with the longer context it ran (`name` and
    `max_seq_len`); None where `--model PRESET` gives the row's model."""
    spec = row["model"]
    if isinstance(spec, str):
        if int(row["seq_len"]) <= get_preset(spec).max_seq_len:
            return None
        table: dict[str, Any] = {"name": spec, "max_seq_len": int(row["seq_len"])}
    else:
        table = dict(spec)
    return "model = { " + ", ".join(f"{k} = {toml_value(v)}" for k, v in table.items()) + " }"


def plan_command(row: dict[str, Any], model_path: str | None = None) -> str | None:
    """The `llmscale plan` command that predicts this row as the validation page does: its
    layout fixed, its stack and the settings its facts state (`RowFact.flag`); a model that is
    not a preset as it stands is read from `model_path` (default ID.toml), which holds
    `model_file(row)`. None where the row's stack is not one of `STACKS`."""
    if row["stack"] not in STACKS:
        return None
    plan, stack, compiled = run_plan(row)
    model = row["model"] if model_file(row) is None else model_path or f"{row['id']}.toml"
    parts = [
        f"llmscale plan --model {model} --gpu {row['gpu']} --gpus {plan.world_size}",
        f"--seq {plan.seq_len} --global-batch {plan.global_batch_size}",
        f"--precision {plan.precision} --stack {stack.name}",
    ]
    if plan.float8_recipe != "tensorwise":
        parts.append(f"--float8-recipe {plan.float8_recipe}")
    if compiled:
        parts.append("--compile")
    parts.append(
        f"--tp {plan.tp} --pp {plan.pp} --cp {plan.cp} --dp-shard {plan.dp_shard} "
        f"--dp-replicate {plan.dp_replicate} --zero-stage {plan.zero_stage} "
        f"--mbs {plan.micro_batch_size} --offload {plan.offload}"
    )
    if plan.recompute == "every_k":
        parts.append(f"--every-k {plan.recompute_every_k}")
    else:
        parts.append(f"--recompute {plan.recompute}")
    parts.append(f"--schedule {plan.pp_schedule} --chunks {plan.pp_chunks}")
    parts.append("--sp" if plan.sequence_parallel else "--no-sp")
    if plan.offload_activations:
        parts.append(f"--offload-activations {plan.offload_activations}")
    parts += [f.flag(row) for f in row_facts(row)]
    return " ".join(parts)


def _layout(plan: Plan, stack: Stack) -> str:
    shards = plan.fsdp_shards_for(stack)
    dp = f"dp_shard {plan.dp_shard} zero {plan.zero_stage}" if shards > 1 else f"dp {plan.dp}"
    if shards > plan.dp_shard:
        dp += f" (FSDP over dp_shard x cp: {shards})"
    v = f" v{plan.chunks}" if plan.chunks > 1 else ""
    cp = f" cp{plan.cp}" if plan.cp > 1 else ""
    recipe = f" {plan.float8_recipe}" if plan.float8_recipe != "tensorwise" else ""
    off = (
        f", {plan.offload_activations} blocks' activations offloaded"
        if plan.offload_activations
        else ""
    )
    return (
        f"t{plan.tp} p{plan.pp}{v}{cp} {dp}, mbs {plan.micro_batch_size}, "
        f"gbs {plan.global_batch_size}, seq {plan.seq_len}, {plan.recompute}, {plan.precision}"
        f"{recipe}{off}"
    )


def evaluate(row: dict[str, Any]) -> RunResult:
    """One row's prediction, as `llmscale plan --stack ... <layout>` makes it."""
    plan, stack, compiled = run_plan(row)
    cluster = Cluster.of(str(row["gpu"]))
    # As `llmscale plan` times a plan it shows: a pipeline's step re-timed by the schedule
    # simulator where its ops are few enough (`plan.search.simulated`), else the closed form.
    step = estimate_step_time(
        plan, cluster, time_params(stack, compiled=compiled), simulate=simulated(plan),
        validate=False,
    )  # fmt: skip
    mem = estimate_memory(plan, memory_options(stack, compiled=compiled), validate=False)
    world = plan.world_size
    if "tokens_per_s_per_gpu" in row:
        quantity, published = "tokens/s per GPU", float(row["tokens_per_s_per_gpu"])
        predicted = step.tokens_per_s / world
    elif "tflops_per_gpu" in row:
        quantity, published = "TFLOP/s per GPU", float(row["tflops_per_gpu"])
        predicted = step.model_flops_per_gpu / 1e12
    else:
        quantity, published, predicted = "MFU", float(row["mfu"]), step.mfu
    mem_pub = row.get("memory_GiB")
    return RunResult(
        id=str(row["id"]),
        stack=stack.name,
        role=str(row["role"]),
        layout=_layout(plan, stack) + _facts_text(row),
        quantity=quantity,
        published=published,
        predicted=predicted,
        memory_published=None if mem_pub is None else float(mem_pub),
        memory_predicted=mem.total / GiB,
        fits=mem.fits(cluster.gpu),
        source=str(row["source"]),
        tight=mem.tight(cluster.gpu),
    )


def all_results(path: str | Path = RUNS) -> list[RunResult]:
    """Every scored row (a modelled stack) with its prediction."""
    return [evaluate(r) for r in load_runs(path) if r["stack"] not in UNMODELLED]


@dataclass(frozen=True)
class StackSummary:
    """Errors over one stack's validation rows."""

    stack: str
    rows: int
    median_error: float
    worst_error: float
    within_10: int
    memory_rows: int
    memory_worst_error: float
    fit: int

    @property
    def line(self) -> str:
        mem = (
            f"memory worst |error| {self.memory_worst_error:.0%} over {self.memory_rows} rows"
            if self.memory_rows
            else "no published memory"
        )
        return (
            f"{self.stack}: {self.rows} validation rows, throughput median |error| "
            f"{self.median_error:.1%}, worst {self.worst_error:.1%}, {self.within_10} within 10%; "
            f"{mem}; {self.fit} of {self.rows} predicted to fit"
        )


def summarise(results: list[RunResult]) -> list[StackSummary]:
    """Per stack, over validation rows only."""
    out = []
    for name in sorted({r.stack for r in results}):
        rows = [r for r in results if r.stack == name and r.role == "validation"]
        if not rows:
            continue
        errs = [r.error for r in rows]
        mem = [abs(m - 1) for r in rows if (m := r.memory_ratio) is not None]
        out.append(
            StackSummary(
                stack=name,
                rows=len(rows),
                median_error=statistics.median(errs),
                worst_error=max(errs),
                within_10=sum(e <= 0.10 for e in errs),
                memory_rows=len(mem),
                memory_worst_error=max(mem) if mem else math.nan,
                fit=sum(r.fits for r in rows),
            )
        )
    return out
