"""Step time of a plan on a cluster: compute, memory-bound kernels, collectives, pipeline bubble.

What the GPU achieves comes from its catalog calibration (`hardware.catalog.Calibration`, one
per GPU, every number sourced); the training stack's facts from its record (`llmscale.stack`,
through `time_params(stack)`). Per micro-batch and pipeline rank (one GPU of the tensor-parallel group):

- GEMMs: each linear of the rank's blocks (`block_gemms`: M = tokens, N and K split by tp as the
  runtime's TP plan splits them) at the calibrated efficiency for its shape,
  `gemm_efficiency * d / (d + gemm_half_dim)` with d the geometric mean of M, N, K; backward is
  the same shapes twice. The output projection runs on the last rank, its vocabulary divided
  by tp when the head is vocabulary-parallel. A flat `TimeParams.matmul_efficiency` (a device
  measured by `llmscale bench`) replaces the curve.
- fp8 (torchao's float8 training): the blocks' linears at the GPU's FP8 dense peak and its own
  `fp8_gemm_efficiency` (same size curve), plus the casts torchao adds, memory-bound
  (`fp8_cast_bytes`: amax and cast of each linear's input and weight in forward, of its output
  gradient in backward, and the transposed float8 copies the backward GEMMs take; compiled,
  the linears reading one tensor cast it once); attention,
  the output projection and everything else in bf16, and MFU against the bf16 peak. A GPU
  without an FP8 peak refuses the plan (`check_matmul_precision`). The other float8 recipes
  (`FLOAT8_RECIPES`) add their own: torchao's rowwise ones a slower forward GEMM and rescaled
  backward outputs; TransformerEngine's MXFP8 one quantisation pass per operand into both
  copies and its GEMMs at the stack's share of the FP8 rate (`Stack.float8_gemm_shares`), on
  block-scaled tensor cores only.
- nvfp4 (TransformerEngine's NVFP4 recipe, as Megatron-Core runs it): the blocks' linears'
  forward, data-gradient and weight-gradient GEMMs at the GPU's FP4 dense peak and its
  `fp4_gemm_efficiency`, plus the recipe's quantisations, memory-bound (`nvfp4_cast_bytes`:
  a per-tensor amax, the amax of the Hadamard-transformed tensor for the weight gradient, and
  one pass writing both the row-wise and the transformed column-wise 4-bit copies, of each
  linear's input and output gradient; weights in 16 x 16 blocks, once per step); the rest as
  fp8. A GPU without an FP4 peak refuses it.
- attention core (QK^T, AV): a flash kernel executes half of the s x s products under causal
  masking, and its backward 2.5x its forward (it recomputes QK^T), at the calibrated
  flash-attention efficiency; a materialised softmax (Megatron 2021/2022, the math kernel)
  computes all of s x s as batched GEMMs (backward 2x).
- recomputation adds forward work: full = the whole block again; selective = the attention core
  (llmscale, Megatron) or, with `selective_policy = "op"` (torchtitan's op-level SAC), the
  matmuls whose outputs were not saved (every other one) and every element-wise op.
- memory-bound kernels at `hbm_efficiency` of the datasheet bandwidth, by `elementwise`:
  "llmscale" (this runtime, eager: one kernel per op) moves the bytes of its own element-wise
  ops (`runtime_eager_block_bytes`: norms, autocast casts, RoPE in fp32, the attention output's
  copy, SwiGLU, residual adds, the weights' casts); "torchtitan" those of torchtitan's eager
  Llama (`eager_block_bytes`), or with `compiled` those of torch.compile's fused kernels
  (`compiled_block_bytes`); "saved" (fused kernels, Megatron) HBM passes x the bytes the
  blocks save for backward (in forward each is written and read, `fwd_passes` = 2; in backward
  read, and a gradient of its size written and read, `bwd_passes` = 3). The head's logits and
  loss are priced by the saved-bytes passes in every mode. Backward moves twice a forward's
  element-wise bytes. Plus the stack's fixed cost per micro-batch on the device
  (`Stack.microbatch_overhead_ms`, per-op dispatch where the host waits for each op: a CPU),
  in proportion to the rank's blocks (a third in forward, two in backward; a recomputed
  block's forward dispatched again).
- context parallelism (cp > 1), ring attention as torch's `context_parallel` runs it: each rank
  holds s / cp of every sequence (load-balanced), so its linears, element-wise kernels, TP
  collectives and pipeline sends see b s / cp tokens and its attention 1/cp of the causal
  FLOPs; per attention call, cp - 1 ring steps each pass a K and V chunk (backward: K, V and
  their gradients) to the next cp rank beside 1/cp of the attention (`_ring_attention_seconds`;
  torch's ring traced into compiled blocks waits for each transfer: `compiled_ring_waits`).
  FSDP shards over dp_shard x cp (`Plan.fsdp_shards_for`); without FSDP the cp ranks all-reduce
  their gradients with the replicas.
- the loss under tensor parallelism: vocabulary-parallel (torch's loss_parallel) it all-reduces
  three values per token (max, sum of exponentials, target logit) and gathers no logits; a
  vocabulary-parallel head without it all-gathers the logits (`_loss_comm_seconds`).
- tensor parallelism: 2 all-reduces in forward and 2 in backward per block of b*s*h activations
  (one per row-wise region of the runtime's TP plan, `TP_REGIONS_PER_BLOCK`; with sequence
  parallelism an all-gather and a reduce-scatter in place of each); recomputed blocks repeat
  their forward pair, op-level SAC the collectives it does not keep (the all-gathers or
  all-reduces: `OP_SAC_SAVED_COLLECTIVES`); a stack that overlaps them with GEMMs hides each
  behind the GEMMs it feeds or drains (`_tp_block_seconds`); under float8 torchtitan gathers
  1-byte casts (`Kernels.fp8_all_gathers`); `tp_overlap` of it hidden (default none).
- FSDP (dp_shard > 1), per unit (block): its all-gather is prefetched one unit ahead behind the
  previous unit's compute, the first one exposed (forward, and backward under zero_stage 3);
  gradients are reduce-scattered per unit behind the next unit's backward, sharing that window
  with the all-gathers, the last one exposed. Hidden traffic still costs (1 - `dp_overlap`) of
  its time (NCCL takes SMs and HBM bandwidth from the compute it overlaps). Under gradient
  accumulation the runtime syncs gradients on the last micro-batch only (`grad_sync_once`):
  the reduce-scatter, and replicated data parallelism's all-reduce, are paid once per step.
- pipeline: closed form T = (m + p - 1) t (GPipe, 1F1B; bubble (p-1)/(m+p-1)) or
  (m + (p-1)/v) t (interleaved; bubble (p-1)/(v m + p - 1)) with t the slowest rank's
  micro-batch time; the zero-bubble schedules (zero_bubble, zbv, dualpipev) m t plus their
  papers' idle time (`plan.schedule.bubble_time`) with W the rank's weight-gradient GEMMs
  (dW = X^T dY, half of the blocks' backward GEMMs, and the head's) and B the rest of its
  backward; plus 2(p v - 1) activation sends (one fewer hop in a V) on the real link (NVLink
  inside a node, the NIC across) on the fill/drain path; or, with `simulate=True`, the
  discrete-event simulator of plan/schedule.py on per-stage costs, F, B and W apart.
- optimizer: AdamW reads and writes `optimizer_bytes_per_param` per parameter at the achieved
  optimizer bandwidth (`Stack.optimizer_share` of the datasheet's; device) or
  `host_adam_GBps` (offloaded), plus the PCIe transfers,
  `offload_overlap` hidden; under offload "lsp" the bytes it moves (`plan/offload_traffic.py`)
  and the host AdamW over the ZeRO path's parameters and each block matrix's d x d subspace
  (the device's projections are not priced). Plus the stack's fixed cost per step on the
  device (`Stack.step_overhead_ms`).

MFU counts model FLOPs (no recomputation, attention as Narayanan et al. count it) against the
dense peak of the precision's dtype; HFU counts recomputation too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from llmscale.config import DTYPE_BYTES, FP8_MATMUL_BYTES, NVFP4_MATMUL_BYTES
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import Calibration
from llmscale.model.config import (
    OP_SAC_SAVED_COLLECTIVES,
    SP_GATHERED_INPUTS,
    TP_STYLES,
    ModelConfig,
    op_sac_saves_matmul,
    split_layers,
    stage_ids,
)
from llmscale.plan import activations as act
from llmscale.plan.cache import Memo, memoize, memoize_values
from llmscale.plan.cluster import Cluster
from llmscale.plan.collectives import collective
from llmscale.plan.lsp import host_adam_numel
from llmscale.plan.memory import model_weight_bytes, plan_rank_params
from llmscale.plan.offload_traffic import offload_traffic
from llmscale.plan.plan import Plan
from llmscale.plan.schedule import (
    MAX_STAGE_MICROBATCHES,
    bubble_time,
    idle_slots,
    rank_actions,
)
from llmscale.plan.schedule import simulate as simulate_schedule
from llmscale.plan.work import (
    RankWork,
    block_linears,
    cp_share,
    cp_tokens,
    plan_kernels,
    rank_work,
    slice_args,
)
from llmscale.stack import LLMSCALE, Stack, param_residency
from llmscale.stack.residency import few_stage_gathers, pipeline_gathers

PEAK_DTYPE = {"bf16": "bf16", "fp16": "fp16"}
ELEMENTWISE_MODELS = ("llmscale", "torchtitan", "saved")
# The runtime's TP plan (model.config): each block has one tensor-parallel region per row-wise
# linear (attention ending in wo, the MLP in w2). A region all-reduces its output in forward and
# its input's gradient in backward (with SP: all-gathers its input, reduce-scatters its output).
TP_REGIONS_PER_BLOCK = sum(split.style == "rowwise" for split in TP_STYLES.values())
assert len(SP_GATHERED_INPUTS) == TP_REGIONS_PER_BLOCK


@dataclass(frozen=True)
class TimeParams:
    """Modelling choices that are not the GPU's (those are its `Calibration`), stated once."""

    # None: the GPU's calibration (GEMM efficiency by shape, flash-attention efficiency); a
    # number: that flat share of peak for every GEMM and the attention core (a measured device).
    matmul_efficiency: float | None = None
    fwd_passes: float = 2.0  # HBM passes over the saved bytes in forward: written, read
    bwd_passes: float = 3.0  # in backward: read, gradient written and read
    tp_overlap: float = 0.0  # share of tensor-parallel collectives hidden behind compute
    # Overlap efficiency of data-parallel traffic: a collective hidden behind compute still
    # costs (1 - dp_overlap) of its time (NCCL kernels take SMs and HBM bandwidth from the
    # compute they overlap); 0 = nothing hidden.
    dp_overlap: float = 0.85
    p2p_scatter_gather: bool = False  # Megatron sends 1/tp of each activation across stages
    optimizer_bytes_per_param: float = 28.0  # AdamW foreach, fp32: read p g m v, write p m v
    host_adam_GBps: float = 50.0  # host memory bandwidth the CPU AdamW gets (assumption)
    offload_overlap: float = 0.5  # share of offload transfers and host step hidden
    fp32_matmul: str = "fp32"  # the runtime leaves TF32 off; "tf32" if enabled
    kernels: act.Kernels = act.RUNTIME
    # Gradients reduced once per step (FSDP2 / replicate with `set_requires_gradient_sync`
    # off on all but the last micro-batch, as the llmscale runtime does); False: every one.
    grad_sync_once: bool = True
    step_overhead: bool = True  # add the stack's fixed per-step cost on the device
    # How element-wise traffic is counted: "llmscale" (this runtime's eager ops,
    # `runtime_eager_block_bytes`), "torchtitan" (its eager Llama without torch.compile:
    # composite RMSNorm, complex RoPE in fp32, silu and mul apart; `eager_block_bytes`) or
    # "saved" (fused kernels: HBM passes over the bytes saved for backward, Megatron).
    elementwise: str = "llmscale"
    # Regional compilation (train.compile, `llmscale plan --compile`): each block's element-wise
    # ops run as the fused kernels torch.compile generates (`compiled_block_bytes`), instead of
    # one kernel per eager op; the head and loss stay eager; "saved" is fused already.
    compiled: bool = False
    # Tensor-parallel collectives run beside the GEMMs they feed (Megatron-Core's TP
    # communication overlap): exposed only where they outlast them.
    tp_overlap_gemm: bool = False
    # The training stack: when parameters are gathered and gradients reduced
    # (`stack.param_residency`). The fields above that a stack sets come from it through
    # `time_params(stack)`.
    stack: Stack = LLMSCALE

    def with_stack(self, stack: Stack) -> TimeParams:
        """These parameters on `stack` (the same stack priced on a measured device, say), every
        field a stack sets following it (`time_params` builds on this)."""
        return replace(
            self,
            dp_overlap=stack.dp_overlap,
            p2p_scatter_gather=stack.p2p_scatter_gather,
            optimizer_bytes_per_param=stack.optimizer_bytes_per_param,
            grad_sync_once=stack.grad_sync_once,
            elementwise=stack.elementwise,
            tp_overlap_gemm=stack.tp_overlap_gemm,
            stack=stack,
        )


DEFAULT_TIME = TimeParams()


def time_params(
    stack: Stack, kernels: act.Kernels | None = None, compiled: bool = False
) -> TimeParams:
    """The time model's parameters for `stack` (`kernels`: a measured device's instead)."""
    own = stack.kernels_for(compiled) if kernels is None else kernels
    return TimeParams(kernels=own, compiled=compiled).with_stack(stack)


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
    """The dense peak the plan's bf16/fp16/fp32 work runs at, and MFU's denominator. Under fp8
    and nvfp4 that is the bf16 peak (only the linears run in FP8 or FP4; torchtitan and
    Megatron-Bridge report MFU and model TFLOP/s on it too)."""
    return cluster.gpu.peak_flops(work_peak_dtype(precision, params.fp32_matmul))


def work_peak_dtype(precision: str, fp32_matmul: str = "fp32") -> str:
    """The dense peak everything but the low-precision linears runs at in `precision`: bf16
    under fp8 and nvfp4, else the precision's own (`fp32_matmul` for fp32)."""
    return "bf16" if precision in LOWP_MATMUL_PEAK else PEAK_DTYPE.get(precision, fp32_matmul)


# The precisions whose linears run on narrower tensor cores, to the peak they run at.
LOWP_MATMUL_PEAK = {"fp8": "fp8", "nvfp4": "fp4"}


def matmul_peak_dtype(precision: str, fp32_matmul: str = "fp32") -> str:
    """The dense peak a step's linears run at in `precision` (the roofline's ridge point):
    FP8 or FP4 under fp8 and nvfp4, else the precision's own (`fp32_matmul` for fp32)."""
    return LOWP_MATMUL_PEAK.get(precision) or PEAK_DTYPE.get(precision, fp32_matmul)


def check_matmul_precision(
    precision: str, cluster: Cluster, float8_recipe: str = "tensorwise"
) -> None:
    """Refuse precision fp8 (nvfp4) on a GPU without an FP8 (FP4) peak and its calibration
    (ConfigError naming the precisions it has), and a block-scaled float8 recipe (mxfp8) on a
    GPU without block-scaled tensor cores (those of the parts with an FP4 peak)."""
    gpu = cluster.gpu
    peak = LOWP_MATMUL_PEAK.get(precision)
    if peak is None:
        return
    cost = FLOAT8_RECIPES.get(float8_recipe)
    if precision == "fp8" and cost is not None and cost.block_scaled and "fp4" not in gpu.dtypes:
        raise ConfigError(
            "float8_recipe", float8_recipe, f"a recipe without block scales on {gpu.name} (its "
            "tensor cores take none: MXFP8 runs on the parts with an FP4 peak, llmscale hw)",
        )  # fmt: skip
    cal = gpu.calibration
    if peak not in gpu.dense_TFLOPS or cal.lowp_gemm_efficiency(peak) is None:
        has = [p for p in ("fp32", "bf16", "fp16") if PEAK_DTYPE.get(p, "fp32") in gpu.dtypes]
        has += [
            p for p, d in LOWP_MATMUL_PEAK.items()
            if d in gpu.dtypes and cal.lowp_gemm_efficiency(d) is not None
        ]  # fmt: skip
        allowed = " | ".join(has) if has else f"a GPU with {peak.upper()} tensor cores"
        raise ConfigError(
            "precision", precision, f"{allowed} on {gpu.name} (no {peak.upper()} tensor "
            f"cores or {peak.upper()} calibration in the catalog)",
        )  # fmt: skip


def recompute_fraction(plan: Plan) -> float:
    """Share of the blocks' forward FLOPs run again (`ModelConfig.recompute_fraction`)."""
    return _recompute_fraction(plan.model, plan.recompute, plan.seq_len, plan.recompute_every_k)


@memoize
def _recompute_fraction(model: ModelConfig, mode: str, seq_len: int, every_k: int) -> float:
    """`recompute_fraction`'s answer, kept (every plan the search times asks it)."""
    return model.recompute_fraction(mode, seq_len, every_k)


def _per_node(group: int, stride: int, gpus_per_node: int) -> int:
    """Members of a group with rank stride `stride` that share a node (a divisor of group)."""
    if stride >= gpus_per_node:
        return 1
    return math.gcd(group, gpus_per_node // stride)


@dataclass(frozen=True)
class _RankTimes:
    fwd: float
    bwd: float
    parts: dict[str, float]
    sync: float = 0.0  # FSDP gradient reduce-scatter exposed once per step
    # The weight-gradient GEMMs (dW = X^T dY) of `bwd`: what the zero-bubble schedules run
    # apart as W ops; the rest of `bwd` is their B.
    wgrad: float = 0.0


_RANK_TIMES: Memo[_RankTimes] = Memo("time.rank_times")


def _rank_times(plan: Plan, rank: int, cluster: Cluster, tp_: TimeParams) -> _RankTimes:
    """Cached on the fields a stage's micro-batch time depends on (not offload or schedule)."""
    key = (*plan.stage_time_key(), id(cluster), id(tp_), rank)
    compute = lambda: _compute_rank_times(plan, rank, cluster, tp_)  # noqa: E731
    return _RANK_TIMES.get(key, compute, (plan.model, cluster, tp_))


def block_gemms(plan: Plan) -> list[tuple[int, int, int]]:
    """(M, N, K) of one block's forward GEMMs on one tensor-parallel rank (`block_linears`)."""
    return [lin.mnk for lin in block_linears(plan)]


def tp_region_gemm_seconds(
    plan: Plan, cluster: Cluster, peak: float, flat: float | None
) -> list[tuple[float, float]]:
    """Seconds of one block's forward GEMMs per tensor-parallel region (attention, MLP), as
    (column-parallel, row-parallel): the GEMMs a region's all-gather feeds and the one its
    reduce-scatter drains (`TP_STYLES`)."""
    return [
        (
            _linear_seconds(plan, cols, cluster, peak, flat),
            _linear_seconds(plan, rows, cluster, peak, flat),
        )
        for cols, rows in _tp_regions(plan)
    ]


def _tp_regions(plan: Plan) -> list[tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]]:
    """One block's GEMMs (M, N, K) per tensor-parallel region, in the block's order, as
    (column-parallel, row-parallel)."""
    regions: dict[str, tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}
    for lin in block_linears(plan):
        cols, rows = regions.setdefault(lin.region, ([], []))
        (cols if lin.colwise else rows).append(lin.mnk)
    return list(regions.values())


def tp_overlaps_gemms(plan: Plan, tp_: TimeParams) -> bool:
    """Does the stack run this plan's TP collectives beside the GEMMs they feed
    (`TimeParams.tp_overlap_gemm`), in the plan's precision (`Stack.tp_overlap_off_under`)?"""
    return tp_.tp_overlap_gemm and plan.precision not in tp_.stack.tp_overlap_off_under


def _micro_pipelined(plan: Plan, tp_: TimeParams) -> bool:
    """Does the stack run this plan's TP collectives as torch's micro-pipelined ("async") TP
    (`Stack.tp_overlap_chunks`, only under sequence parallelism at tp > 1)?"""
    return (
        plan.tp > 1
        and plan.sequence_parallel
        and tp_overlaps_gemms(plan, tp_)
        and tp_.stack.tp_overlap_chunks
    )


def tp_chunked_gemm_seconds(
    plan: Plan, cluster: Cluster, tp_: TimeParams, peak: float, flat: float | None
) -> float:
    """What one block's forward GEMMs lose when a stack runs the overlapped ones as tp row
    chunks (`Stack.tp_overlap_chunks`: torch's micro-pipelined TP): every linear a sequence-
    parallel all-gather feeds or a reduce-scatter drains is tp GEMMs of M / tp tokens, each
    lower on the GEMM size curve than the whole. The backward's input-gradient GEMMs (the same
    shapes transposed, beside the mirrored collectives) lose as much; 0 where the stack does
    not chunk, without sequence parallelism, or at tp 1."""
    tp = plan.tp
    if not _micro_pipelined(plan, tp_):
        return 0.0
    whole = [lin.mnk for lin in block_linears(plan)]
    chunks = [(max(1, m // tp), n, k) for m, n, k in whole]
    chunked = tp * _linear_seconds(plan, chunks, cluster, peak, flat)
    return chunked - _linear_seconds(plan, whole, cluster, peak, flat)


def _linear_seconds(
    plan: Plan,
    shapes: list[tuple[int, int, int]],
    cluster: Cluster,
    peak: float,
    flat: float | None,
) -> float:
    """The blocks' linears (M, N, K): at the bf16/fp16/fp32 `peak`, under fp8 (torchao's
    float8 linears) at the GPU's FP8 peak and its own calibrated efficiency, under nvfp4 at its
    FP4 peak and FP4 efficiency."""
    cal = cluster.gpu.calibration
    lowp = LOWP_MATMUL_PEAK.get(plan.precision)
    if lowp is None:
        return gemm_seconds(shapes, peak, cal, flat)
    lowp_peak = cluster.gpu.peak_flops(lowp)
    return sum(2.0 * m * n * k / (lowp_peak * cal.lowp_gemm_efficiency_at(lowp, m, n, k))
               for m, n, k in shapes)  # fmt: skip


# A weight kept in FP8 (`Stack.fp8_params`) is not cast per micro-batch; backward reads it
# and writes its transposed FP8 copy for the input-gradient GEMM (1 + 1 B per element).
FP8_PARAM_TRANSPOSE_BYTES = 1 + 1


@dataclass(frozen=True)
class Float8RecipeCost:
    """What one float8 recipe (`precision.float8_recipe`: torchao's three, TransformerEngine's
    MXFP8) costs beyond the per-tensor-scaled FP8 GEMM (`fp8_gemm_efficiency`): HBM bytes per
    element of its casts of a linear's input (x), weight (w) and output gradient (go), in
    forward and in backward; the share of that GEMM's rate its forward GEMM reaches; which
    backward GEMMs rescale their output afterwards (read and write it, 2 + 2 B per element),
    and whether the weight gradient's GEMM runs in bf16."""

    fwd_x: float
    fwd_w: float
    bwd_x: float
    bwd_w: float
    bwd_go: float
    fwd_gemm_share: float = 1.0
    rescaled_backward: tuple[str, ...] = ()  # "dgrad", "wgrad"
    wgrad_bf16: bool = False
    # Backward's bytes per element of a weight kept in float8 between steps
    # (`Stack.fp8_params`): the transposed copy the input-gradient GEMM takes.
    fp8_param_bwd: float = FP8_PARAM_TRANSPOSE_BYTES
    # Its operands carry block scales, which only block-scaled tensor cores take (Blackwell's:
    # a GPU with an FP4 peak).
    block_scaled: bool = False


# torchao's rowwise GEMM (torch._scaled_mm with a scale per row of A and per column of B, fast
# accumulation: CUTLASS's kernel on Hopper) against the per-tensor cuBLAS one: "most shapes are
# within 90-100% of tensor-wise efficiency, but there's a long tail going down to 50%"
# (pytorch/pytorch#147971, 2025-02-26, H100); the middle of the bulk.
ROWWISE_GEMM_SHARE = 0.95
# The backward GEMMs run without fast accumulation, for which torchao calls the per-tensor
# cuBLAS GEMM with unit scales and multiplies the output by the row and column scales
# afterwards (torchao/float8/float8_ops.py `addmm_float8_unwrapped`: "The rowwise CUTLASS-based
# kernel is so slow without fast-accum that we'd rather use the tensorwise cuBLAS-based kernel
# and do the scaling manually afterwards"): one more pass over each such output.
RESCALE_BYTES = 2 + 2

# TransformerEngine's MXFP8 quantisation of one bf16 tensor (MXFP8Quantizer with row-wise and
# column-wise usage; the OCP MX v1.0 spec's MXFP8: E4M3 values with an E8M0 scale per 32
# elements), bytes per element: one pass reading it (2) and writing both copies, 1 x 32 blocks
# along the rows and 32 x 1 along the columns (1 + 1/32 each). Block scales need no amax pass.
MXFP8_CAST_BYTES = 2 + 2 * (1 + 1 / 32)

FLOAT8_RECIPES: dict[str, Float8RecipeCost] = {
    # Each cast reads its bf16 tensor for the absolute maximum (2), then reads it again and
    # writes float8 (2 + 1); forward casts input and weight, backward the output gradient, and
    # writes the transposed float8 copies of all three that the backward GEMMs take (1 + 1).
    "tensorwise": Float8RecipeCost(fwd_x=5, fwd_w=5, bwd_x=2, bwd_w=2, bwd_go=7),
    # torchao's own roofline accounting of its rowwise casts (torchao/testing/training/
    # roofline_utils.py `get_tensor_memory_traffic_ovhd_s` at 36027d8): an activation is read
    # once, written as row-scaled float8 and as a transposed bf16 copy (2 + 1 + 2), which
    # backward reads and casts along the other dimension (2 + 1); a weight is cast (2 + 1),
    # transposed (2 + 2) and cast again (2 + 1).
    "rowwise": Float8RecipeCost(
        fwd_x=5,
        fwd_w=3,
        bwd_x=3,
        bwd_w=7,
        bwd_go=8,
        fwd_gemm_share=ROWWISE_GEMM_SHARE,
        rescaled_backward=("dgrad", "wgrad"),
    ),  # fmt: skip
    # Rowwise forward; the input gradient from the row-scaled output gradient and a per-tensor
    # cast of the weight; the weight gradient in bf16 from the saved bf16 tensors (same source).
    "rowwise_with_gw_hp": Float8RecipeCost(
        fwd_x=3,
        fwd_w=3,
        bwd_x=0,
        bwd_w=3,
        bwd_go=3,
        fwd_gemm_share=ROWWISE_GEMM_SHARE,
        rescaled_backward=("dgrad",),
        wgrad_bf16=True,
    ),  # fmt: skip
    # TransformerEngine's MXFP8 block scaling: forward quantises each linear's input and weight
    # into both copies at once (`MXFP8_CAST_BYTES`), backward the output gradient; the
    # column-wise copies the backward GEMMs take were written then, so nothing is cast or
    # transposed again, an FP8 weight included (it holds both). Its GEMMs' share of the FP8
    # rate is the stack's (`Stack.float8_gemm_shares`).
    "mxfp8": Float8RecipeCost(
        fwd_x=MXFP8_CAST_BYTES,
        fwd_w=MXFP8_CAST_BYTES,
        bwd_x=0,
        bwd_w=0,
        bwd_go=MXFP8_CAST_BYTES,
        fp8_param_bwd=0,
        block_scaled=True,
    ),  # fmt: skip
}


def fp8_cast_bytes(
    plan: Plan, compiled: bool = False, fp8_params: bool = False
) -> tuple[float, float]:
    """HBM bytes of torchao's float8 casts around one block's linears (forward, backward), by
    the plan's recipe (`FLOAT8_RECIPES`). Run eagerly, every linear casts its own input;
    compiled (`compiled`), the linears reading one tensor (a region's column-parallel ones: wq,
    wk, wv; w1, w3) cast it once, as AOTAutograd's graph CSE merges the identical casts. With
    `fp8_params` (`Stack.fp8_params`) the weights are FP8 already: no cast per micro-batch,
    backward reading each and writing its transposed FP8 copy where the recipe needs one
    (`Float8RecipeCost.fp8_param_bwd`)."""
    if not plan.fp8_matmuls:
        return 0.0, 0.0
    cost = FLOAT8_RECIPES[plan.float8_recipe]
    fwd_w, bwd_w = (0.0, cost.fp8_param_bwd) if fp8_params else (cost.fwd_w, cost.bwd_w)
    fwd = bwd = 0.0
    for x, w, go in _cast_operands(plan, share_inputs=compiled):
        fwd += cost.fwd_x * x + fwd_w * w
        bwd += cost.bwd_go * go + cost.bwd_x * x + bwd_w * w
    return fwd, bwd


def _cast_operands(plan: Plan, share_inputs: bool) -> Iterator[tuple[int, int, int]]:
    """Elements of each block linear's input, weight and output gradient that a low-precision
    recipe casts. With `share_inputs`, the column-parallel linears of one region (wq, wk, wv;
    w1, w3), which read one tensor, cast it once: the later ones count no input."""
    cast: set[str] = set()  # regions whose shared column-parallel input is cast already
    for lin in block_linears(plan):
        m, n, k = lin.mnk
        shared = share_inputs and lin.colwise and lin.region in cast
        if lin.colwise:
            cast.add(lin.region)
        yield (0 if shared else m * k), n * k, m * n


def block_gemm_seconds(
    plan: Plan,
    shapes: list[tuple[int, int, int]],
    cluster: Cluster,
    peak: float,
    flat: float | None,
    share: float = 1.0,
) -> tuple[float, float, float]:
    """One block's linears as (forward, input-gradient, weight-gradient) GEMM seconds: the same
    shapes three times, except under a float8 recipe other than tensorwise
    (`FLOAT8_RECIPES`: a slower forward GEMM, backward outputs rescaled in a pass of their own,
    a bf16 weight gradient). `share`: of the FP8 GEMM's rate, what the stack's GEMMs of the
    plan's recipe reach (`Stack.float8_gemm_share`)."""
    base = _linear_seconds(plan, shapes, cluster, peak, flat)
    if plan.fp8_matmuls:
        base /= share
    if not plan.fp8_matmuls or plan.float8_recipe == "tensorwise":
        return base, base, base
    cost = FLOAT8_RECIPES[plan.float8_recipe]
    hbm = cluster.gpu.hbm_bandwidth * cluster.gpu.calibration.hbm_efficiency.value
    dgrad_out = RESCALE_BYTES * sum(m * k for m, _, k in shapes) / hbm
    wgrad_out = RESCALE_BYTES * sum(n * k for _, n, k in shapes) / hbm
    dgrad = base + (dgrad_out if "dgrad" in cost.rescaled_backward else 0.0)
    if cost.wgrad_bf16:
        wgrad = gemm_seconds(shapes, peak, cluster.gpu.calibration, flat)
    else:
        wgrad = base + (wgrad_out if "wgrad" in cost.rescaled_backward else 0.0)
    return base / cost.fwd_gemm_share, dgrad, wgrad


# TransformerEngine's NVFP4 quantisation of one bf16 tensor, bytes per element
# (TransformerEngine docs/features/low_precision_training/nvfp4; Abecassis et al. 2025,
# "Pretraining Large Language Models with NVFP4", arXiv:2509.25149): the per-tensor amax that
# sets the fp32 second-level scale (read 2); for a tensor the weight gradient also takes (a
# linear's input, its output gradient), the amax of its 16 x 16 random-Hadamard-transformed
# copy (read 2); then one pass reading it (2) and writing the row-wise 1 x 16 copy and the
# (transformed) column-wise 16 x 1 copy, each E2M1 values with an E4M3 scale per 16 elements.
NVFP4_ACTIVATION_CAST_BYTES = 2 + 2 + 2 + 2 * NVFP4_MATMUL_BYTES
# A weight: 16 x 16 blocks (one quantisation serves both GEMM layouts), no transform.
NVFP4_WEIGHT_CAST_BYTES = 2 + 2 + 2 * NVFP4_MATMUL_BYTES


def nvfp4_cast_bytes(plan: Plan) -> tuple[float, float]:
    """HBM bytes of TransformerEngine's NVFP4 quantisations around one block's linears in one
    micro-batch (forward, backward): forward each linear's input (a region's column-parallel
    linears are one fused TE module in Megatron-Core, quantising their shared input once) and its
    weight, backward its output gradient (`NVFP4_ACTIVATION_CAST_BYTES`; the column-wise copies
    the backward GEMMs take were written in the same passes, so nothing is transposed).
    Megatron-Core passes `is_first_microbatch` to its TransformerEngine layers, which then keep
    the quantised weights for the step's other micro-batches: a weight's quantisation
    (`NVFP4_WEIGHT_CAST_BYTES`) is one per step, charged here as its share per micro-batch."""
    if not plan.nvfp4_matmuls:
        return 0.0, 0.0
    fwd = bwd = 0.0
    per_step = 1.0 / max(1, plan.n_microbatches)
    for x, w, go in _cast_operands(plan, share_inputs=True):
        fwd += NVFP4_ACTIVATION_CAST_BYTES * x + NVFP4_WEIGHT_CAST_BYTES * w * per_step
        bwd += NVFP4_ACTIVATION_CAST_BYTES * go
    return fwd, bwd


def _lowp_cast_seconds(
    plan: Plan, cluster: Cluster, n_blocks: int, n_redo: int, tp_: TimeParams
) -> tuple[float, float]:
    """Seconds of the float8 (NVFP4) casts of a rank's blocks in one micro-batch (forward,
    backward); recomputed blocks cast again in backward. The output projection stays bf16
    (torchao's converter skips `output` in torchtitan; Megatron-Core's output layer is not a
    TransformerEngine one) and attention too."""
    if plan.nvfp4_matmuls:
        fwd, bwd = nvfp4_cast_bytes(plan)
    else:
        fwd, bwd = fp8_cast_bytes(plan, tp_.compiled, tp_.stack.fp8_params)
    hbm = cluster.gpu.hbm_bandwidth * cluster.gpu.calibration.hbm_efficiency.value
    return n_blocks * fwd / hbm, (n_blocks * bwd + n_redo * fwd) / hbm


# The llmscale runtime's ring (parallel/context_parallel.py), counted from its code. Per
# (query chunk, key chunk) block: forward Q K^T and P V; backward Q K^T again (the
# probabilities from the saved log-sum-exp), dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q.
RING_FWD_MATMULS = 2
RING_BWD_MATMULS = 5


def ring_blocks(cp: int) -> int:
    """(query chunk, key chunk) blocks one cp rank computes per attention call in the runtime's
    load-balanced ring: its chunks r and 2cp - 1 - r against every chunk at or before them,
    (r + 1) + (2cp - r) = 2cp + 1 on every rank; the two on the diagonal are computed whole and
    then masked, so the ring executes (2cp + 1) / 2cp of the causal half of the products."""
    return 2 * cp + 1


def ring_block_flops(plan: Plan) -> float:
    """FLOPs of one matmul of one ring block on one rank: 2 x b x heads/tp x c x c x head_dim,
    with c = s / 2cp tokens per chunk."""
    m = plan.model
    c = plan.seq_len // (2 * plan.cp)
    return 2.0 * plan.micro_batch_size * (m.n_heads // plan.tp) * c * c * m.head_dim


def ring_attention_compute_seconds(plan: Plan, cluster: Cluster) -> tuple[float, float] | None:
    """The runtime's ring blocks of one attention call (forward, backward), on a device whose
    `ring_attention_efficiency` was measured (None otherwise): `ring_blocks` blocks of
    `RING_FWD_MATMULS` and `RING_BWD_MATMULS` matmuls, in fp32 whatever the precision (the ring
    computes in fp32), at that share of the fp32 peak. The efficiency is micro-benchmarked on
    the ring's own blocks at the run's chunk size (train/calibration.py), so it carries their
    element-wise passes over the c x c scores and the host's cost per eager op as well."""
    eff = cluster.gpu.calibration.ring_attention_efficiency
    if plan.cp == 1 or eff is None:
        return None
    rate = cluster.gpu.peak_flops("fp32") * eff.value
    work = ring_blocks(plan.cp) * ring_block_flops(plan) / rate
    return RING_FWD_MATMULS * work, RING_BWD_MATMULS * work


def compiled_ring_waits(tp_: TimeParams) -> bool:
    """Whether torch's context_parallel ring waits for each of its collectives where it issues
    them: when it is traced into compiled blocks (`_ring_attention_seconds`)."""
    return tp_.compiled and tp_.stack.cp_rotate == "allgather"


def _ring_attention_seconds(
    plan: Plan,
    cluster: Cluster,
    tp_: TimeParams,
    attn_f: float,
    attn_b: float,
    n_fwd: int,
    n_bwd: int,
) -> tuple[float, float]:
    """Exposed ring-attention traffic of one micro-batch (forward, backward) under cp > 1.
    `n_fwd` forward calls (blocks, plus those recomputed), `n_bwd` backward ones; attn_f /
    attn_b one call's attention core seconds on this rank. Each transfer runs beside compute
    (`_overlapped`, dp_overlap's efficiency) on the link the ring spans (inside a node when
    cp x tp <= GPUs per node).

    The llmscale runtime's ring (a device with `ring_attention_efficiency`): K and V of this
    rank's chunks stacked in fp32 (b x s/cp x kv_dim/tp each, the grouped heads unexpanded),
    cp - 1 passes in forward, each beside its step's blocks (step 0: the 3 with its own keys,
    then 2 per step); in backward cp - 1 passes of K and V and cp of their gradients, the pass
    of step t's gradients beside step t + 1's blocks and the last one exposed.

    A stack on torch's `context_parallel` (`Stack.cp_rotate` "allgather", its default
    rotation; torchtitan): per call one all-gather of every rank's K and V in the run's dtype
    (with `Kernels.repeat_kv`, repeated to the query heads first), issued beside step 0's
    blocks, so whatever exceeds 1/cp of the attention is exposed; in backward that all-gather
    again, and the K and V gradients passed around the ring in fp32 (`convert_to_f32`), each
    beside one step's blocks and the last one exposed. With the blocks compiled
    (`TimeParams.compiled`) the ring is traced into them, and a traced functional collective is
    waited where it is issued (torch/distributed/_functional_collectives.py `_maybe_wrap_tensor`:
    `wait_tensor` at once when `_are_we_tracing()`), which Inductor keeps unless its
    `reorder_for_compute_comm_overlap` pass is on (off by default; torchtitan does not set it):
    every ring transfer is then exposed in full (`compiled_ring_waits`).

    Otherwise a p2p ring (TransformerEngine's, Megatron-Core): cp - 1 ring steps per call, each
    passing this rank's K and V chunk in the run's dtype beside attn / cp of the compute (the
    load-balanced split gives every step an equal share); backward passes K, V and their
    gradients."""
    cp = plan.cp
    if cp == 1:
        return 0.0, 0.0
    m = plan.model
    per_node = 2 if cp * plan.tp <= cluster.gpus_per_node else 1
    eta = tp_.dp_overlap
    if cluster.gpu.calibration.ring_attention_efficiency is not None:
        kv = 2.0 * cp_tokens(plan) * (m.kv_dim // plan.tp) * 4  # fp32
        step = collective("p2p", kv, 2, per_node, cluster.fabric).seconds
        unit_f, unit_b = attn_f / ring_blocks(cp), attn_b / ring_blocks(cp)
        blocks = [3] + [2] * (cp - 2)  # beside the passes of steps 0 .. cp - 2
        fwd = sum(_overlapped(step, n * unit_f, eta) for n in blocks)
        bwd = sum(_overlapped(2 * step, n * unit_b, eta) for n in blocks) + step
        return n_fwd * fwd, n_bwd * bwd
    if tp_.stack.cp_rotate == "allgather":
        if compiled_ring_waits(tp_):
            eta, attn_f, attn_b = 1.0, 0.0, 0.0  # nothing beside it: all exposed
        local = 2.0 * cp_tokens(plan) * tp_.kernels.attention_kv_dim(m) / plan.tp  # K and V
        in_node = max(1, min(cp, cluster.gpus_per_node // plan.tp))
        gather = collective(
            "all_gather", cp * local * DTYPE_BYTES[plan.precision], cp, in_node, cluster.fabric
        ).seconds
        grads = collective("p2p", 4 * local, 2, per_node, cluster.fabric).seconds  # fp32
        fwd = _overlapped(gather, attn_f / cp, eta)
        bwd = _overlapped(gather, attn_b / cp, eta)
        bwd += (cp - 1) * _overlapped(grads, attn_b / cp, eta) + grads
        return n_fwd * fwd, n_bwd * bwd
    kv = 2.0 * cp_tokens(plan) * (m.kv_dim // plan.tp) * DTYPE_BYTES[plan.precision]
    step = collective("p2p", kv, 2, per_node, cluster.fabric).seconds
    step_b = collective("p2p", 2 * kv, 2, per_node, cluster.fabric).seconds
    fwd = (cp - 1) * _overlapped(step, attn_f / cp, eta)
    bwd = (cp - 1) * _overlapped(step_b, attn_b / cp, eta)
    return n_fwd * fwd, n_bwd * bwd


def _loss_comm_seconds(plan: Plan, rank: int, cluster: Cluster, kern: act.Kernels) -> float:
    """The loss's tensor-parallel traffic on the last rank, one micro-batch: under the
    vocabulary-parallel loss (torch's loss_parallel) three small all-reduces over tp (the row
    maximum, the sum of exponentials and the target's logit: 4 B per token each) and no logits
    gathered; a vocabulary-parallel head without it all-gathers the logits whole."""
    m, tp = plan.model, plan.tp
    if tp == 1 or rank != plan.head_rank or not kern.splits_vocab(m, tp):
        return 0.0
    tokens = cp_tokens(plan)
    if kern.splits_logits(m, tp):
        one = collective("all_reduce", 4.0 * tokens, tp, tp, cluster.fabric).seconds
        return 3 * one
    logits = tokens * m.vocab_size * DTYPE_BYTES[plan.precision]
    return collective("all_gather", logits, tp, tp, cluster.fabric).seconds


# The FFN activation's element-wise traffic per element of the FFN width, forward, by
# `ModelConfig.mlp`: torchtitan's eager ops in bytes (`eager_block_bytes`), and the llmscale
# runtime's eager ops in multiples of the activation dtype (`runtime_eager_block_parts`).
EAGER_FFN_BYTES = {"swiglu": 10, "gelu": 6, "relu2": 8}
RUNTIME_FFN_PASSES = {"swiglu": 5, "gelu": 2, "relu2": 4}


def eager_block_bytes(plan: Plan) -> float:
    """HBM bytes one block's element-wise kernels move in forward on one rank, run eagerly
    (one kernel per op, bf16 activations, as torchtitan's Llama without torch.compile):

    - composite RMSNorm x 2: to fp32 (2 read, 4 written), pow (4, 4), mean (4), x * rstd (4, 4),
      back to bf16 (4, 2), times the weight (2, 2): 36 bytes per element of d;
    - RoPE on q and k as complex products in fp32: cast (2, 4), multiply (4, 4), cast back
      (4, 2): 20 bytes per element;
    - repeat_kv (GQA) copies k and v to n_heads: 2 read per kv element, 2 written per q element;
    - SwiGLU: silu (2, 2) and the product (4, 2): 10 bytes per element of the FFN width (GELU
      6; squared ReLU: relu (2, 2) and the square (2, 2), 8);
    - two residual adds: (4, 2) each, per element of d.
    Backward moves about twice that (read the saved input and the gradient, write a gradient).
    """
    m, tp = plan.model, plan.tp
    tokens = cp_tokens(plan)  # this cp rank's share of the sequence
    d, kv, f = m.dim, m.kv_dim, m.ffn_dim
    per_token: float = 2 * 36 * d + 2 * 6 * d  # norms and residual adds (replicated over tp)
    per_token += (20 * (d + kv) + 2 * (d + kv) * (2 if kv < d else 0)) / tp
    per_token += EAGER_FFN_BYTES[m.mlp] * f / tp
    return per_token * tokens


def runtime_eager_block_bytes(plan: Plan, kernels: act.Kernels) -> float:
    """Bytes one block's element-wise ops move in forward on one rank, as this runtime runs
    them (model/transformer.py, eagerly, one kernel per op), per element:

    - each norm (fused RMSNorm or LayerNorm): reads its input twice (statistics, then scale)
      and writes its output, in the residual stream's dtype r: 3r per element of d;
    - autocast over fp32 weights casts the input of each linear that reads the fp32 norm
      output (wq, wk, wv; w1 and w3): r + a per element of d; and each weight once per forward
      (4 + a per parameter), its gradient back to fp32 in backward (a + 4);
    - RoPE on q and k in fp32 (`apply_rope`): four products and a difference and a sum over
      half-size views, then a stack: 36 bytes per element; in bf16/fp16 also the upcast and the
      cast back, 2 (4 + a);
    - the attention output's transpose-and-reshape copy: 2a per element of d;
    - SwiGLU: silu (2a) and the product (3a) per element of the FFN width; GELU 2a; squared
      ReLU: relu (2a) and the square (2a);
    - two residual adds: a fp32 stream plus a low-precision branch, 2r + a per element of d.
    Tensor-parallel ranks hold 1/tp of the heads and of the FFN width; norms and residual adds
    are split too under sequence parallelism.
    """
    activations, weights = runtime_eager_block_parts(plan, kernels)
    return activations + weights


def runtime_eager_block_parts(plan: Plan, kernels: act.Kernels) -> tuple[float, float]:
    """`runtime_eager_block_bytes` in two parts: the activations' element-wise ops, and the
    weights' autocast casts: 4 + a per parameter in forward and a + 4 for its gradient in
    backward, counted as a third of that in the forward's bytes (backward moves twice them)."""
    m, tp = plan.model, plan.tp
    tokens = cp_tokens(plan)  # this cp rank's share of the sequence
    a = DTYPE_BYTES[plan.precision]
    r = act.residual_bytes(a, kernels)
    d, kv, f = m.dim, m.kv_dim, m.ffn_dim
    replicated: float = 2 * 3 * r * d + 2 * (2 * r + a) * d  # norms and residual adds
    if plan.sequence_parallel:
        replicated /= tp
    split = 0.0
    if act.norm_output_fp32(m, a, kernels) and a < 4:  # each linear casts a norm's output
        split += (3 + (2 if m.gated else 1)) * (r + a) * d
    if m.pos_emb == "rope":
        split += (36 + (2 * (4 + a) if a < 4 else 0)) * (d + kv) / tp
    split += 2 * a * d / tp  # attention output copy
    split += RUNTIME_FFN_PASSES[m.mlp] * a * f / tp
    weights = 0.0
    if a < 4 and not kernels.lowp_weights:  # autocast's weight casts
        block_params = sum(fan_in * fan_out for _, fan_in, fan_out in m.block_matmuls()) / tp
        weights = 2 * (4 + a) * block_params / 3
    return (replicated + split) * tokens, weights


def compiled_block_bytes(plan: Plan, kernels: act.Kernels) -> float:
    """Bytes one block's element-wise ops move in forward on one rank when the block is compiled
    (train.compile): torch.compile fuses each chain of element-wise ops between two matmuls
    into one kernel that reads the chain's inputs once and writes its outputs once, so the
    temporaries of `runtime_eager_block_bytes` never reach memory. Per element:

    - the first norm with the cast of its output: reads the stream (r), writes the linears'
      input (a): r + a per element of d;
    - the first residual add with the second norm: reads the stream and the attention branch
      (r + a), writes the new stream and the FFN's input (r + a);
    - the second residual add: reads r + a, writes r;
    - RoPE on q and k: reads and writes them once, 2a per element; the attention output's
      copy, 2a per element of d;
    - SwiGLU: reads both branches, writes the product, 3a per element of the FFN width (GELU
      and squared ReLU: 2a);
    - the weights' autocast casts as eager (they are the weights' bytes, whatever the fusion).
    Tensor-parallel and sequence-parallel splits as in `runtime_eager_block_bytes`.
    """
    m, tp = plan.model, plan.tp
    tokens = cp_tokens(plan)  # this cp rank's share of the sequence
    a = DTYPE_BYTES[plan.precision]
    r = act.residual_bytes(a, kernels)
    d, kv, f = m.dim, m.kv_dim, m.ffn_dim
    replicated: float = ((r + a) + 2 * (r + a) + (2 * r + a)) * d
    if plan.sequence_parallel:
        replicated /= tp
    split: float = 2 * a * (d + kv) / tp if m.pos_emb == "rope" else 0.0
    split += 2 * a * d / tp + (3 if m.gated else 2) * a * f / tp
    _, weights = runtime_eager_block_parts(plan, kernels)
    return (replicated + split) * tokens + weights


def gemm_seconds(
    shapes: list[tuple[int, int, int]], peak: float, cal: Calibration, flat: float | None
) -> float:
    """Seconds of GEMMs (M, N, K) at `peak` and the calibration's efficiency for each shape
    (`flat`: one efficiency for all)."""
    total = 0.0
    for mm, n, k in shapes:
        eff = flat if flat is not None else cal.gemm_efficiency_at(mm, n, k)
        total += 2.0 * mm * n * k / (peak * eff)
    return total


def _compute_rank_times(plan: Plan, rank: int, cluster: Cluster, tp_: TimeParams) -> _RankTimes:
    m, s, b = plan.model, plan.seq_len, plan.micro_batch_size
    tokens = b * s
    tp, kern = plan.tp, plan_kernels(plan, tp_.kernels)
    cal = cluster.gpu.calibration
    flat = tp_.matmul_efficiency
    peak = peak_flops(cluster, plan.precision, tp_)
    work = rank_work(plan, rank, tp_.kernels)  # what the memory model folds too
    n_blocks, n_full = work.n_blocks, work.n_full
    # GEMMs of one block (forward; backward the same shapes transposed, twice).
    share = tp_.stack.float8_gemm_share(plan.float8_recipe)
    gemm_block, dgrad_block, wgrad_block = block_gemm_seconds(
        plan, work.gemms, cluster, peak, flat, share
    )
    # Attention core (QK^T, AV): a flash kernel skips the masked half under causal masking and
    # its backward recomputes QK^T (2.5x the forward's FLOPs, as FlashAttention-2 counts it); a
    # materialised softmax computes all of s x s as batched GEMMs (backward 2x).
    core_fwd_flops = m.attention_core_flops_per_token(s) / m.n_layers * tokens / (tp * plan.cp)
    ring = ring_attention_compute_seconds(plan, cluster)  # the runtime's ring, measured
    if ring is not None:
        attn_f, attn_b = ring
    elif kern.attention_kernel(m, plan.precision) in ("materialized", "math"):
        head_dim = m.dim // m.n_heads
        eff = flat if flat is not None else cal.gemm_efficiency_at(s, s, head_dim)
        attn_f, attn_b = core_fwd_flops / (peak * eff), 2 * core_fwd_flops / (peak * eff)
    else:
        eff = flat if flat is not None else cal.attention_efficiency.value
        attn_f = 0.5 * core_fwd_flops / (peak * eff)
        attn_b = 2.5 * attn_f
    # Micro-pipelined TP: the forward's and the input gradients' GEMMs in tp row chunks.
    split = tp_chunked_gemm_seconds(plan, cluster, tp_, peak, flat)
    mat_f = n_blocks * (gemm_block + split + attn_f)
    mat_b = n_blocks * (dgrad_block + wgrad_block + split + attn_b)
    mat_b += n_full * (gemm_block + split + attn_f)
    # Op-level selective checkpointing (selective_op: torchtitan's op policy).
    op_sac = plan.recompute == "selective_op"
    if op_sac:  # the matmuls whose outputs were not saved run again (every other one)
        redo = [g for i, g in enumerate(work.gemms) if not op_sac_saves_matmul(i)]
        mat_b += n_blocks * block_gemm_seconds(plan, redo, cluster, peak, flat, share)[0]
    elif plan.recompute == "selective":
        mat_b += n_blocks * attn_f
    wgrad = n_blocks * wgrad_block  # one of the two backward GEMMs per linear
    if work.head:
        vocab_div = tp if kern.splits_vocab(m, tp) else 1
        head_mnk = (cp_tokens(plan), m.vocab_size // vocab_div, m.dim)
        head = gemm_seconds([head_mnk], peak, cal, flat)
        mat_f += head
        mat_b += 2 * head
        wgrad += head

    # Memory-bound kernels, through the bytes they leave behind for backward (this cp rank's
    # share of the sequence, as the memory model counts them: `RankWork.block_saved`).
    kept = work.block_saved
    saved = n_blocks * kept["none"]
    if op_sac:  # every element-wise op of the block runs again
        redone = saved
    elif plan.recompute == "selective":
        redone = n_blocks * (kept["none"] - kept["selective"])
    else:
        redone = n_full * kept["none"]
    hbm = cluster.gpu.hbm_bandwidth * cal.hbm_efficiency.value
    head_f = head_b = 0.0
    if work.head:  # the final norm, the head's input and the loss (this cp rank's share)
        moved = act.head_traffic(*slice_args(plan, tp_.kernels), tp_.fwd_passes, tp_.bwd_passes)
        head_f, head_b = (cp_share(plan) * x / hbm for x in moved)
    elem_f = tp_.fwd_passes * saved / hbm + head_f
    elem_b = (tp_.bwd_passes * saved + tp_.fwd_passes * redone) / hbm + head_b
    if tp_.elementwise not in ELEMENTWISE_MODELS:
        raise ConfigError("elementwise", tp_.elementwise, " | ".join(ELEMENTWISE_MODELS))
    if tp_.elementwise != "saved":
        if tp_.compiled:
            eager = compiled_block_bytes(plan, kern)
        elif tp_.elementwise == "llmscale":
            eager = runtime_eager_block_bytes(plan, kern)
        else:
            eager = eager_block_bytes(plan)
        block_f = eager / hbm
        redo_blocks = n_blocks if op_sac else n_full
        elem_f = n_blocks * block_f + head_f
        elem_b = 2 * n_blocks * block_f + redo_blocks * block_f + head_b
    # Tensor-parallel collectives (inside a node), per block.
    tp_f = tp_b = 0.0
    if tp > 1:
        fwd_one, bwd_one, tp_redo = _tp_block_seconds(plan, cluster, tp_, peak, flat)
        tp_f = n_blocks * fwd_one
        tp_b = n_blocks * bwd_one + n_full * fwd_one
        if op_sac:  # op-level SAC runs a block's collectives again, but those it keeps
            tp_b += n_blocks * tp_redo
    loss_f = _loss_comm_seconds(plan, rank, cluster, kern)
    # Context parallelism: the ring's traffic (every element-wise count above is already this
    # cp rank's s / cp tokens: `cp_tokens`, `saved_bytes`; the weights' casts are not per token).
    redo_attn = n_full + (n_blocks if plan.recompute == "selective" and not op_sac else 0)
    cp_f, cp_b = _ring_attention_seconds(
        plan, cluster, tp_, attn_f, attn_b, n_blocks + redo_attn, n_blocks
    )
    cast_f, cast_b = _lowp_cast_seconds(plan, cluster, n_blocks, n_full, tp_)
    # Per-op dispatch where the host waits for each op (a CPU): the rank's share of the
    # model's blocks, a third in forward and two thirds in backward; a recomputed block
    # dispatches its forward's ops again (full, or op-level SAC's element-wise ops and matmuls),
    # not its backward's.
    disp_f, disp_b = _dispatch_seconds(
        tp_.stack, m.n_layers, n_blocks, n_full if not op_sac else n_blocks
    )
    dispatch = disp_f + disp_b
    fwd = mat_f + elem_f + tp_f + cp_f + cast_f + loss_f + disp_f
    bwd = mat_b + elem_b + tp_b + cp_b + cast_b + disp_b
    parts = {
        "matmul": mat_f + mat_b,
        "elementwise": elem_f + elem_b,
        "tp_comm": tp_f + tp_b,
        "dispatch": dispatch,
    }
    if loss_f:
        parts["loss_comm"] = loss_f
    if plan.cp > 1:
        parts["cp_comm"] = cp_f + cp_b
    if plan.fp8_matmuls:
        parts["fp8_casts"] = cast_f + cast_b
    if plan.nvfp4_matmuls:
        parts["nvfp4_casts"] = cast_f + cast_b
    sync = 0.0
    if plan.fsdp_for(tp_.stack):
        gather, sync = _fsdp_exposed(plan, rank, cluster, tp_, kern, fwd, bwd, n_blocks)
        parts["fsdp_comm"] = gather
        bwd += gather
    if work.offloaded:
        off_f, off_b = _activation_offload_seconds(work, cluster, tp_.stack, fwd, bwd)
        parts["activation_offload"] = off_f + off_b
        fwd += off_f
        bwd += off_b
    return _RankTimes(fwd, bwd, parts, sync, wgrad)


def _activation_offload_seconds(
    work: RankWork, cluster: Cluster, stack: Stack, fwd: float, bwd: float
) -> tuple[float, float]:
    """Exposed seconds of one micro-batch's activation offload (forward) and reload
    (backward): the offloaded blocks' saved bytes each way over the GPU's host link. Copied on
    the compute stream (`Stack.activation_offload` "blocking": torch's save_on_cpu), all of it;
    on a side stream ("async": TransformerEngine's schedule gives block i's offload until the
    forward of block n - N + i and starts its reload N blocks ahead), what does not fit beside
    the compute of the n - N blocks kept on the device (their share of `fwd` and `bwd`)."""
    moved = work.host_saved / cluster.host_link.bandwidth
    if stack.activation_offload != "async":
        return moved, moved
    window = (work.n_blocks - work.offloaded) / work.n_blocks
    return max(0.0, moved - window * fwd), max(0.0, moved - window * bwd)


def _tp_block_seconds(
    plan: Plan, cluster: Cluster, tp_: TimeParams, peak: float, flat: float | None
) -> tuple[float, float, float]:
    """Exposed tensor-parallel traffic of one block on one rank: (forward, backward, what an
    op-level SAC recompute runs again). Per region (`TP_REGIONS_PER_BLOCK`), with sequence
    parallelism an all-gather of the region's input and a reduce-scatter of its output (in
    backward their mirror images: a reduce-scatter and an all-gather of the gradients), else
    one all-reduce each way. Under float8 a stack whose kernels gather the float8 cast
    (`Kernels.fp8_all_gathers`) moves 1 byte per element in the forward's all-gathers.

    Where the stack overlaps them with GEMMs (`tp_overlap_gemm`), each runs beside the GEMMs it
    feeds or drains (`tp_region_gemm_seconds`): an all-gather (and, in backward, its
    reduce-scatter) beside the column-parallel GEMMs reading its output, a reduce-scatter or
    all-reduce (and its mirror) beside the row-parallel GEMM writing its input.

    torch's micro-pipelined TP (`Stack.tp_overlap_chunks`; torch/_inductor/fx_passes/
    micro_pipeline_tp.py) fuses a reduce-scatter only with the one matmul that produces its
    input (`_find_producer_matmul`), and each fused one ends with a reduction kernel over the
    tp partial results it received (torch.distributed._symmetric_memory
    `_fused_matmul_reduce_scatter_impl`: reads tp shards, writes one, at HBM bandwidth):
    - forward, the row-parallel output's reduce-scatter is fused: hidden, plus that reduction;
    - backward, the gradient of a region's gathered input is the sum of its column-parallel
      linears' input gradients (wq, wk, wv; w1, w3): with more than one, the reduce-scatter
      reads an add, not a matmul, and runs unfused, exposed in full; a region with one
      column-parallel linear (a GELU MLP's w1) is fused like the forward's.
    All-gathers feed matmuls in both directions and are fused."""
    m, tp = plan.model, plan.tp
    nbytes = cp_tokens(plan) * m.dim * DTYPE_BYTES[plan.precision]
    fp8_gather = plan.fp8_matmuls and tp_.kernels.fp8_all_gathers

    def seconds(kind: str, size: float) -> float:
        return (1 - tp_.tp_overlap) * collective(kind, size, tp, tp, cluster.fabric).seconds

    if plan.sequence_parallel:
        gather = nbytes * FP8_MATMUL_BYTES / DTYPE_BYTES[plan.precision] if fp8_gather else nbytes
        # (the collective, the GEMMs beside it: 0 column-parallel, 1 row-parallel)
        fwd = [("all_gather", seconds("all_gather", gather), 0),
               ("reduce_scatter", seconds("reduce_scatter", nbytes), 1)]  # fmt: skip
        bwd = [("reduce_scatter", seconds("reduce_scatter", nbytes), 0),
               ("all_gather", seconds("all_gather", nbytes), 1)]  # fmt: skip
    else:
        fwd = bwd = [("all_reduce", seconds("all_reduce", nbytes), 1)]

    overlaps = tp_overlaps_gemms(plan, tp_)
    regions = tp_region_gemm_seconds(plan, cluster, peak, flat) if overlaps else []
    chunked = _micro_pipelined(plan, tp_)
    # torch's fused reduce-scatter: its reduction kernel, and which ones are fused (above)
    reduction = 0.0
    unfused: list[bool] = []
    if chunked:
        hbm = cluster.gpu.hbm_bandwidth * cluster.gpu.calibration.hbm_efficiency.value
        reduction = (nbytes + nbytes / tp) / hbm
        unfused = [len(cols) > 1 for cols, _ in _tp_regions(plan)]  # regions' order

    def exposed(parts: list[tuple[str, float, int]], kept: frozenset[str] = frozenset()) -> float:
        parts = [p for p in parts if p[0] not in kept]
        if not overlaps:
            return TP_REGIONS_PER_BLOCK * sum(sec for _, sec, _ in parts)
        total = 0.0
        for i, gemms in enumerate(regions):
            for kind, sec, side in parts:
                if chunked and kind == "reduce_scatter" and side == 0 and unfused[i]:
                    total += sec  # the input gradients' sum: not a matmul, not fused
                    continue
                total += _overlapped(sec, gemms[side], tp_.dp_overlap)
                if chunked and kind == "reduce_scatter":
                    total += reduction
        return total

    return exposed(fwd), exposed(bwd), exposed(fwd, OP_SAC_SAVED_COLLECTIVES)


def _dispatch_seconds(
    stack: Stack, n_layers: int, n_blocks: int, n_redo: int
) -> tuple[float, float]:
    """The fixed per-op cost of one micro-batch on a rank (forward, backward): the stack's
    `microbatch_overhead_ms` on the device (a whole forward and backward) in proportion to the
    rank's `n_blocks` of the model's `n_layers`, a third in forward and two thirds in backward;
    each of the `n_redo` recomputed blocks adds a forward's third to backward."""
    per_block = stack.microbatch_overhead_ms.value * 1e-3 / n_layers
    return n_blocks * per_block / 3, (2 * n_blocks + n_redo) * per_block / 3


def _overlapped(comm: float, compute: float, efficiency: float) -> float:
    """Exposed seconds of `comm` run beside `compute`: the part that does not fit, plus the
    share (1 - efficiency) of the hidden part that the compute loses to it."""
    hidden = min(comm, compute)
    return comm - hidden + (1 - efficiency) * hidden


def _fsdp_exposed(
    plan: Plan,
    rank: int,
    cluster: Cluster,
    tp_: TimeParams,
    kern: act.Kernels,
    fwd: float,
    bwd: float,
    n_blocks: int,
) -> tuple[float, float]:
    """FSDP2 per unit (one block; the root holds embedding and head): each unit's all-gather
    is prefetched one unit ahead (FSDP2's default) behind the previous unit's compute; the first
    all-gather of forward (and of backward under zero_stage 3) is exposed. Gradients are
    reduce-scattered per unit behind the next unit's backward, the last one exposed: on every
    micro-batch, or once per step (`grad_sync_once`). Under a pipeline the llmscale stack's
    forward gathers are charged as often as torch's schedule really gathers each unit of this
    rank (`stack.residency.pipeline_gathers`, its mean over the rank's stages): m + 1 per step
    under zero 3, and more than once under zero 1 and 2 where 4 or more chunks evict stages.
    Returns (per micro-batch, per step)."""
    rp = plan_rank_params(plan, rank, kern, tp_.stack)
    shards = plan.fsdp_shards_for(tp_.stack)  # dp_shard x cp
    per_node = _per_node(shards, plan.tp, cluster.gpus_per_node)
    units = max(1, n_blocks)
    unit_numel = rp.numel / units

    def cost(op: str, nbytes: float) -> float:
        return collective(op, nbytes, shards, per_node, cluster.fabric).seconds

    ag = cost("all_gather", model_weight_bytes(plan, rp, tp_.stack, rp.blocks) / units)
    rs = cost("reduce_scatter", tp_.stack.main_grad_bytes * unit_numel)
    eta = tp_.dp_overlap
    c_f, c_b = fwd / units, bwd / units
    res = param_residency(
        tp_.stack, zero_stage=plan.zero_stage, pp=plan.pp, n_microbatches=plan.n_microbatches
    )
    ag_b = ag if res.gathers_per_microbatch == 2 else 0.0
    gather_f = ag + (units - 1) * _overlapped(ag, c_f, eta)
    bwd_plain = ag_b + (units - 1) * _overlapped(ag_b, c_b, eta) if ag_b else 0.0
    # With gradient sync, backward's all-gathers and reduce-scatters share the link and the
    # same compute window (the next unit's backward).
    bwd_sync = ag_b + rs + (units - 1) * _overlapped(ag_b + rs, c_b, eta)
    scatter = bwd_sync - bwd_plain
    per_micro, per_step = bwd_plain, 0.0
    # Gathered once per step: the first micro-batch's forward gathers (behind its compute) and
    # the stage stays unsharded until the step's end.
    exact = None
    if plan.pp > 1 and tp_.stack.sharding == "llmscale":
        exact = _pipeline_unit_gathers(
            plan.pp_schedule, plan.pp, plan.n_microbatches, plan.chunks, plan.zero_stage, rank
        )
    if exact is not None and res.gathers_per_microbatch == 0:
        per_step += exact * gather_f
    elif exact is not None:
        per_micro += exact / plan.n_microbatches * gather_f
    elif res.gathers_per_microbatch == 0:
        per_step += gather_f
    else:
        per_micro += gather_f
    if res.grads_per_step:
        per_step += scatter
    else:
        per_micro += scatter
    return per_micro, per_step


def _pipeline_unit_gathers(
    schedule: str, pp: int, microbatches: int, chunks: int, zero_stage: int, rank: int
) -> float | None:
    """All-gathers per FSDP unit per step of pipeline `rank` (the mean over its stages) as
    torch's schedule runs them: in closed form up to 3 chunks per rank
    (`stack.residency.few_stage_gathers`), else replayed from the schedule's order
    (`pipeline_gathers`); None for a schedule the planner does not order."""
    few = few_stage_gathers(zero_stage, microbatches, chunks)
    if few is not None:
        return float(few)
    m0 = GATHERS_AFFINE_FROM * pp
    if microbatches > m0 + pp and microbatches % pp == 0:
        # Affine in m past the warm-up (tests/plan/test_pipeline_gathers.py): two replays
        # of a few micro-batches instead of one of many (the search asks hundreds).
        a = _replayed_gathers(schedule, pp, m0, chunks, zero_stage, rank)
        b = _replayed_gathers(schedule, pp, m0 + pp, chunks, zero_stage, rank)
        if a is None or b is None:
            return None
        return b + (microbatches - m0 - pp) / pp * (b - a)
    return _replayed_gathers(schedule, pp, microbatches, chunks, zero_stage, rank)


# From this many micro-batches per pipeline rank on (x pp), the gathers per unit of a rank
# running 4 or more chunks grow by the same amount every pp more micro-batches.
GATHERS_AFFINE_FROM = 3


# (planner memos, emptied with the others by `cache.clear_all`: a benchmark's cold search
# replays these too)
@memoize_values
def _replayed_gathers(
    schedule: str, pp: int, microbatches: int, chunks: int, zero_stage: int, rank: int
) -> float | None:
    order = _rank_order(schedule, pp, microbatches, chunks, rank)
    if order is None:
        return None
    counts = pipeline_gathers(zero_stage, order)
    return sum(counts.values()) / len(counts) if counts else None


_ORDERS: Memo[list[tuple[str, int]] | None] = Memo("time.rank_orders", maxsize=1024)


def _rank_order(
    schedule: str, pp: int, microbatches: int, chunks: int, rank: int
) -> list[tuple[str, int]] | None:
    """`rank`'s (kind, stage) order, for each ZeRO stage's replay (only the ranks the search
    costs are built; a bounded memo: each holds thousands of ops)."""

    def compute() -> list[tuple[str, int]] | None:
        try:
            return rank_actions(schedule, pp, microbatches, chunks, rank)
        except ConfigError:
            return None

    return _ORDERS.get((schedule, pp, microbatches, chunks, rank), compute)


def _p2p_seconds(plan: Plan, cluster: Cluster, tp_: TimeParams) -> float:
    if plan.pp == 1:
        return 0.0
    nbytes: float = cp_tokens(plan) * plan.model.dim * DTYPE_BYTES[plan.precision]  # s / cp
    if plan.sequence_parallel or tp_.p2p_scatter_gather:
        nbytes /= plan.tp
    stride = plan.tp * plan.cp * plan.dp  # pipeline stages are the outermost mesh dimension
    per_node = 2 if stride < cluster.gpus_per_node else 1
    return collective("p2p", nbytes, 2, per_node, cluster.fabric).seconds


def _replicate_group(plan: Plan, stack: Stack) -> tuple[int, int]:
    """(ranks, rank stride) of the gradient all-reduce outside FSDP: the replicas, and without
    FSDP the cp ranks too (each holds the gradients of its part of every sequence)."""
    if plan.fsdp_for(stack) or plan.cp == 1:
        return plan.dp_replicate, plan.tp * plan.cp * plan.dp_shard
    return plan.dp_replicate * plan.cp, plan.tp


def step_time_floor(
    plan: Plan,
    cluster: Cluster,
    params: TimeParams = DEFAULT_TIME,
    ranks: tuple[int, ...] = (0,),
    past: float = math.inf,
) -> float:
    """No more than `estimate_step_time(plan, cluster, params, ranks=ranks).seconds` (not
    simulated; overlap shares in [0, 1]): the stack's fixed per-step cost and the pipeline's
    closed form, the micro-batches' forward and backward on the slowest of `ranks` with its
    bubble (the split-backward schedules' from that rank's costs, once every rank is timed);
    every other part of the step adds seconds >= 0. Ranks are taken in turn, the last first
    (the head's, most often the slowest), and once the floor of those taken is past `past` it
    is returned without the others' stage times. The search skips the rest of a plan's
    estimate, and the rest of a knob loop, where this is past the plans it keeps
    (tests/plan/test_search_speed.py holds the two together)."""
    cluster = cluster.run_by(params.stack)
    n_mb, p = plan.n_microbatches, plan.pp
    idle = idle_slots(plan.pp_schedule, p, plan.chunks) if p > 1 else 0.0
    slots = n_mb + (idle or 0.0)
    fixed = _fixed_seconds(params)
    floor = fixed
    timed: dict[int, _RankTimes] = {}
    for r in reversed(ranks):
        st = timed[r] = _rank_times(plan, r, cluster, params)
        floor = max(floor, fixed + slots * (st.fwd + st.bwd))
        if floor > past:
            return floor
    if idle is None:  # a split-backward schedule's bubble, from the slowest rank as estimated
        slow = max((timed[r] for r in sorted(ranks)), key=lambda st: st.fwd + st.bwd)
        gap = bubble_time(plan.pp_schedule, p, plan.chunks, slow.fwd, slow.bwd, slow.wgrad)
        floor = max(floor, fixed + n_mb * (slow.fwd + slow.bwd) + (gap or 0.0))
    return floor


def _fixed_seconds(params: TimeParams) -> float:
    """The stack's fixed per-step cost (0 when `params.step_overhead` is off)."""
    return params.stack.step_overhead_ms.value * 1e-3 if params.step_overhead else 0.0


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
    check_matmul_precision(plan.precision, cluster, plan.float8_recipe)
    if validate:
        plan.validate()
        if plan.tp > cluster.gpus_per_node:
            raise ConfigError("parallel.tp", plan.tp, f"<= GPUs per node = {cluster.gpus_per_node}")
    tparams = params
    cluster = cluster.run_by(tparams.stack)  # the stack's fitted values on this GPU
    todo = ranks if ranks is not None and not simulate else tuple(range(plan.pp))
    computed = {r: _rank_times(plan, r, cluster, tparams) for r in todo}
    stages = [computed.get(r, computed[todo[0]]) for r in range(plan.pp)]
    n_mb, p, v = plan.n_microbatches, plan.pp, plan.chunks
    t_p2p = _p2p_seconds(plan, cluster, tparams)
    slow = max(stages, key=lambda st: st.fwd + st.bwd)
    t = slow.fwd + slow.bwd
    if p == 1:
        pipe, bubble, p2p_total = n_mb * t, 0.0, 0.0
    elif simulate and p * v * n_mb <= MAX_STAGE_MICROBATCHES:
        # (Larger: the closed form below. Simulating a global batch of 10^6 sequences took
        # minutes and tens of GB; with that many micro-batches the bubble is the closed form's.)
        # The zero-bubble schedules run each backward's weight gradients (wgrad) as W ops.
        on = {g: r for r in range(p) for g in stage_ids(r, p, v, plan.v_shape)}
        # A rank's cost shared among its stages by their layers (uneven splits: 126 layers over
        # 32 stages are 4s and 3s), evenly where the rank has none.
        n_layers = plan.model.n_layers
        layers = [len(stage) for stage in split_layers(n_layers, p * v, plan.pp_layers)]
        held = {r: sum(layers[g] for g in stage_ids(r, p, v, plan.v_shape)) for r in range(p)}
        share = [layers[g] / held[on[g]] if held[on[g]] else 1 / v for g in range(p * v)]
        costs_f = [stages[on[g]].fwd * share[g] for g in range(p * v)]
        costs_b = [stages[on[g]].bwd * share[g] for g in range(p * v)]
        costs_w = [stages[on[g]].wgrad * share[g] for g in range(p * v)]
        res = simulate_schedule(
            plan.pp_schedule, p, n_mb, v, costs_f, costs_b, t_p2p, costs_w, timeline=False
        )
        busy = n_mb * t
        pipe, bubble, p2p_total = res.makespan, res.bubble_fraction, 0.0
        pipe = max(pipe, busy)
    else:
        idle = bubble_time(plan.pp_schedule, p, v, slow.fwd, slow.bwd, slow.wgrad)
        if idle is None:  # GPipe, 1F1B, interleaved 1F1B: slots of one forward and backward
            idle = (idle_slots(plan.pp_schedule, p, v) or 0.0) * t
        pipe = n_mb * t + idle
        bubble = idle / pipe
        hops = p * v - 1 - (1 if plan.v_shape else 0)  # the V's bottom stays on its rank
        p2p_total = 2 * hops * t_p2p
    breakdown = {k: n_mb * val for k, val in slow.parts.items()}
    breakdown["bubble"] = pipe - n_mb * t
    breakdown["pp_p2p"] = p2p_total
    # Replicated data parallelism: one fp32 all-reduce of the (sharded) gradients per step.
    m = plan.model
    # The first and last ranks hold the embedding and the head on top of their blocks (and,
    # split unevenly, the first ranks the most blocks).
    worst_params = max(
        plan_rank_params(plan, r, tparams.kernels, tparams.stack).shard_numel for r in {0, p - 1}
    )
    dp_sync = 0.0
    group, stride = _replicate_group(plan, tparams.stack)
    if group > 1:
        per_node = _per_node(group, stride, cluster.gpus_per_node)
        ar = collective("all_reduce", 4 * worst_params, group, per_node, cluster.fabric)
        if tparams.grad_sync_once:  # once per step, behind the last micro-batch's backward
            dp_sync = _overlapped(ar.seconds, slow.bwd, tparams.dp_overlap)
        else:  # after every micro-batch (Megatron 2021: after the pipeline flush, exposed)
            dp_sync = n_mb * _overlapped(ar.seconds, slow.bwd, tparams.dp_overlap)
    dp_sync += slow.sync
    breakdown["dp_comm"] = dp_sync
    # Tied embeddings under a pipeline (a stack that keeps a copy on the last stage): the two
    # stages' embedding gradients all-reduced once per step, after the flush (Megatron's
    # embedding group); in a V both sit on one rank and nothing moves.
    if m.tie_embeddings and p > 1 and not plan.v_shape:
        vocab_div = plan.tp if tparams.kernels.splits_vocab(m, plan.tp) else 1
        # each rank's fp32 gradient (its FSDP shard under data-parallel sharding)
        emb_bytes = 4.0 * m.vocab_size * m.dim / vocab_div / plan.fsdp_shards_for(tparams.stack)
        per_node = 2 if plan.tp * plan.cp * plan.dp * (p - 1) < cluster.gpus_per_node else 1
        tied = collective("all_reduce", emb_bytes, 2, per_node, cluster.fabric).seconds
        breakdown["tied_embedding_comm"] = tied
        dp_sync += tied
    # Optimizer step.
    cal = cluster.gpu.calibration
    lsp = offload_traffic(plan, 0, tparams.kernels) if plan.offload == "lsp" else None
    if plan.offload == "none":
        opt_bw = cluster.gpu.hbm_bandwidth * tparams.stack.optimizer_share(cal.hbm_efficiency)
        opt = tparams.optimizer_bytes_per_param * worst_params / opt_bw
    elif lsp is not None:
        # LSP-Offload: what it moves (plan/offload_traffic.py: d x d per block matrix, the rest
        # as ZeRO-Offload) and AdamW on the host over the ZeRO path's parameters and the d x d
        # subspaces. The projections on the device are not priced.
        numel = host_adam_numel(
            m, lsp_dim=plan.lsp_dim, lsp_nonzeros=plan.lsp_nonzeros, dp_shard=plan.dp_shard
        )
        transfers = lsp.total / cluster.host_link.bandwidth
        host = tparams.optimizer_bytes_per_param * numel / (tparams.host_adam_GBps * 1e9)
        opt = (1 - tparams.offload_overlap) * (transfers + host)
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
            upload = n_mb * gathers * up_bytes * worst_params / link
            opt += max(0.0, upload - tparams.offload_overlap * pipe)
    breakdown["optimizer"] = opt
    # The stack's (on a device measured with the runtime, as measured there: `Stack.on_device`).
    fixed = _fixed_seconds(tparams)
    breakdown["fixed"] = fixed
    seconds = pipe + p2p_total + dp_sync + opt + fixed
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
