"""Entry points for the rest of llmscale: predictions from a JobConfig (or a Plan) and hardware.

    from llmscale.plan.predict import predict_memory, predict_step_time, expected_runtime_metrics
    mem = predict_memory(job)                       # MemoryEstimate, per pipeline stage
    step = predict_step_time(job, "h200")           # StepTime: seconds, tokens/s, MFU, breakdown
    want = expected_runtime_metrics(job, rank=0)    # the trainer's metric names -> bytes

`expected_runtime_metrics` speaks the runtime's own vocabulary (train/metrics.py and the
`SavedActivations` counter): `param_bytes`, `grad_bytes`, `optimizer_bytes` (Adam moments and
`step` counters), `activation_bytes` (what autograd saves for the first micro-batch, which under
autocast includes the bf16 weight casts the linears keep), and `cuda_peak_bytes` (the predicted
torch.cuda.max_memory_allocated over a step); under optimizer+params also
`device_param_peak_bytes` (the most parameter bytes the device held at once).
"""

from __future__ import annotations

from llmscale.config import JobConfig
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import (
    DEFAULT_OPTIONS,
    PARAM_DTYPE_BYTES,
    MemoryEstimate,
    MemoryOptions,
    _block_modes,
    _rank_layers,
    _rank_pieces,
    estimate_memory,
    param_window,
    plan_kernels,
)
from llmscale.plan.params import stage_params
from llmscale.plan.setup import Plan
from llmscale.plan.time import DEFAULT_TIME, StepTime, TimeParams, estimate_step_time


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
    params, grads, optim, _working, _acts, _transient, _host = _rank_pieces(plan, rank, options)
    m, b, s = plan.model, plan.micro_batch_size, plan.seq_len
    k = plan_kernels(plan, options.kernels)
    modes = _block_modes(plan, _rank_layers(plan, rank))
    saved = sum(
        n * act.block_bytes(m, b, s, plan.precision, plan.tp, plan.sequence_parallel, k, mode)
        for mode, n in modes.items()
    )
    if rank == 0:
        saved += sum(t.nbytes for t in act.embedding_tensors(b, s))
    if rank == plan.pp - 1:
        saved += act.head_bytes(m, b, s, plan.precision, plan.tp, plan.sequence_parallel, k)
    casts_kept = plan.precision != "fp32" and not plan.sharded and plan.offload == "none"
    if casts_kept:
        sp = stage_params(m, plan.tp, plan.pp, rank, plan.dp_shard, k.vocab_parallel)
        live_blocks = modes.get("none", 0) + modes.get("selective", 0)
        saved += 2.0 * live_blocks * sp.block.saved_cast_numel
        saved += 2.0 * sum(g.saved_cast_numel for g in sp.root)
    peak = estimate_memory(plan, options).stages[rank].allocated
    if plan.offload != "none":
        # The optimizer states live on the host; the metric counts them wherever they are.
        optim = _host_optimizer_bytes(plan, rank, options)
    out = {
        "param_bytes": params,
        "grad_bytes": grads,
        "optimizer_bytes": optim,
        "activation_bytes": saved,
        "cuda_peak_bytes": peak,
    }
    if plan.offload == "optimizer+params" and not plan.fsdp_cpu_offload:
        # The offloaded optimizer's own count of the parameters it held on the device at once.
        sp = stage_params(m, plan.tp, plan.pp, rank, plan.dp_shard, k.vocab_parallel)
        pb = PARAM_DTYPE_BYTES[plan.precision]
        out["device_param_peak_bytes"] = pb * param_window(plan, sp, options.prefetch_blocks)
    return out


def _host_optimizer_bytes(plan: Plan, rank: int, options: MemoryOptions) -> float:
    sp = stage_params(
        plan.model, plan.tp, plan.pp, rank, plan.dp_shard, options.kernels.vocab_parallel
    )
    shard = sp.shard_numel if plan.sharded else sp.numel
    return 8.0 * shard + 4.0 * sp.tensors
