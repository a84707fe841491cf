"""Per-GPU memory of a training step, as the llmscale runtime lays it out.

States (exact; `tests/plan/test_memory.py` has hand-computed cases):

- No sharding (dp_shard = 1): fp32 parameters (4 B each; they are the master weights), fp32
  gradients (4), AdamW exp_avg and exp_avg_sq (8), plus AdamW's 0-d fp32 `step` counter per
  tensor (torch keeps it on the CPU; counted here because the runtime's optimizer_bytes does).
  Under bf16/fp16 autocast every linear weight is cast once per forward and the cast is kept
  (autocast cache, then autograd) until that layer's backward: 2 B per linear weight and bias,
  reported as `working_params`. Under the runtime's `replicate` (dp x cp > 1, no sharding)
  FSDP2's param_dtype replaces autocast's casts: every parameter's copy in param_dtype, held
  from its unit's forward to its backward (`working_params`), and fp32 gradients all-reduced
  (a transient, as FSDP2's reduce-scatter).
- FSDP2 (dp_shard = N > 1, `fully_shard` per block and at the root): sharded fp32 parameters,
  gradients (reduce_dtype fp32) and Adam states, rank 0's padded shard (see plan/params.py).
  Unsharded parameters in param_dtype (bf16 for bf16/fp16, else fp32) are `working_params`:
  zero_stage 3 reshards after forward, so `prefetch_blocks` blocks (the current and the
  prefetched next) plus the root's (embedding, final norm, head: FSDP2 keeps the root unsharded
  from forward to backward); zero_stage 1 and 2 (`reshard_after_forward=False`) keep every
  block of the stage unsharded from its forward to its backward. Reduce-scatter needs one
  block's unsharded gradients plus their fp32 copy: a transient.
- Offload "optimizer": AdamW states and the fp32 master move to the host (12 B per parameter of
  the rank's shard); the device keeps low-precision parameters (param_dtype); each gradient
  leaves for the host as backward produces it (one block's in flight). "optimizer+params" also
  keeps the parameters on the host between uses: the device holds only `prefetch_blocks`
  consecutive units (embedding, blocks, head; `param_window`) while they run, as
  `working_params`, and nothing between steps; the host also keeps a param_dtype copy to upload
  (none in fp32, where the master is uploaded). Under FSDP2 the mode is FSDP2's
  CPUOffloadPolicy: fp32 shards, their gradients and the moments on the host (16 B per
  parameter of the shard), on the device the unsharded units in use as without offload.
- Offload "lsp" (LSP-Offload, one process; plan/lsp.py): the weights in param_dtype on the
  device with the blocks' projectors and update buffers (as `optimizer`); the moments of the
  blocks' matrices in their d x d subspaces and the rest's as "optimizer" on the host.

- FSDP2 under pipelining (dp_shard > 1, pp > 1): torch's schedules turn gradient sync and
  resharding after backward off for every micro-batch and reduce-scatter once at the step's end
  (`stack.param_residency`), so at the end of the last backward a stage
  holds every unit's unsharded parameters (param_dtype, `working_params`, whatever the
  zero_stage) and its unsharded fp32 gradients (`grads`: 4 B per TP-local parameter instead of
  the shard; the sharded gradients only replace them unit by unit as they are reduced). A rank
  with two or three stages (a V, interleaved) holds all of its units' parameters at the step's
  start instead, where the schedule issues every stage's all-gather, and reshards a stage once
  it has no op left (measured, a tied ZB-V: tests/parallel/test_fsdp_pipeline_memory.py).
- Context parallelism (cp > 1): FSDP2 shards over dp_shard x cp (`Plan.fsdp_shards_for`: under
  torchtitan also with dp_shard 1); without FSDP the cp ranks hold the states whole. Activations, token ids and logits are split on the
  sequence: 1/cp of each (ring attention keeps no s x s matrix beyond its own queries' rows).
- fp8 (torchao float8 training): as bf16. torchao's float8 linears save their bf16 input and
  weight and cast both (and the output gradient) to float8 per matmul: 1-byte transients, not
  counted; FSDP2 all-gathers bf16 weights (torchao's float8 all-gather is opt-in).
- nvfp4 (TransformerEngine's NVFP4 recipe under Megatron-Core): as bf16, the linears saving
  their column-wise NVFP4 inputs (plan/activations.py `SAVED_CAST_BYTES`), plus the blocks'
  quantised weights that TransformerEngine keeps from a step's first micro-batch to its last
  (`is_first_microbatch`): a row-wise and a column-wise copy, 0.5625 B per parameter each
  (`NVFP4_WEIGHT_COPIES`), in `working_params`.

Activations: `plan/activations.py` lists the tensors of one block; a stage holds them for every
micro-batch in flight (see `inflight_units`), plus the token ids on the first stage and the
head's tensors and the loss's logits on the last. `transient` adds the largest short-lived
buffer (the loss's fp32 logit gradients, or one block recomputed in backward, or FSDP's
reduce-scatter) to the end-of-forward peak, so the peak is an upper bound.
Activation offload (`train.offload_activations` = N, pp 1, no recompute): the first N blocks'
saved tensors wait in host memory (`host`) between their forward and their backward, so the
device holds the other blocks' (TransformerEngine's schedule under Megatron-Core keeps at most
n_layers - N blocks' on the device; torch's `save_on_cpu` moves each tensor as it is saved).

Allocator: PyTorch's caching allocator reserves more than it allocates (rounding, fragments);
`allocator_overhead` (default 5%) of the allocated total is added, and `device_reserve_GiB`
(CUDA context, cuBLAS workspace, NCCL buffers; not torch allocations) counts against capacity.
A plan fits when its allocated peak does: the allocator's share is a cache it flushes before it
fails (`MemoryEstimate.fits`), and a plan that fits only without it fits tightly (`tight`).

Pipeline: layers split as the runtime splits them (`model.config.split_layers`: contiguous,
`parallel.pp_layers` or automatic with the first and last stages the lighter); embedding on the
first rank, final norm and head on the last (in a V, zbv and dualpipev, on the first too:
`Plan.head_rank`). Micro-batches in flight per rank come from plan/schedule.py's op orders; the
zero-bubble schedules hold a micro-batch's activations from its F until its W, all of them
(measured, torch 2.13: B runs with retain_graph and frees none of the stage's saved tensors,
only the loss's; on the first stage B does nothing and W runs the whole backward; W frees all:
tests/parallel/test_split_backward_meter.py, and predicted = measured in the pipeline suite).
Besides the saved activations (`pipeline_held`, measured to the byte by the runtime's
`parallel.pipeline.PipelineMemory`): the stages' receive buffers, one activation and one
gradient per micro-batch (`pipeline_buffers`), and what a split B keeps, each linear's and norm
weight's output gradient and the stage output until W and the input gradient until the step
ends (`pending_weight_grads`, its peak on the op order). `total` adds their peaks to the
activations' (an upper bound: those peak at an F, these at a B); docs/schedule.md, "Memory of
the split schedules". Tensor parallelism: see plan/params.py and the regions in
plan/activations.py.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from llmscale.config import (
    DTYPE_BYTES,
    FP8_MATMUL_BYTES,
    NVFP4_MATMUL_BYTES,
    SPLIT_BACKWARD_SCHEDULES,
)
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GPU, GiB
from llmscale.model.config import BlockMode, stage_ids
from llmscale.plan import activations as act
from llmscale.plan.cache import Memo
from llmscale.plan.lsp import lsp_memory
from llmscale.plan.params import RankParams, rank_params
from llmscale.plan.plan import Plan
from llmscale.plan.schedule import (
    held_after_b_peak,
    held_grad_points,
    inflight_units,
    split_b_count,
)
from llmscale.plan.work import cp_share, plan_kernels, rank_work, slice_args
from llmscale.stack import LLMSCALE, Stack, param_residency

__all__ = [
    "DEFAULT_OPTIONS",
    "MemoryEstimate",
    "Activity",
    "MemoryOptions",
    "RankMemory",
    "RankPieces",
    "block_bytes",
    "cp_share",
    "embedding_inflight",
    "estimate_memory",
    "floor_allocated",
    "floor_pieces",
    "head_inflight",
    "inflight_units",
    "memory_options",
    "pipeline_held",
    "PipelineHeld",
    "param_window",
    "plan_kernels",
    "plan_rank_params",
    "rank_activity",
    "rank_pieces",
    "rank_states",
    "slice_args",
    "rank_activation_bytes",
    "rank_block_bytes",
    "worst_total",
    "zero_textbook_bytes",
]


@dataclass(frozen=True)
class MemoryOptions:
    """What the memory model reads besides the plan: the training stack (when parameters are
    gathered, what the pipeline keeps) and the facts of it that a caller may replace (a
    measured device's kernels). Build one with `memory_options(stack)`."""

    kernels: act.Kernels = act.RUNTIME
    allocator_overhead: float = LLMSCALE.allocator_overhead.value
    device_reserve_GiB: float = LLMSCALE.device_reserve_GiB
    prefetch_blocks: int = LLMSCALE.prefetch_blocks
    stack: Stack = LLMSCALE


def memory_options(
    stack: Stack, kernels: act.Kernels | None = None, compiled: bool = False
) -> MemoryOptions:
    """The memory model's options for `stack` (`kernels`: a measured device's instead;
    `compiled`: under torch.compile, which some stacks extend to the loss)."""
    return MemoryOptions(
        kernels=stack.kernels_for(compiled) if kernels is None else kernels,
        allocator_overhead=stack.allocator_overhead.value,
        device_reserve_GiB=stack.device_reserve_GiB,
        prefetch_blocks=stack.prefetch_blocks,
        stack=stack,
    )


DEFAULT_OPTIONS = MemoryOptions()


def usable_bytes(gpu: GPU, options: MemoryOptions = DEFAULT_OPTIONS) -> float:
    """What `gpu` offers torch's allocations: its memory less the device reserve (CUDA context,
    cuBLAS workspaces, NCCL buffers)."""
    return gpu.memory_bytes - options.device_reserve_GiB * GiB


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one GPU of pipeline rank `pp_rank` at the step's peak (plus host bytes)."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    working_params: float
    activations: float
    transient: float
    allocator: float
    host: float
    inflight: float  # micro-batches of the stage's layers whose activations are held
    pending_weight_grads: float = 0.0  # split backwards: what B keeps for W (the step's peak)
    pipeline_buffers: float = 0.0  # the stages' receive buffers (activations, gradients)

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def allocated(self) -> float:
        """Predicted peak of torch.cuda.max_memory_allocated()."""
        return (
            self.states + self.working_params + self.activations + self.transient
            + self.pending_weight_grads + self.pipeline_buffers
        )  # fmt: skip

    @property
    def total(self) -> float:
        """Allocated plus the caching allocator's overhead."""
        return self.allocated + self.allocator

    def breakdown(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "working_params": self.working_params,
            "activations": self.activations,
            "pending_weight_grads": self.pending_weight_grads,
            "pipeline_buffers": self.pipeline_buffers,
            "transient": self.transient,
            "allocator": self.allocator,
        }


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-stage memory; `worst` is the stage that decides whether the plan fits."""

    plan: Plan
    per_rank: tuple[RankMemory, ...]
    options: MemoryOptions = field(default=DEFAULT_OPTIONS)

    @property
    def worst(self) -> RankMemory:
        return max(self.per_rank, key=lambda s: s.total)

    @property
    def total(self) -> float:
        return self.worst.total

    def fits(self, gpu: GPU) -> bool:
        """Whether the allocated peak fits `gpu` beside the device reserve. The caching
        allocator's share over it (`RankMemory.allocator`) is a cache, not a need: when
        cudaMalloc fails the allocator frees its unused cached blocks and retries before it
        reports out of memory (torch.cuda.memory_stats: `num_alloc_retries`, "failed cudaMalloc
        calls that result in a cache flush and retry"), so a run whose share does not fit runs
        with less of it (`tight`)."""
        return self.worst.allocated <= usable_bytes(gpu, self.options)

    def tight(self, gpu: GPU) -> bool:
        """Whether it fits `gpu` only without the caching allocator's usual share: the
        allocator will flush its cache (a device synchronisation each time) to stay within
        the memory, and fragmentation it cannot flush may still run it out."""
        return self.fits(gpu) and self.total > usable_bytes(gpu, self.options)


class RankPieces(NamedTuple):
    """Bytes of one pipeline rank by kind, before the allocator's overhead."""

    params: float
    grads: float
    optimizer: float
    working_params: float  # unsharded, cast or uploaded parameters in use
    activations: float
    transient: float
    host: float
    pending_weight_grads: float = 0.0  # split backwards: B's gradients waiting for W
    pipeline_buffers: float = 0.0  # the stages' receive buffers

    @property
    def allocated(self) -> float:
        """Device bytes at the peak (everything but `host`)."""
        return self.allocated_with(self.pending_weight_grads)

    def allocated_with(self, pending_weight_grads: float) -> float:
        """`allocated` with `pending_weight_grads` in place of this record's (the search's
        bounds, without building a record for each)."""
        return _device_bytes(
            self.params, self.grads, self.optimizer, self.working_params, self.activations,
            self.transient, pending_weight_grads, self.pipeline_buffers,
        )  # fmt: skip


def _device_bytes(
    params: float,
    grads: float,
    optimizer: float,
    working_params: float,
    activations: float,
    transient: float,
    pending_weight_grads: float,
    pipeline_buffers: float,
) -> float:
    """`RankPieces.allocated`'s sum, in its one order (`floor_allocated` adds the same)."""
    return (
        params + grads + optimizer + working_params + activations + transient
        + pending_weight_grads + pipeline_buffers
    )  # fmt: skip


# ---- pipeline in-flight micro-batches (counts from plan/schedule.py) ---------------------------


def head_inflight(plan: Plan) -> int:
    """Micro-batches whose logits the last stage holds: all under GPipe, else one."""
    return plan.n_microbatches if plan.pp > 1 and plan.pp_schedule == "gpipe" else 1


def embedding_inflight(plan: Plan, stack: Stack = LLMSCALE) -> int:
    """Micro-batches whose token ids the first stage holds (its first chunk's share). torch's
    pipelining (`stack.pipeline == "torch"`) splits the step's batch into views of it
    (`tensor_split`), so while any micro-batch's embedding keeps its ids, the whole batch's
    storage stays: all the step's micro-batches (measured where the first stage holds the
    embedding alone: tests/plan/test_predicted_vs_measured.py)."""
    if plan.pp > 1 and stack.pipeline == "torch":
        return plan.n_microbatches
    units = inflight_units(plan.pp_schedule, plan.pp, plan.n_microbatches, plan.chunks, 0)
    return min(math.ceil(units / plan.chunks), plan.n_microbatches)


# ---- states -------------------------------------------------------------------------------


def plan_rank_params(
    plan: Plan, rank: int, kernels: act.Kernels, stack: Stack = LLMSCALE
) -> RankParams:
    """Parameters of pipeline `rank` as the runtime lays them out (its layer split, TP plan),
    sharded as `stack` shards them (`Plan.fsdp_shards_for`)."""
    vp = kernels.splits_vocab(plan.model, plan.tp)
    return rank_params(
        plan.model, plan.tp, plan.pp, rank, plan.fsdp_shards_for(stack), vp, plan.chunks,
        plan.pp_layers, plan.v_shape,
    )  # fmt: skip


def _states(plan: Plan, rank: int, rp: RankParams, opt: MemoryOptions) -> RankPieces:
    """Params, grads, optimizer, working params, FSDP's transient and host bytes (activations 0)."""
    pb = DTYPE_BYTES[plan.precision]
    low = plan.precision != "fp32"
    counters = 4.0 * rp.tensors  # AdamW's fp32 `step` per tensor (on the CPU)
    grads_held: float | None = None  # FSDP2 + PP: unsharded gradients until the step's end
    weights_shard, grad_bytes = 0.0, 4.0  # besides the fp32 shard; per element of the shard
    fsdp = plan.fsdp_for(opt.stack)
    if fsdp:
        shard = float(rp.shard_numel)
        res = param_residency(
            opt.stack, zero_stage=plan.zero_stage, pp=plan.pp, n_microbatches=plan.n_microbatches
        )
        blocks_live = rp.blocks if res.stage_unsharded else min(opt.prefetch_blocks, rp.blocks)
        if res.grads_unsharded:
            grads_held = held_grads(plan, rank, rp, opt.stack)
        unsharded: float = model_weight_bytes(plan, rp, opt.stack, blocks_live)
        rs_transient: float = (pb + 4) * rp.block.numel if low else 4 * rp.block.numel
        if opt.stack.sharding == "megatron" and low:
            # Megatron-FSDP shards its gradients in the main-gradient dtype (main_grad_buffer:
            # fp32 only with grad_reduce_in_fp32) and, sharding the parameters too
            # (optim_grads_params), its model-dtype weights beside the fp32 main weights
            # (megatron_fsdp/param_and_grad_buffer.py: model_weight_buffer, main_weight_buffer)
            grad_bytes = float(opt.stack.main_grad_bytes)
            if res.gathers_per_microbatch:
                weights = model_weight_bytes(plan, rp, opt.stack, rp.blocks)
                weights_shard = weights * shard / rp.numel
    elif plan.fsdp_cpu_offload or (
        plan.offload == "none" and plan.dp * plan.cp > 1 and opt.stack.sharding == "llmscale"
    ):
        # The runtime's replicate (FSDP2's, with its param_dtype: autocast casts nothing; also
        # any stack's FSDP2 CPUOffloadPolicy): every unit's copy in param_dtype from its forward
        # to its backward (measured: tests/parallel/test_fsdp_pipeline_memory.py), its
        # gradients all-reduced in fp32. (torchtitan's DDP runs autocast; Megatron's DDP and
        # the other offloads are read as they were.)
        shard = float(rp.numel)
        unsharded = pb * float(rp.numel)
        rs_transient = (pb + 4) * rp.block.numel if low else 4 * rp.block.numel
        if plan.pp > 1 and plan.offload == "none":  # its hooks are FSDP2's
            grads_held = held_grads(plan, rank, rp, opt.stack)
    else:
        shard = float(rp.numel)
        unsharded = 2.0 * rp.autocast_numel if low else 0.0  # autocast's cast weights
        rs_transient = 0.0
    if plan.offload == "none":
        grads = grad_bytes * shard if grads_held is None else grads_held
        return RankPieces(
            4 * shard + weights_shard, grads, 8 * shard + counters, unsharded, 0.0, rs_transient,
            0.0,
        )  # fmt: skip
    if plan.offload == "lsp":
        return lsp_pieces(plan, max(rs_transient, pb * rp.block.numel), unsharded if fsdp else 0.0)
    host = 12 * shard + counters
    if plan.offload == "optimizer":
        # Low-precision params stay on the device; autocast has nothing left to cast. Each
        # gradient goes to the host as soon as backward produces it and its device copy is
        # freed: about one block's gradients are on the device at a time (a transient).
        working = unsharded if fsdp else 0.0
        grads_in_flight = pb * rp.block.numel
        return RankPieces(
            pb * shard,
            grads_held or 0.0,
            0.0,
            working,
            0.0,
            max(rs_transient, grads_in_flight),
            host,
        )
    if plan.fsdp_cpu_offload:
        # optimizer+params under data parallelism is FSDP2's CPUOffloadPolicy: the fp32 shards
        # (the master), their fp32 gradients and Adam's moments on the host (16 B per parameter
        # of the shard); the device holds the unsharded units in use, as without offload.
        # Under replicate every unit stays from its forward to its backward (as above).
        return RankPieces(
            0.0, grads_held or 0.0, 0.0, unsharded, 0.0, rs_transient, 16 * shard + counters
        )
    # optimizer+params: between uses the device holds no parameter; during forward and backward
    # `param_window` of them, plus one block's gradients in flight. The host also keeps a
    # working-dtype copy to upload (in fp32 the master itself is uploaded).
    window = pb * param_window(plan, rank, rp, opt.prefetch_blocks)
    grads_in_flight = pb * rp.block.numel
    return RankPieces(
        params=0.0,
        grads=0.0,
        optimizer=0.0,
        working_params=window,
        activations=0.0,
        transient=max(rs_transient, grads_in_flight),
        host=host + (pb * shard if low else 0),
    )


def model_weight_bytes(plan: Plan, rp: RankParams, stack: Stack, blocks: int) -> float:
    """Bytes of `blocks` of `rp`'s blocks, and of its embedding and head, in the dtype the
    stack computes with: the working precision, the block linears' weights in FP8 where the
    stack keeps FP8 parameters (`Stack.fp8_params`; norms, embedding and head stay bf16)."""
    pb = DTYPE_BYTES[plan.precision]
    block = pb * rp.block.numel
    if stack.fp8_params and plan.fp8_matmuls:
        block -= (pb - FP8_MATMUL_BYTES) * rp.block.saved_cast_numel
    return blocks * block + pb * rp.root_numel


def held_grads(plan: Plan, rank: int, rp: RankParams, stack: Stack) -> float:
    """The most unsharded gradient bytes pipeline `rank` holds while they wait for the step's
    reduction. Megatron's main gradients are one buffer for the rank's whole step (the main
    gradient bytes of every parameter); FSDP2 (and the runtime's replicate) under torch's
    schedules hold a chunk's reduce-dtype accumulator from its first post-backward to its
    reduction, and a split backward's param-dtype weight gradients beside it from its W to the
    next post-backward, so a rank's chunks need not hold both at once (`held_grad_points`,
    walked on the schedule's op order; measured in tests/parallel/test_fsdp_pipeline_memory.py).
    Without a pipeline, the accumulator of the one stage."""
    main = float(stack.main_grad_bytes)
    if plan.pp == 1 or stack.sharding == "megatron":
        return main * rp.numel
    pb = DTYPE_BYTES[plan.precision]
    tied_v = plan.model.tie_embeddings and plan.v_shape
    numel = _chunk_numels(plan, rank, rp)
    emb = rp.embedding.numel if rp.embedding is not None else 0
    c = plan.chunks
    same = pb >= main  # fp32: the gradients accumulate in place, one tensor
    best = 0.0
    for p in held_grad_points(plan.pp_schedule, plan.pp, plan.n_microbatches, c, rank, tied_v):
        if same:
            total = sum(main * n * (p[i] or p[c + i]) for i, n in enumerate(numel))
        else:
            total = sum((main * p[i] + pb * p[c + i]) * n for i, n in enumerate(numel))
            total += pb * emb * p[-1]
        best = max(best, total)
    return best


_CHUNK_NUMELS: Memo[tuple[float, ...]] = Memo("memory.chunk_numels")


def _chunk_numels(plan: Plan, rank: int, rp: RankParams) -> tuple[float, ...]:
    """Parameters of each model chunk of pipeline `rank` (`rp`'s blocks, and the embedding on
    the first stage, the head on the last: in a tied V the one tied tensor is the last stage's)."""

    def compute() -> tuple[float, ...]:
        tied_v = plan.model.tie_embeddings and plan.v_shape
        n_stages = plan.pp * plan.chunks
        ids = stage_ids(rank, plan.pp, plan.chunks, plan.v_shape)
        emb = rp.embedding.numel if rp.embedding is not None else 0
        head = rp.head.numel if rp.head is not None else 0
        numel = []
        for g, layers in zip(ids, plan.rank_stages(rank), strict=True):
            n = len(layers) * rp.block.numel
            if g == 0 and not tied_v:
                n += emb
            if g == n_stages - 1:
                n += head + (emb if tied_v else 0)
            numel.append(float(n))
        return tuple(numel)

    key = (id(rp), plan.pp, plan.chunks, plan.v_shape, plan.model.tie_embeddings, rank)
    return _CHUNK_NUMELS.get(key, compute, (rp,))


def lsp_pieces(plan: Plan, transient: float, working: float = 0.0) -> RankPieces:
    """offload "lsp" (plan/lsp.py; one process or data parallel): the rank's weights in the
    working dtype, the projectors and update buffers as device optimizer state, the moments of
    both paths on the host; under FSDP2 `working`, the units all-gathered as for "optimizer"."""
    row = lsp_memory(
        plan.model,
        lsp_dim=plan.lsp_dim,
        lsp_nonzeros=plan.lsp_nonzeros,
        precision=plan.precision,
        n_microbatches=plan.n_microbatches,
        dp_replicate=plan.dp_replicate,
        dp_shard=plan.dp_shard,
    )
    host = sum(v for k, v in row.items() if k.startswith("host_"))
    return RankPieces(
        float(row["param_bytes"]), 0.0, float(row["device_lsp_bytes"]), working, 0.0,
        transient, float(host),
    )  # fmt: skip


def param_window(plan: Plan, rank: int, rp: RankParams, prefetch_blocks: int) -> float:
    """Most parameter elements on the device at once under optimizer+params (one process, TP, PP).

    The runtime's units are the embedding, each block and the head, in forward order, per model
    chunk of the rank; a unit is fetched with the next `prefetch_blocks - 1` after it (in
    backward, before it) and released when the next one begins (its gradients are in), so the
    device holds `prefetch_blocks` consecutive units. A tied embedding (read by the head too)
    stays from its forward to its gradient, on top of every window.
    """
    tied = plan.model.tie_embeddings and rp.embedding is not None and rp.head is not None
    kept = rp.embedding.numel if tied and rp.embedding is not None else 0
    best = 0
    for c, layers in enumerate(plan.rank_stages(rank)):
        units: list[int] = [rp.block.numel] * len(layers)
        if c == 0 and rp.embedding is not None:
            units.insert(0, 0 if tied else rp.embedding.numel)
        if c == plan.chunks - 1 and rp.head is not None:
            units.append(rp.head.numel)
        width = max(1, min(prefetch_blocks, len(units)))
        for i in range(len(units) - width + 1):
            best = max(best, sum(units[i : i + width]))
    return float(best + kept)


# ---- activations --------------------------------------------------------------------------


def block_bytes(plan: Plan, mode: BlockMode, kernels: act.Kernels) -> float:
    """Bytes one block of `plan` saves for one micro-batch under block mode `mode` (on one of
    its cp ranks: 1/cp of the sequence)."""
    return cp_share(plan) * act.block_bytes(*slice_args(plan, kernels), mode)


_ACTIVATIONS: Memo[float] = Memo("memory.rank_activation_bytes")


def rank_activation_bytes(plan: Plan, rank: int, opt: MemoryOptions = DEFAULT_OPTIONS) -> float:
    """Saved activations on pipeline `rank` at its peak (all in-flight micro-batches)."""
    key = (*plan.activations_key(), id(opt), rank)
    compute = lambda: _rank_activation_bytes(plan, rank, opt)  # noqa: E731
    return _ACTIVATIONS.get(key, compute, (plan.model, opt))


def rank_block_bytes(plan: Plan, rank: int, opt: MemoryOptions = DEFAULT_OPTIONS) -> float:
    """Bytes the blocks of pipeline `rank` save for one micro-batch (all its chunks)."""
    return rank_work(plan, rank, opt.kernels).blocks_saved


def _rank_activation_bytes(plan: Plan, rank: int, opt: MemoryOptions) -> float:
    work = rank_work(plan, rank, opt.kernels)
    # With uneven chunks (interleaved), a chunk unit is taken as the rank's mean chunk.
    units = inflight_units(plan.pp_schedule, plan.pp, plan.n_microbatches, plan.chunks, rank)
    # (offloaded blocks' saved tensors wait on the host: pp 1, one micro-batch in flight)
    total = units * (work.blocks_saved - work.host_saved) / plan.chunks
    if work.embedding:
        total += embedding_inflight(plan, opt.stack) * work.embedding_saved
    torch_1f1b = opt.stack.pipeline == "torch" and plan.pp_schedule == "1f1b"
    if rank == plan.head_rank and plan.pp > 1 and torch_1f1b:
        # torch's Schedule1F1B still holds the previous micro-batch's loss while the next one
        # runs forward on the last stage; its graph keeps every checkpointed region's inputs
        # alive (its other saved tensors were freed by its backward): one micro-batch more of
        # those (measured: tests/plan/test_predicted_vs_measured.py).
        args = slice_args(plan, opt.kernels)
        total += cp_share(plan) * sum(
            n * sum(t.nbytes for t in act.checkpoint_inputs(act.block_tensors(*args, m), m))
            for m, n in work.modes.items()
        )
    if work.head:
        total += head_inflight(plan) * work.head_saved
    return total


def estimate_memory(
    plan: Plan,
    options: MemoryOptions = DEFAULT_OPTIONS,
    ranks: tuple[int, ...] | None = None,
    validate: bool = True,
) -> MemoryEstimate:
    """Per-GPU bytes of every pipeline stage for `plan` (validated first unless `validate` is
    False); `ranks` limits the stages computed (the search's first and last)."""
    if validate:
        plan.validate()
    stages = []
    for rank in ranks if ranks is not None else range(plan.pp):
        p = rank_pieces(plan, rank, options)
        units = inflight_units(plan.pp_schedule, plan.pp, plan.n_microbatches, plan.chunks, rank)
        stages.append(
            RankMemory(
                pp_rank=rank,
                **p._asdict(),
                allocator=options.allocator_overhead * p.allocated,
                inflight=units / plan.chunks,
            )
        )
    return MemoryEstimate(plan, tuple(stages), options)


# The NVFP4 copies of each block weight TransformerEngine keeps across a step's micro-batches:
# the row-wise one (forward) and the column-wise one (data gradient).
NVFP4_WEIGHT_COPIES = 2
_STATES: Memo[RankPieces] = Memo("memory.rank_states")


def rank_states(plan: Plan, rank: int, opt: MemoryOptions = DEFAULT_OPTIONS) -> RankPieces:
    """The states of pipeline `rank` (params, grads, optimizer, working params, FSDP's
    transient, host; no activations), cached on the fields they read."""

    def compute() -> RankPieces:
        rp = plan_rank_params(plan, rank, opt.kernels, opt.stack)
        states = _states(plan, rank, rp, opt)
        if plan.nvfp4_matmuls:  # TransformerEngine's quantised weights, kept for the step
            cached = NVFP4_WEIGHT_COPIES * NVFP4_MATMUL_BYTES * rp.blocks * rp.block.numel
            states = states._replace(working_params=states.working_params + cached)
        return states

    return _STATES.get((*plan.states_key(), id(opt), rank), compute, (plan.model, opt))


def rank_pieces(plan: Plan, rank: int, opt: MemoryOptions = DEFAULT_OPTIONS) -> RankPieces:
    """Every piece of pipeline `rank`'s memory, activations and transients included."""
    floor = _rank_floor(plan, rank, opt)
    if not _splits_backward(plan, opt):
        return floor
    return floor._replace(pending_weight_grads=pipeline_held(plan, rank, opt).pending_weight_grads)


def _splits_backward(plan: Plan, opt: MemoryOptions) -> bool:
    """Does some B of `plan`'s schedule keep gradients for its W (`pipeline_held`)?"""
    return (
        plan.pp > 1 and opt.stack.pipeline != "freed"
        and plan.pp_schedule in SPLIT_BACKWARD_SCHEDULES
    )  # fmt: skip


def _rank_floor(plan: Plan, rank: int, opt: MemoryOptions) -> RankPieces:
    """`rank_pieces` but the split backwards' pending gradients (0): no more than it, and it
    needs no walk of the schedule's op order."""
    return floor_pieces(rank_states(plan, rank, opt), rank_activity(plan, rank, opt))


def floor_pieces(states: RankPieces, activity: Activity) -> RankPieces:
    """A rank's pieces but the split backwards' pending gradients, from its states
    (`rank_states`) and what its micro-batches add (`rank_activity`)."""
    acts, transient, buffers, host = activity
    # (`states._replace(...)`, built directly: the search builds one per plan and rank)
    return RankPieces(
        states.params, states.grads, states.optimizer, states.working_params, acts,
        max(states.transient, transient), states.host + host, states.pending_weight_grads,
        buffers,
    )  # fmt: skip


def floor_allocated(states: RankPieces, activity: Activity) -> float:
    """`floor_pieces(states, activity).allocated`, without building the record (the search
    tests tens of thousands of floors against its budget)."""
    acts, transient, buffers, _ = activity
    return _device_bytes(
        states.params, states.grads, states.optimizer, states.working_params, acts,
        max(states.transient, transient), states.pending_weight_grads, buffers,
    )  # fmt: skip


def rank_activity(plan: Plan, rank: int, opt: MemoryOptions = DEFAULT_OPTIONS) -> Activity:
    """What pipeline `rank`'s micro-batches add to its states, cached on the fields they read
    (`Plan.activations_key`)."""
    key = (*plan.activations_key(), id(opt), rank)
    return _ACTIVITY.get(key, lambda: _activity(plan, rank, opt), (plan.model, opt))


class Activity(NamedTuple):
    """What a rank's micro-batches add to its states: saved activations, the largest
    transient besides FSDP's (the loss's logit gradients, a recomputed block; 0 when none),
    the pipeline stages' receive buffers, and the saved activations offloaded blocks keep in
    host memory (`RankWork.host_saved`)."""

    activations: float
    transient: float
    pipeline_buffers: float
    host: float = 0.0


_ACTIVITY: Memo[Activity] = Memo("memory.rank_activity")


def _activity(plan: Plan, rank: int, opt: MemoryOptions) -> Activity:
    args = slice_args(plan, opt.kernels)
    transient = 0.0
    if rank == plan.head_rank:
        transient = cp_share(plan) * act.loss_transient_bytes(*args)
    recomputed = plan.recompute in ("full", "every_k")
    # A block's backward: its MLP's gradients beside what it saved, and, recomputed, beside
    # the whole of its forward, for a moment.
    block = cp_share(plan) * act.mlp_backward_bytes(*args)
    if recomputed:
        block += rank_work(plan, rank, opt.kernels).block_saved["none"]
    transient = max(transient, block)
    if plan.cp > 1 and opt.stack.cp_rotate == "allgather":  # torch's context_parallel
        model, b, s, precision, tp, _, kernels = args
        ring = act.torch_ring_backward_bytes(model, b, s, precision, tp, plan.cp, kernels)
        # beside the attention half of the block it differentiates (recomputed for it, or
        # among the saved activations already)
        live = cp_share(plan) * act.attention_live_bytes(*args) if recomputed else 0.0
        transient = max(transient, live + ring)
    acts = _rank_activation_bytes(plan, rank, opt)  # (cached with this, on the same key)
    host = rank_work(plan, rank, opt.kernels).host_saved
    return Activity(acts, transient, _pipeline_buffers(plan, rank, opt), host)


class PipelineHeld(NamedTuple):
    """What a pipeline rank's stages hold besides saved activations (the runtime's
    `parallel.pipeline.PipelineMemory`): the step's peak of what split backwards keep from B
    (`pending_weight_grad_bytes`) and the receive buffers (`pipeline_buffer_bytes`)."""

    pending_weight_grads: float
    pipeline_buffers: float


_HELD: Memo[PipelineHeld] = Memo("memory.pipeline_held")


def pipeline_held(
    plan: Plan,
    rank: int,
    opt: MemoryOptions = DEFAULT_OPTIONS,
    pipeline_key: tuple[Hashable, ...] | None = None,
) -> PipelineHeld:
    """torch 2.13's `PipelineStage` on pipeline `rank` (measured in docs/schedule.md, "Memory
    of the split schedules"):

    - receive buffers: per stage and micro-batch, one residual-stream tensor received forward
      (every stage but the first) and one backward (every stage but the last), kept;
    - a split B (zero_bubble, zbv, dualpipev; not their full backwards) keeps until its W the
      output gradient of every linear and norm weight of the stage's blocks (and the head's,
      with the logits'), and the stage's output; the received output gradient is the last w2's
      (a view; a buffer already); and until the step ends the input gradient it computed (on
      the received activation). Where two consecutive stages share a rank (the bottom of a V)
      the output of one is the other's received activation and the input gradient of the
      other the one's received gradient: buffers, not counted twice.

    The step's peak comes from the schedule's op order (`schedule.held_after_b_peak`).
    `pipeline_key`: `plan.pipeline_key()` where the caller has it (`worst_total`).
    """
    key = (*(plan.pipeline_key() if pipeline_key is None else pipeline_key), id(opt), rank)
    compute = lambda: _pipeline_held(plan, rank, opt)  # noqa: E731
    return _HELD.get(key, compute, (plan.model, opt))


_BUFFERS: Memo[float] = Memo("memory.pipeline_buffers")


def _pipeline_buffers(plan: Plan, rank: int, opt: MemoryOptions) -> float:
    """The receive buffers of `pipeline_held` (cached on `Plan.pipeline_key`)."""
    if plan.pp == 1 or opt.stack.pipeline == "freed":  # Megatron frees each output once sent
        return 0.0
    key = (*plan.pipeline_key(), id(opt), rank)
    return _BUFFERS.get(key, lambda: _receive_buffers(plan, rank, opt), (plan.model, opt))


def _receive_buffers(plan: Plan, rank: int, opt: MemoryOptions) -> float:
    """The receive buffers, and the outputs the stack's schedule keeps until the step ends
    (`Stack.pipeline_outputs_kept`: every micro-batch's, the last stage's its logits)."""
    args = slice_args(plan, opt.kernels)
    boundary = cp_share(plan) * act.boundary_bytes(*args)
    m, n_stages = plan.n_microbatches, plan.pp * plan.chunks
    ids = stage_ids(rank, plan.pp, plan.chunks, plan.v_shape)
    total = sum(m * boundary * ((g != 0) + (g != n_stages - 1)) for g in ids)
    kept = opt.stack.pipeline_outputs_kept
    for g in ids:
        if g == n_stages - 1 and kept != "none":
            total += m * cp_share(plan) * act.logits_bytes(*args)
        elif kept == "all":
            total += m * boundary
    return total


def _pipeline_held(plan: Plan, rank: int, opt: MemoryOptions) -> PipelineHeld:
    buffers = _pipeline_buffers(plan, rank, opt)
    if not _splits_backward(plan, opt):
        return PipelineHeld(0.0, buffers)
    until_w, until_end = _held_weights(plan, rank, opt)
    m = plan.n_microbatches
    peak = held_after_b_peak(plan.pp_schedule, plan.pp, m, plan.chunks, rank, until_w, until_end)
    return PipelineHeld(peak, buffers)


_HELD_WEIGHTS: Memo[tuple[list[float], list[float]]] = Memo("memory.held_weights")


def _held_weights(plan: Plan, rank: int, opt: MemoryOptions) -> tuple[list[float], list[float]]:
    """Per chunk of `rank`, the bytes a split B keeps until its W and until the step's end
    (cached on `Plan.pipeline_key`, as `pipeline_held` and `_held_floor`, which both read it)."""
    key = (*plan.pipeline_key(), id(opt), rank)
    compute = lambda: _compute_held_weights(plan, rank, opt)  # noqa: E731
    return _HELD_WEIGHTS.get(key, compute, (plan.model, opt))


def _compute_held_weights(
    plan: Plan, rank: int, opt: MemoryOptions
) -> tuple[list[float], list[float]]:
    args = slice_args(plan, opt.kernels)
    share = cp_share(plan)
    n_stages = plan.pp * plan.chunks
    ids = stage_ids(rank, plan.pp, plan.chunks, plan.v_shape)
    boundary = share * act.boundary_bytes(*args)
    block = share * sum(t.nbytes for t in act.block_output_grads(*args))
    head = share * sum(t.nbytes for t in act.head_output_grads(*args))
    a = DTYPE_BYTES[plan.precision]
    # The last block's w2 output gradient is the received gradient itself (a view) where no
    # cast or tensor-parallel reduction sits between them.
    w2_is_received = plan.tp == 1 and act.residual_bytes(a, opt.kernels) == a
    until_w, until_end = [], []
    for g, layers in zip(ids, plan.rank_stages(rank), strict=True):
        last, next_here = g == n_stages - 1, g + 1 in ids
        pending = 0.0 if next_here or last else boundary  # the stage's output
        if g != 0:  # the first stage's B does nothing (its W runs the whole backward)
            pending += len(layers) * block + (head if last else 0.0)
            if not last and len(layers) and w2_is_received:
                pending -= boundary
        until_w.append(pending)
        until_end.append(0.0 if g == 0 or g - 1 in ids else boundary)
    return until_w, until_end


_HELD_FLOOR: Memo[float] = Memo("memory.held_floor")


def _held_floor(
    plan: Plan, rank: int, opt: MemoryOptions, pipeline_key: tuple[Hashable, ...] | None = None
) -> float:
    """No more than `pipeline_held`'s pending gradients, without walking the op order: its
    last split B is a point of the held frontier, where every split B so far keeps its input
    gradient (`until_end`); 0 where the schedule does not say how many Bs are split."""

    def compute() -> float:
        n = split_b_count(plan.pp_schedule, plan.n_microbatches)
        if n is None:
            return 0.0
        return sum(n * e for e in _held_weights(plan, rank, opt)[1])

    key = (*(plan.pipeline_key() if pipeline_key is None else pipeline_key), id(opt), rank)
    return _HELD_FLOOR.get(key, compute, (plan.model, opt))


# A lower bound is trusted to exceed the limit only by more than this share (its sum runs in
# another order than the peak's: rounding).
_BOUND_MARGIN = 1e-12


def worst_total(
    plan: Plan,
    opt: MemoryOptions,
    ranks: tuple[int, ...],
    limit: float = math.inf,
    known: Sequence[RankPieces] | None = None,
) -> float:
    """The largest `RankMemory.total` over `ranks`, without building the records. Past
    `limit`, some total above it: the first rank whose memory without the split backwards'
    pending gradients (a lower bound) already exceeds it answers, before the other ranks and
    without walking the schedule's op order. `known`: those lower bounds of `ranks` (each
    rank's `floor_pieces`) where the caller has them (the search)."""
    over = 1 + opt.allocator_overhead
    floors = []
    for i, r in enumerate(ranks):
        p = _rank_floor(plan, r, opt) if known is None else known[i]
        total = over * p.allocated
        if total > limit:
            return total
        floors.append((total, p, r))
    if not _splits_backward(plan, opt):
        return max(total for total, _, _ in floors)
    key = plan.pipeline_key()  # (once for every rank's two lookups)
    if limit < math.inf:
        for _, p, r in floors:
            bound = over * p.allocated_with(_held_floor(plan, r, opt, key))
            if bound > limit * (1 + _BOUND_MARGIN):
                return bound
    return max(
        over * p.allocated_with(pipeline_held(plan, r, opt, key).pending_weight_grads)
        for _, p, r in floors
    )


# ---- the textbook view ----------------------------------------------------------------------


def zero_textbook_bytes(num_params: int, zero_stage: int, dp: int) -> float:
    """Rajbhandari et al. 2020 (ZeRO), mixed-precision Adam: 2 + 2 + K = 12 bytes per parameter.

    Stage 0: 16 psi; stage 1 shards the optimizer (4 psi + 12 psi / N); stage 2 also the
    gradients (2 psi + 14 psi / N); stage 3 everything (16 psi / N). Activations not included.
    """
    psi, n = float(num_params), dp
    if zero_stage == 0:
        return 16 * psi
    if zero_stage == 1:
        return 4 * psi + 12 * psi / n
    if zero_stage == 2:
        return 2 * psi + 14 * psi / n
    if zero_stage == 3:
        return 16 * psi / n
    raise ConfigError("parallel.zero_stage", zero_stage, "0 | 1 | 2 | 3")
