"""Entry points for the rest of llmscale: predictions from a JobConfig (or a Plan) and hardware.

    from llmscale.plan.predict import predict_memory, predict_step_time, expected_runtime_metrics
    mem = predict_memory(job)                       # MemoryEstimate, per pipeline stage
    step = predict_step_time(job, "h200")           # StepTime: seconds, tokens/s, MFU, breakdown
    want = expected_runtime_metrics(job, rank=0)    # the trainer's metric names -> bytes

`expected_runtime_metrics` speaks the runtime's own vocabulary (train/metrics.py and the
`SavedActivations` counter): `param_bytes`, `grad_bytes` (as measured before the optimizer
step: under FSDP2 + PP after the step's one reduce-scatter, so the shards, not the unsharded
gradients the planner's memory peak holds), `optimizer_bytes` (Adam moments and
`step` counters), `activation_bytes` (what autograd saves for the first micro-batch, which under
autocast includes the bf16 weight casts the linears keep), under pipelining
`activation_peak_bytes` (the most saved at once over the schedule), and `cuda_peak_bytes` (the predicted
torch.cuda.max_memory_allocated over a step); under optimizer+params also
`device_param_peak_bytes` (the most parameter bytes the device held at once), and
`offload_bytes_moved` (bytes copied between device and host in one step, `plan/offload_traffic.py`).
"""

from __future__ import annotations

from dataclasses import replace

from llmscale.config import DTYPE_BYTES, JobConfig
from llmscale.errors import ConfigError
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.lsp import lsp_memory
from llmscale.plan.memory import (
    DEFAULT_OPTIONS,
    MemoryEstimate,
    MemoryOptions,
    estimate_memory,
    param_window,
    plan_rank_params,
    rank_activation_bytes,
    rank_pieces,
)
from llmscale.plan.offload_traffic import offload_traffic
from llmscale.plan.plan import Plan
from llmscale.plan.schedule import schedule_ops
from llmscale.plan.time import DEFAULT_TIME, StepTime, TimeParams, estimate_step_time
from llmscale.plan.work import rank_work
from llmscale.stack.residency import predict_collectives


def as_plan(job: JobConfig | Plan) -> Plan:
    return job if isinstance(job, Plan) else Plan.from_job(job)


def predict_memory(
    job: JobConfig | Plan, options: MemoryOptions = DEFAULT_OPTIONS
) -> MemoryEstimate:
    """Per-GPU memory of every pipeline stage (validated like the runtime validates)."""
    return estimate_memory(as_plan(job), options)


def predict_step_time(
    job: JobConfig | Plan,
    gpu: str | Cluster,
    params: TimeParams = DEFAULT_TIME,
    simulate: bool = False,
) -> StepTime:
    """Step time on `gpu` (a catalog name, with its node shape, or a Cluster)."""
    cluster = gpu if isinstance(gpu, Cluster) else Cluster.of(gpu)
    return estimate_step_time(as_plan(job), cluster, params, simulate)


def expected_runtime_metrics(
    job: JobConfig | Plan, rank: int = 0, options: MemoryOptions = DEFAULT_OPTIONS
) -> dict[str, float]:
    """What the runtime's per-step metrics should read on pipeline `rank` (bytes)."""
    plan = as_plan(job)
    plan.validate()
    pieces = rank_pieces(plan, rank, options)
    optim = pieces.optimizer
    k = options.kernels
    # One micro-batch's saved bytes as the memory model counts them: blocks, embedding, head
    # (a cp rank's 1/cp of each sequence); not those of offloaded blocks, on the host, where the
    # measuring hooks do not see them (parallel/activation_offload.py).
    work = rank_work(plan, rank, k)
    modes = work.modes
    saved = work.saved - work.host_saved
    rp = plan_rank_params(plan, rank, k)
    casts = 0.0  # autocast's weight casts that autograd keeps (working_params in the model)
    if plan.precision != "fp32" and not plan.lowp_weights:  # autocast runs
        live_blocks = modes.get("none", 0) + modes.get("selective", 0) - work.offloaded
        casts += 2.0 * live_blocks * rp.block.saved_cast_numel
        casts += 2.0 * sum(g.saved_cast_numel for g in rp.root)
    saved += casts
    peak = estimate_memory(plan, options).per_rank[rank].allocated
    if plan.offload != "none":
        # The optimizer states live on the host; the metric counts them wherever they are.
        optim = _host_optimizer_bytes(plan, rank, options)
    out = {
        "param_bytes": pieces.params,
        "grad_bytes": measured_grad_bytes(plan, rank, pieces.grads, k),
        "optimizer_bytes": optim,
        "activation_bytes": saved,
        "cuda_peak_bytes": peak,
    }
    if plan.pp > 1:
        # The most held at once over the schedule (micro-batches in flight); the casts are
        # made once per step and shared by every micro-batch.
        out["activation_peak_bytes"] = rank_activation_bytes(plan, rank, options) + casts
        # What the stages hold beside them (parallel.pipeline.PipelineMemory, plan/memory.py).
        out["pending_weight_grad_bytes"] = pieces.pending_weight_grads
        out["pipeline_buffer_bytes"] = pieces.pipeline_buffers
    if plan.offload == "optimizer+params" and not plan.fsdp_cpu_offload:
        # The offloaded optimizer's own count of the parameters it held on the device at once.
        pb = DTYPE_BYTES[plan.precision]
        out["device_param_peak_bytes"] = pb * param_window(plan, rank, rp, options.prefetch_blocks)
    traffic = offload_traffic(plan, rank, k)  # plan/offload_traffic.py; None: not modelled
    if traffic is not None:
        out["offload_bytes_moved"] = traffic.total
    return out


def measured_grad_bytes(plan: Plan, rank: int, held: float, kernels: act.Kernels) -> float:
    """The gradient bytes the runtime's metrics row reports (`Optimizers.grad_memory`, read in
    `optimizer_step`, after the step's reduction), from the planner's peak `held`.

    Under FSDP2 + PP the planner's `grads` are the unsharded fp32 gradients a stage holds
    across micro-batches until the one reduce-scatter at the step's end (its memory peak); the
    runtime measures after that reduce-scatter: the fp32 shards (4 B per parameter of the
    shard), or nothing on the device when the offloaded optimizer took them to the host."""
    if not plan.fsdp_holds_grads_across_microbatches:
        return held
    if plan.offload != "none":
        return 0.0
    return 4.0 * plan_rank_params(plan, rank, kernels).shard_numel


def _host_optimizer_bytes(plan: Plan, rank: int, options: MemoryOptions) -> float:
    if plan.offload == "lsp":
        return float(_lsp_ledger(plan)["host_optimizer_bytes"])
    rp = plan_rank_params(plan, rank, options.kernels)
    shard = rp.shard_numel if plan.fsdp else rp.numel
    return 8.0 * shard + 4.0 * rp.tensors


# ---- the runtime's own view: its kernels, and every byte key of its metrics rows ------------

# The optimizer ledger every metrics row carries (train/optim.py), zero where nothing is held.
LEDGER_KEYS = (
    "device_optimizer_bytes",
    "device_master_bytes",
    "host_optimizer_bytes",
    "host_master_bytes",
)


def runtime_options(job: JobConfig | Plan, device: str = "cuda") -> MemoryOptions:
    """The memory model's options for the llmscale runtime on `device` ("cuda" or "cpu")."""
    plan = as_plan(job)
    return MemoryOptions(kernels=act.Kernels.for_runtime(plan.model, plan.tp, device))


def runtime_time_params(
    job: JobConfig | Plan, device: str = "cuda", compiled: bool = False
) -> TimeParams:
    """The time model's parameters for the llmscale runtime on `device` (`compiled`: its
    blocks under train.compile). A measured device's achieved rates are in its catalog entry's
    calibration (efficiencies 1), not in these."""
    plan = as_plan(job)
    kernels = act.Kernels.for_runtime(plan.model, plan.tp, device)
    return replace(DEFAULT_TIME, kernels=kernels, compiled=compiled)


def runtime_metric_bytes(
    job: JobConfig | Plan, rank: int = 0, device: str = "cuda"
) -> dict[str, float]:
    """Every byte-valued key of the trainer's metrics rows on pipeline `rank`, predicted.

    The keys are the ones the runtime writes for this layout on `device`: those of
    `expected_runtime_metrics` (`cuda_peak_bytes` on CUDA only), the optimizer ledger
    (`LEDGER_KEYS`: where the Adam states and fp32 masters live) and, with the optimizer
    offloaded, the host buffers the offloaded optimizer reports (offload/host_adam.py: an fp32
    gradient per parameter, a transfer buffer in the working dtype unless fp32 without
    accumulation, under optimizer+params a working-dtype copy of low-precision weights) or,
    under FSDP2's CPU offload, its fp32 gradient shards (`host_grad_bytes`).
    """
    plan = as_plan(job)
    options = runtime_options(plan, device)
    out = expected_runtime_metrics(plan, rank, options)
    if device != "cuda":
        del out["cuda_peak_bytes"]
    out.update(dict.fromkeys(LEDGER_KEYS, 0.0))
    where = "device" if plan.offload == "none" else "host"
    out[f"{where}_optimizer_bytes"] = out["optimizer_bytes"]
    if plan.offload == "none":
        return out
    if plan.offload == "lsp":  # rank 0's: the projectors' and the ZeRO path's ledger
        row = _lsp_ledger(plan)
        for k in ("host_master_bytes", "host_grad_bytes", "host_staging_bytes"):
            out[k] = float(row[k])
        out["device_lsp_bytes"] = float(row["device_lsp_bytes"])
        return out
    rp = plan_rank_params(plan, rank, options.kernels)
    shard = float(rp.shard_numel if plan.fsdp else rp.numel)
    out["host_master_bytes"] = 4 * shard
    out["host_grad_bytes"] = 4 * shard
    if plan.fsdp_cpu_offload:
        return out
    pb = DTYPE_BYTES[plan.precision]
    staging = plan.precision != "fp32" or plan.n_microbatches > 1
    out["host_staging_bytes"] = pb * shard if staging else 0.0
    if plan.offload == "optimizer+params":
        out["host_param_bytes"] = pb * shard if plan.precision != "fp32" else 0.0
    return out


def _lsp_ledger(plan: Plan) -> dict[str, int]:
    return lsp_memory(
        plan.model,
        lsp_dim=plan.lsp_dim,
        lsp_nonzeros=plan.lsp_nonzeros,
        precision=plan.precision,
        n_microbatches=plan.n_microbatches,
        dp_replicate=plan.dp_replicate,
        dp_shard=plan.dp_shard,
    )


def plan_collectives(plan: Plan, rank: int = 0) -> dict[str, int] | None:
    """The metrics rows' collective counts the stack's rule predicts for pipeline `rank`
    in a step after the first (`stack.residency.predict_collectives`); None under tp > 1,
    whose DTensor shards the rule does not size, or for a schedule `plan.schedule` cannot
    order."""
    if plan.tp > 1:
        return None
    order: list[tuple[str, int]] = []
    if plan.pp > 1:
        try:
            ops = schedule_ops(plan.pp_schedule, plan.pp, plan.n_microbatches, plan.chunks)
        except ConfigError:  # a schedule the planner does not order: not predicted
            return None
        order = [(op.kind, op.stage) for op in ops[rank]]
    return predict_collectives(
        plan.model,
        dp_shard=plan.fsdp_shards,
        zero_stage=plan.zero_stage,
        microbatches=plan.n_microbatches,
        pp=plan.pp,
        schedule=plan.pp_schedule,
        chunks=plan.pp_chunks,
        pp_rank=rank,
        order=order,
        pp_layers=plan.pp_layers,
        param_bytes=DTYPE_BYTES[plan.precision],
        # all-reduced across replicas: HSDP's dp_replicate, or replicate's dp_replicate x cp
        replicas=plan.dp_replicate if plan.fsdp else plan.dp_replicate * plan.cp,
    ).to_dict()
