"""Predictions travel with every run: what the planner expects, written before the first step.

Every run's rank 0 writes `RUN_DIR/prediction.json` before training:

    {"hardware": {...},            # what the time model ran on: a catalog GPU or this machine
     "plan": {...},                # the layout (plan.Plan's fields; the model by name)
     "memory_bytes": {...},        # every byte-valued key of the metrics rows, same names
     "step_time_s": 0.21,          # predicted seconds per optimizer step
     "step_breakdown_s": {...},    # where the time goes (plan/time.py)
     "collectives": {...},         # FSDP all-gathers, reduce-scatters, all-reduces, bytes per step
                                   # of pipeline rank 0 (stack/residency.py; null under tp > 1)
     "not_modelled": null}         # or why the planner could not predict this layout

and the end-of-run summary prints each prediction next to what the run measured (rank 0's
memory keys, and the median step time after the first step). `llmscale train --dry-run` prints
the same prediction for every pipeline rank without training (`dry_run_lines`).

The hardware is the device the run uses: a catalog GPU (its data sheet; `--gpu NAME` picks one
for a dry run), or, on a CPU or a GPU the catalog lacks, this machine micro-benchmarked on the
runtime's own kernels for the run's model and micro-batch (train/calibration.py, measured once
per machine and shape, then cached): the same figures `llmscale bench` predicts its rows from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from llmscale.config import JobConfig
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GPU, GiB, gpu_for_device_name
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import MemoryEstimate, estimate_memory, memory_options
from llmscale.plan.plan import Plan
from llmscale.plan.predict import (
    plan_collectives,
    runtime_metric_bytes,
    runtime_options,
    runtime_time_params,
)
from llmscale.plan.shared_cores import (
    SharedCoreCosts,
    gloo_cluster,
    one_token,
    shared_cores_step,
)
from llmscale.plan.time import StepTime, estimate_step_time, time_params
from llmscale.report.report import byte_unit
from llmscale.stack import (
    LLMSCALE,
    Stack,
    fitted_note,
    get_stack,
    layout_problem,
)
from llmscale.stack.options import with_options
from llmscale.train.calibration import cached_cluster
from llmscale.train.memcheck import check_memory

FILE_NAME = "prediction.json"


@dataclass(frozen=True)
class Hardware:
    """The device a prediction is for, and where its numbers come from."""

    cluster: Cluster
    device: str  # the runtime's kernels: "cuda" or "cpu"
    measured: bool  # the GEMM rate and bandwidth were micro-benchmarked here
    info: dict[str, Any] = field(default_factory=dict)
    shared: SharedCoreCosts | None = None  # ranks sharing a CPU's cores (measured), if any
    # The runtime's stack as priced on this device: on a measured one, with the costs measured
    # there (`Stack.on_device`: its fixed costs per micro-batch and step, its optimizer's share).
    stack: Stack = LLMSCALE


def catalog_hardware(gpu: str) -> Hardware:
    """A catalog GPU by name (unknown: ConfigError naming the allowed ones)."""
    cluster = Cluster.of(gpu)
    g = cluster.gpu
    info = {"name": g.name, "display": g.display, "source": "hardware catalog"}
    return Hardware(cluster, "cuda", measured=False, info=info)


def local_hardware(device: torch.device, plan: Plan) -> Hardware:
    """The run's own device: its catalog entry, else this machine calibrated (cached)."""
    if device.type == "cuda":
        known = gpu_for_device_name(torch.cuda.get_device_name(device))
        if known is not None:
            return catalog_hardware(known.name)
    (cluster, costs, figures), when = cached_cluster(plan, device)
    info = {
        "name": "measured",
        "display": cluster.gpu.display,
        "source": "micro-benchmarks of this machine (train/calibration.py; cached per machine "
        "and shape)",
        "figures": figures,
        "stack_costs": dataclasses.asdict(costs),
        "links": "not measured: the h100 node's stand in",
        "calibration": {
            "measured_at": when.measured_at,
            "other_load_cores": when.other_load_cores,
            "warning": when.warning,
            "refreshed": when.refreshed,  # why the cached figures were measured again, if so
            "probe_s": when.probe_s,
        },
    }
    kind = "cpu" if device.type == "cpu" else "cuda"
    return Hardware(cluster, kind, measured=True, info=info, stack=LLMSCALE.on_device(costs))


def with_shared_cores(hardware: Hardware, costs: SharedCoreCosts, warnings: list[str]) -> Hardware:
    """`hardware` for a multi-process CPU run: the ranks' measured costs of sharing the cores
    and gloo's link (train/shared_cores.py), priced by plan/shared_cores.py."""
    info = dict(hardware.info)
    info["shared_cores"] = dataclasses.asdict(costs)
    info["links"] = "gloo over loopback, measured (train/shared_cores.py)"
    if warnings:
        info["shared_cores_warning"] = " ".join(warnings)
    return replace(hardware, info=info, shared=costs)


@dataclass(frozen=True)
class RunPrediction:
    """What the planner expects of a run on pipeline rank `rank` (and every stage's memory)."""

    hardware: dict[str, Any]
    plan: dict[str, Any]
    rank: int
    memory_bytes: dict[str, float]
    step_time_s: float | None
    step_breakdown_s: dict[str, float] = field(default_factory=dict)
    memory: MemoryEstimate | None = None  # every pipeline rank, at the step's peak
    step: StepTime | None = None
    not_modelled: str | None = None
    collectives: dict[str, int] | None = None  # per step after the first (stack/residency)

    def to_json(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware,
            "plan": self.plan,
            "rank": self.rank,
            "memory_bytes": self.memory_bytes,
            "step_time_s": self.step_time_s,
            "step_breakdown_s": self.step_breakdown_s,
            "collectives": self.collectives,
            "not_modelled": self.not_modelled,
        }

    def write(self, run_dir: str | Path) -> Path:
        """RUN_DIR/prediction.json, atomically: a temporary file, then a rename."""
        path = Path(run_dir) / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=FILE_NAME, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=2)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def layout(plan: Plan) -> dict[str, Any]:
    """The plan's fields (the model by name), with the derived world size and micro-batches."""
    out: dict[str, Any] = {f.name: getattr(plan, f.name) for f in fields(plan)}
    out["model"] = plan.model.name
    out["world_size"] = plan.world_size
    out["microbatches"] = plan.n_microbatches
    return out


def predict_run(cfg: JobConfig, hardware: Hardware, rank: int = 0) -> RunPrediction:
    """The planner's prediction for `cfg` on `hardware`; a layout it does not model is said so
    (`not_modelled`), with what it could predict."""
    plan = Plan.from_job(cfg)
    base: dict[str, Any] = {
        "hardware": hardware.info,
        "plan": layout(plan),
        "rank": rank,
        "collectives": plan_collectives(plan, rank),
    }
    try:
        memory_bytes = runtime_metric_bytes(plan, rank, hardware.device)
        memory = estimate_memory(plan, runtime_options(plan, hardware.device))
    except ConfigError as e:
        return RunPrediction(**base, memory_bytes={}, step_time_s=None, not_modelled=str(e))
    params = runtime_time_params(plan, hardware.device, compiled=cfg.train.compile)
    params = params.with_stack(hardware.stack)
    seconds: float | None = None
    breakdown: dict[str, float] = {}
    try:
        if hardware.shared is not None:
            cluster = gloo_cluster(hardware.cluster, plan, hardware.shared)
            step: StepTime | None = estimate_step_time(plan, cluster, params)
            one = estimate_step_time(one_token(plan), cluster, params, validate=False)
            assert step is not None
            seconds, breakdown = shared_cores_step(step, one, hardware.shared)
        else:
            step = estimate_step_time(plan, hardware.cluster, params)
            seconds, breakdown = step.seconds, dict(step.breakdown)
        reason = None
    except ConfigError as e:
        step, reason = None, str(e)
    return RunPrediction(
        **base,
        memory_bytes=memory_bytes,
        step_time_s=seconds if step else None,
        step_breakdown_s=breakdown if step else {},
        memory=memory,
        step=step,
        not_modelled=reason,
    )


def write_run_prediction(
    cfg: JobConfig,
    device: torch.device,
    run_dir: str | Path,
    shared: tuple[SharedCoreCosts, list[str]] | None = None,
) -> RunPrediction:
    """Rank 0 at the start of a run: predict for its own device and write RUN_DIR/prediction.json
    (a multi-process CPU run: with its ranks' `shared` costs and their warnings)."""
    hardware = local_hardware(device, Plan.from_job(cfg))
    if shared is not None:
        hardware = with_shared_cores(hardware, *shared)
    prediction = predict_run(cfg, hardware)
    prediction.write(run_dir)
    return prediction


# ---- llmscale train --dry-run ---------------------------------------------------------------

BREAKDOWN = (
    ("params", "params"),
    ("grads", "grads"),
    ("optimizer", "optim"),
    ("working_params", "working"),
    ("activations", "activ"),
    ("pending_weight_grads", "B to W"),  # split backwards: what B keeps for W
    ("pipeline_buffers", "recv"),  # the pipeline stages' receive buffers
    ("transient", "transient"),
    ("allocator", "allocator"),
)


def dry_run_lines(
    cfg: JobConfig,
    device: torch.device | None,
    gpu: str | None = None,
    stack: str = "llmscale",
    stack_options: Mapping[str, bool | str] | None = None,
) -> list[str]:
    """What `llmscale train --dry-run` prints: the layout, each pipeline rank's memory and the
    predicted step, for catalog `gpu` or, without one, this machine's `device`. No process
    group, no model: a layout of any world size is predicted as the config gives it. `stack`:
    the job as another training stack would run it (on a catalog `gpu`), with its own settings
    `stack_options` (`llmscale.stack.options`)."""
    if stack != "llmscale" or stack_options:
        if gpu is None:
            raise ValueError("dry_run_lines: another stack needs a catalog gpu")
        return _other_stack_lines(cfg, gpu, with_options(get_stack(stack), stack_options or {}))
    cfg.validate()
    refused = layout_problem(
        LLMSCALE, recompute=None, schedule=None, pp=1, tied=False,
        precision=cfg.precision.mode, float8_recipe=cfg.precision.float8_recipe,
    )  # fmt: skip
    if refused:  # nvfp4, mxfp8: no machine runs them in llmscale, so no dry run of them either
        raise ConfigError(*refused)
    if gpu is not None:
        hardware = catalog_hardware(gpu)
    elif device is not None:
        hardware = local_hardware(device, Plan.from_job(cfg))
    else:
        raise ValueError("dry_run_lines: a device or a catalog gpu")
    pred = predict_run(cfg, hardware)
    p = pred.plan
    out = [
        f"dry run: {cfg.job.name}, model {p['model']}, {p['precision']}, "
        f"recompute {p['recompute']}, offload {p['offload']}; {p['world_size']} rank(s): "
        f"pp {p['pp']} x dp_replicate {p['dp_replicate']} x dp_shard {p['dp_shard']} x tp "
        f"{p['tp']}; global batch {p['global_batch_size']} = micro-batch "
        f"{p['micro_batch_size']} x {p['microbatches']} micro-batches x dp "
        f"{p['dp_replicate'] * p['dp_shard']}; seq {p['seq_len']}",
        f"hardware: {hardware.info['display']}, from the {hardware.info['source']}",
    ]
    if pred.memory is None:
        out.append(f"not modelled: {pred.not_modelled}")
        return out
    out += memory_table(pred.memory, p["world_size"] // p["pp"])
    if gpu is not None:
        out.append(fit_line(pred.memory, hardware.cluster.gpu))
    elif device is not None:
        out += _local_fit(cfg, device)
    if pred.step is None:
        out.append(f"step time: not modelled ({pred.not_modelled})")
        return out
    st = pred.step
    # On a measured device the peak is the measured GEMM rate: an MFU against it means little.
    out.append(step_line(st, mfu=not hardware.measured))
    return out


def fit_line(memory: MemoryEstimate, gpu: GPU) -> str:
    """The dry run's verdict on a catalog GPU: does the fullest rank fit, by how much."""
    w = memory.worst
    unit, size = byte_unit(w.total)
    verdict = "NO" if not memory.fits(gpu) else "tightly" if memory.tight(gpu) else "yes"
    return (
        f"fits: {verdict}: the fullest rank needs {w.total / size:.2f} {unit} "
        f"({w.allocated / size:.2f} allocated, the rest the caching allocator's; "
        f"+{memory.options.device_reserve_GiB} GiB reserved) of {gpu.display}'s "
        f"{gpu.memory_bytes / GiB:.0f} GiB"
    )


def step_line(step: StepTime, mfu: bool = True) -> str:
    """The dry run's predicted step: seconds, tokens/s, MFU, and where the time goes."""
    parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in step.breakdown.items() if v > 0)
    util = f", MFU {100 * step.mfu:.1f}%" if mfu else ""
    return (
        f"step time: {step.seconds:.3f} s predicted ({step.tokens_per_s:,.0f} tokens/s{util}); "
        f"ms per step: {parts}"
    )


def _other_stack_lines(cfg: JobConfig, gpu: str, stack: Stack) -> list[str]:
    """The dry run under `stack`'s rules (its recompute policies, gathers, kernels), not this
    runtime's: memory per pipeline rank and the step on catalog `gpu`."""
    plan = Plan.from_job(cfg)
    schedule = plan.pp_schedule if plan.pp > 1 else None
    refused = layout_problem(stack, recompute=plan.recompute, schedule=schedule, pp=plan.pp,
                             tied=plan.model.tie_embeddings,
                             offload_activations=plan.offload_activations,
                             precision=plan.precision,
                             float8_recipe=plan.float8_recipe,
                             offload=plan.offload, cp=plan.cp)  # fmt: skip
    if refused:
        raise ConfigError(*refused)
    cluster = Cluster.of(gpu)
    memory = estimate_memory(
        plan, memory_options(stack, compiled=cfg.train.compile), validate=False
    )
    step = estimate_step_time(plan, cluster, time_params(stack, compiled=cfg.train.compile),
                              validate=False)  # fmt: skip
    g = cluster.gpu
    fitted = fitted_note(stack, g.name, plan.precision, plan.float8_recipe)
    return [
        f"dry run under --stack {stack.name} ({stack.summary}): {cfg.job.name}, model "
        f"{plan.model.name}, {plan.world_size} rank(s): pp {plan.pp} x dp_replicate "
        f"{plan.dp_replicate} x dp_shard {plan.dp_shard} x tp {plan.tp}, on {g.display}",
        *memory_table(memory, plan.world_size // plan.pp),
        fit_line(memory, g),
        step_line(step),
        *([fitted] if fitted else []),
    ]


def memory_table(memory: MemoryEstimate, ranks_per_stage: int) -> list[str]:
    """Each pipeline rank's bytes at the step's peak by kind (plan/memory.py), in the unit
    that suits the largest (`report.byte_unit`), with the global ranks that hold it."""
    head = ["pp rank", "rank ids"] + [short for _, short in BREAKDOWN] + ["total", "host"]
    unit, size = byte_unit(max(max(s.total, s.host) for s in memory.per_rank))
    rows = [head]
    for s in memory.per_rank:
        first = s.pp_rank * ranks_per_stage
        ranks = f"{first}" if ranks_per_stage == 1 else f"{first}-{first + ranks_per_stage - 1}"
        parts = [s.breakdown()[k] for k, _ in BREAKDOWN]
        rows.append(
            [str(s.pp_rank), ranks, *(f"{x / size:.2f}" for x in [*parts, s.total, s.host])]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = [f"memory per rank at the step's peak, {unit}:"]
    for r in rows:
        out.append("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    return out


def _local_fit(cfg: JobConfig, device: torch.device) -> list[str]:
    """The run-time memory check's verdict for this machine, as lines (never raises)."""
    warned = replace(cfg, job=replace(cfg.job, memory_check="warn"))
    lines = check_memory(warned, device)
    return lines or ["fits: yes (the run-time memory check against this machine passes)"]
