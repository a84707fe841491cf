"""Step time of a plan on a cluster: compute, memory-bound kernels, collectives, pipeline bubble.

Per micro-batch and pipeline rank (one GPU of the tensor-parallel group):

- matmul time = FLOPs / (dense peak x `matmul_efficiency`). FLOPs come from ModelConfig: the
  rank's blocks / tp, plus the output projection on the last rank (whole on every tp rank unless
  vocab-parallel). Backward is 2x forward; recomputation adds its forward share
  (`ModelConfig.recompute_fraction`, which the runtime's logged HFU uses too): full = one more
  forward of the blocks, every_k = of 1 block in k, selective = of the attention core (QK^T, AV).
- memory-bound time = HBM passes x the bytes the blocks save for backward / HBM bandwidth.
  The saved tensors are the outputs of the norm, RoPE, SiLU/GELU, softmax, dropout and cast
  kernels. Dataflow count: in forward each is written by its producer and read by its consumer
  (`fwd_passes` = 2); in backward it is read once and a gradient of its size is written and read
  (`bwd_passes` = 3); recomputation repeats the forward passes over what it recomputes (all of
  a checkpointed block; the attention core's tensors under selective).
- tensor parallelism: 2 all-reduces in forward and 2 in backward per block of b*s*h activations
  (one per row-wise region of the runtime's TP plan, `TP_REGIONS_PER_BLOCK`)
  (with sequence parallelism an all-gather and a reduce-scatter in place of each, the same
  bytes); recomputed blocks repeat their forward pair. `tp_overlap` of it hidden (default none).
- FSDP (dp_shard > 1), per micro-batch: all-gather the rank's parameters in param_dtype (twice
  for zero_stage 3: forward and backward) and reduce-scatter its gradients in fp32; hidden behind
  the micro-batch's compute up to `dp_overlap` of it. Replicated data parallelism (dp_replicate)
  all-reduces fp32 gradients once per step, overlapping the last micro-batch's backward.
- pipeline: closed form T = (m + p - 1) t (GPipe, 1F1B; bubble (p-1)/(m+p-1)) or
  (m + (p-1)/v) t (interleaved; bubble (p-1)/(v m + p - 1)) with t the slowest rank's
  micro-batch time, plus 2(p v - 1) activation sends on the fill/drain path; or, with
  `simulate=True`, the discrete-event simulator of plan/schedule.py on per-stage costs.
- optimizer: AdamW reads and writes `optimizer_bytes_per_param` per parameter at HBM speed
  (device) or `host_adam_GBps` (offloaded), plus the PCIe transfers, `offload_overlap` hidden.

MFU counts model FLOPs (no recomputation) against the dense peak of the precision's dtype; HFU
counts recomputation too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmscale.config import DTYPE_BYTES
from llmscale.errors import ConfigError
from llmscale.model.config import SP_GATHERED_INPUTS, TP_STYLES
from llmscale.plan import activations as act
from llmscale.plan.cache import Memo
from llmscale.plan.cluster import Cluster
from llmscale.plan.collectives import collective
from llmscale.plan.memory import plan_kernels, plan_stage_params
from llmscale.plan.plan import Plan
from llmscale.plan.schedule import simulate as simulate_schedule

PEAK_DTYPE = {"bf16": "bf16", "fp16": "fp16"}
# The runtime's TP plan (model.config): each block has one tensor-parallel region per row-wise
# linear (attention ending in wo, the MLP in w2). A region all-reduces its output in forward and
# its input's gradient in backward (with SP: all-gathers its input, reduce-scatters its output).
TP_REGIONS_PER_BLOCK = sum(split.style == "rowwise" for split in TP_STYLES.values())
assert len(SP_GATHERED_INPUTS) == TP_REGIONS_PER_BLOCK


@dataclass(frozen=True)
class TimeParams:
    """Efficiency and overlap assumptions, each stated once here."""

    matmul_efficiency: float = 0.7  # achieved / dense peak for the model's GEMMs
    fwd_passes: float = 2.0  # HBM passes over the saved bytes in forward: written, read
    bwd_passes: float = 3.0  # in backward: read, gradient written and read
    tp_overlap: float = 0.0  # share of tensor-parallel collectives hidden behind compute
    dp_overlap: float = 1.0  # share of the overlap window data-parallel traffic can use
    p2p_scatter_gather: bool = False  # Megatron sends 1/tp of each activation across stages
    optimizer_bytes_per_param: float = 28.0  # AdamW foreach, fp32: read p g m v, write p m v
    host_adam_GBps: float = 50.0  # host memory bandwidth the CPU AdamW gets (assumption)
    offload_overlap: float = 0.5  # share of offload transfers and host step hidden
    fp32_matmul: str = "fp32"  # the runtime leaves TF32 off; "tf32" if enabled
    kernels: act.Kernels = act.RUNTIME


DEFAULT_TIME = TimeParams()


@dataclass(frozen=True)
class StepTime:
    """Predicted step: seconds, throughput, utilisation, and where the time goes."""

    plan: Plan
    seconds: float
    tokens_per_s: float
    mfu: float
    hfu: float
    model_flops_per_gpu: float  # per second
    bubble_fraction: float
    stage_fwd: tuple[float, ...]  # per rank, one micro-batch
    stage_bwd: tuple[float, ...]
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per step, critical path


def peak_flops(cluster: Cluster, precision: str, params: TimeParams = DEFAULT_TIME) -> float:
    dtype = PEAK_DTYPE.get(precision, params.fp32_matmul)
    return cluster.gpu.peak_flops(dtype)


def recompute_fraction(plan: Plan) -> float:
    """Share of the blocks' forward FLOPs run again (`ModelConfig.recompute_fraction`)."""
    return plan.model.recompute_fraction(plan.recompute, plan.seq_len, plan.recompute_every_k)


def _per_node(group: int, stride: int, gpus_per_node: int) -> int:
    """Members of a group with rank stride `stride` that share a node (a divisor of group)."""
    if stride >= gpus_per_node:
        return 1
    return math.gcd(group, gpus_per_node // stride)


@dataclass(frozen=True)
class _Stage:
    fwd: float
    bwd: float
    parts: dict[str, float]


_STAGES: Memo[_Stage] = Memo("time.stage_times")


def _stage_times(plan: Plan, rank: int, cluster: Cluster, tp_: TimeParams) -> _Stage:
    """Cached on the fields a stage's micro-batch time depends on (not offload or schedule)."""
    key = (*plan.stage_time_key(), id(cluster), id(tp_), rank)
    compute = lambda: _compute_stage_times(plan, rank, cluster, tp_)  # noqa: E731
    return _STAGES.get(key, compute, (plan.model, cluster, tp_))


def _compute_stage_times(plan: Plan, rank: int, cluster: Cluster, tp_: TimeParams) -> _Stage:
    m, s, b = plan.model, plan.seq_len, plan.micro_batch_size
    tokens = b * s
    tp, kern = plan.tp, plan_kernels(plan, tp_.kernels)
    peak = peak_flops(cluster, plan.precision, tp_) * tp_.matmul_efficiency
    layers = plan.rank_layers(rank)
    modes = plan.block_modes(layers)
    n_blocks = len(layers)
    block_f = m.block_forward_flops_per_token(s) / m.n_layers * tokens / tp
    fwd_flops = n_blocks * block_f
    if rank == plan.pp - 1:
        vocab_div = tp if kern.splits_vocab(m, tp) else 1
        fwd_flops += m.head_forward_flops_per_token() * tokens / vocab_div
    recompute_flops = modes.get("full", 0) * block_f
    if plan.recompute == "selective":
        core = m.attention_core_flops_per_token(s) / m.n_layers
        recompute_flops = n_blocks * core * tokens / tp

    # Memory-bound kernels, through the bytes they leave behind for backward.
    def saved_bytes(mode: str) -> float:
        return act.block_bytes(m, b, s, plan.precision, tp, plan.sequence_parallel, kern, mode)

    saved = n_blocks * saved_bytes("none")
    if plan.recompute == "selective":
        redone = n_blocks * (saved_bytes("none") - saved_bytes("selective"))
    else:
        redone = modes.get("full", 0) * saved_bytes("none")
    if rank == plan.pp - 1:
        saved += act.head_bytes(m, b, s, plan.precision, tp, plan.sequence_parallel, kern)
    hbm = cluster.gpu.hbm_bandwidth
    elem_f = tp_.fwd_passes * saved / hbm
    elem_b = (tp_.bwd_passes * saved + tp_.fwd_passes * redone) / hbm
    # Tensor-parallel collectives (inside a node), per block.
    tp_f = tp_b = 0.0
    if tp > 1:
        act_bytes = DTYPE_BYTES[plan.precision]
        nbytes = tokens * m.dim * act_bytes
        if plan.sequence_parallel:
            one = (
                collective("all_gather", nbytes, tp, tp, cluster.fabric).seconds
                + collective("reduce_scatter", nbytes, tp, tp, cluster.fabric).seconds
            )
        else:
            one = collective("all_reduce", nbytes, tp, tp, cluster.fabric).seconds
        exposed = (1 - tp_.tp_overlap) * one
        tp_f = TP_REGIONS_PER_BLOCK * n_blocks * exposed
        tp_b = TP_REGIONS_PER_BLOCK * (n_blocks + modes.get("full", 0)) * exposed
    mat_f = fwd_flops / peak
    mat_b = (2 * fwd_flops + recompute_flops) / peak
    fwd = mat_f + elem_f + tp_f
    bwd = mat_b + elem_b + tp_b
    parts = {
        "matmul": mat_f + mat_b,
        "elementwise": elem_f + elem_b,
        "tp_comm": tp_f + tp_b,
    }
    # FSDP traffic per micro-batch, hidden behind its compute up to dp_overlap of it.
    if plan.fsdp:
        sp = plan_stage_params(plan, rank, kern)
        pb = DTYPE_BYTES[plan.precision]
        per_node = _per_node(plan.dp_shard, tp, cluster.gpus_per_node)
        gathers = 2 if plan.zero_stage == 3 else 1
        ag = collective("all_gather", pb * sp.numel, plan.dp_shard, per_node, cluster.fabric)
        rs = collective("reduce_scatter", 4 * sp.numel, plan.dp_shard, per_node, cluster.fabric)
        comm = gathers * ag.seconds + rs.seconds
        exposed = max(0.0, comm - tp_.dp_overlap * (fwd + bwd))
        parts["fsdp_comm"] = exposed
        bwd += exposed
    return _Stage(fwd, bwd, parts)


def _p2p_seconds(plan: Plan, cluster: Cluster, tp_: TimeParams) -> float:
    if plan.pp == 1:
        return 0.0
    nbytes: float = (
        plan.micro_batch_size * plan.seq_len * plan.model.dim * DTYPE_BYTES[plan.precision]
    )
    if plan.sequence_parallel or tp_.p2p_scatter_gather:
        nbytes /= plan.tp
    stride = plan.tp * plan.dp  # pipeline stages are the outermost mesh dimension
    per_node = 2 if stride < cluster.gpus_per_node else 1
    return collective("p2p", nbytes, 2, per_node, cluster.fabric).seconds


def estimate_step_time(
    plan: Plan,
    cluster: Cluster,
    params: TimeParams = DEFAULT_TIME,
    simulate: bool = False,
    ranks: tuple[int, ...] | None = None,
    validate: bool = True,
) -> StepTime:
    """Seconds per optimizer step of `plan` on `cluster` (validated first unless `validate` is
    False). `ranks` limits the stages computed, the others taken as the first one's (the
    search's first and last; ignored when simulating)."""
    if validate:
        plan.validate()
        if plan.tp > cluster.gpus_per_node:
            raise ConfigError("parallel.tp", plan.tp, f"<= GPUs per node = {cluster.gpus_per_node}")
    tparams = params
    todo = ranks if ranks is not None and not simulate else tuple(range(plan.pp))
    computed = {r: _stage_times(plan, r, cluster, tparams) for r in todo}
    stages = [computed.get(r, computed[todo[0]]) for r in range(plan.pp)]
    m_, p, v = plan.microbatches, plan.pp, plan.chunks
    t_p2p = _p2p_seconds(plan, cluster, tparams)
    slow = max(stages, key=lambda st: st.fwd + st.bwd)
    t = slow.fwd + slow.bwd
    if p == 1:
        pipe, bubble, p2p_total = m_ * t, 0.0, 0.0
    elif simulate:
        costs_f = [stages[g % p].fwd / v for g in range(p * v)]
        costs_b = [stages[g % p].bwd / v for g in range(p * v)]
        res = simulate_schedule(plan.pp_schedule, p, m_, v, costs_f, costs_b, t_p2p)
        busy = m_ * t
        pipe, bubble, p2p_total = res.makespan, res.bubble_fraction, 0.0
        pipe = max(pipe, busy)
    else:
        extra = (p - 1) if plan.pp_schedule != "interleaved_1f1b" else (p - 1) / v
        pipe = (m_ + extra) * t
        bubble = extra / (m_ + extra)
        p2p_total = 2 * (p * v - 1) * t_p2p
    breakdown = {k: m_ * val for k, val in slow.parts.items()}
    breakdown["bubble"] = pipe - m_ * t
    breakdown["pp_p2p"] = p2p_total
    # Replicated data parallelism: one fp32 all-reduce of the (sharded) gradients per step.
    m = plan.model
    # The first and last ranks hold the embedding and the head on top of their blocks (and,
    # split unevenly, the first ranks the most blocks).
    worst_params = max(plan_stage_params(plan, r, tparams.kernels).shard_numel for r in {0, p - 1})
    dp_sync = 0.0
    if plan.dp_replicate > 1:
        stride = plan.tp * plan.dp_shard
        per_node = _per_node(plan.dp_replicate, stride, cluster.gpus_per_node)
        ar = collective("all_reduce", 4 * worst_params, plan.dp_replicate, per_node, cluster.fabric)
        dp_sync = max(0.0, ar.seconds - tparams.dp_overlap * slow.bwd)
    breakdown["dp_comm"] = dp_sync
    # Optimizer step.
    hbm = cluster.gpu.hbm_bandwidth
    if plan.offload == "none":
        opt = tparams.optimizer_bytes_per_param * worst_params / hbm
    else:
        pb = DTYPE_BYTES[plan.precision]
        link = cluster.host_link.bandwidth
        transfers = 2 * pb * worst_params / link  # gradients down, parameters up
        if plan.fsdp_cpu_offload:
            transfers = 4 * worst_params / link  # fp32 gradient shards down; uploads below
        host = tparams.optimizer_bytes_per_param * worst_params / (tparams.host_adam_GBps * 1e9)
        opt = (1 - tparams.offload_overlap) * (transfers + host)
        if plan.offload == "optimizer+params":
            # Every micro-batch uploads the parameters for forward and again for backward
            # (under FSDP2's CPUOffloadPolicy: the fp32 shards, before each all-gather).
            up_bytes = 4 if plan.fsdp_cpu_offload else pb
            regather = not plan.fsdp_cpu_offload or (plan.fsdp and plan.zero_stage == 3)
            gathers = 2 if regather else 1
            upload = m_ * gathers * up_bytes * worst_params / link
            opt += max(0.0, upload - tparams.offload_overlap * pipe)
    breakdown["optimizer"] = opt
    seconds = pipe + p2p_total + dp_sync + opt
    tokens = plan.tokens_per_step
    peak = peak_flops(cluster, plan.precision, tparams)
    model_flops = m.train_flops_per_token(plan.seq_len) * tokens
    hw_flops = m.train_flops_per_token(plan.seq_len, recompute_fraction(plan)) * tokens
    world = plan.world_size
    return StepTime(
        plan=plan,
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        mfu=model_flops / (seconds * world * peak),
        hfu=hw_flops / (seconds * world * peak),
        model_flops_per_gpu=model_flops / (seconds * world),
        bubble_fraction=bubble,
        stage_fwd=tuple(st.fwd for st in stages),
        stage_bwd=tuple(st.bwd for st in stages),
        breakdown=breakdown,
    )
