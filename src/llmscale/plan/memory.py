"""Per-GPU memory of a training step, as the llmscale runtime lays it out.

States (exact; `tests/plan/test_memory.py` has hand-computed cases):

- No sharding (dp_shard = 1): fp32 parameters (4 B each; they are the master weights), fp32
  gradients (4), AdamW exp_avg and exp_avg_sq (8), plus AdamW's 0-d fp32 `step` counter per
  tensor (torch keeps it on the CPU; counted here because the runtime's optimizer_bytes does).
  Under bf16/fp16 autocast every linear weight is cast once per forward and the cast is kept
  (autocast cache, then autograd) until that layer's backward: 2 B per linear weight and bias,
  reported as `working_params`.
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

Activations: `plan/activations.py` lists the tensors of one block; a stage holds them for every
micro-batch in flight (see `inflight_units`), plus the token ids on the first stage and the
head's tensors and the loss's logits on the last. `transient` adds the largest short-lived
buffer (the loss's fp32 logit gradients, or one block recomputed in backward, or FSDP's
reduce-scatter) to the end-of-forward peak, so the peak is an upper bound.

Allocator: PyTorch's caching allocator reserves more than it allocates (rounding, fragments);
`allocator_overhead` (default 5%) of the allocated total is added, and `device_reserve_GiB`
(CUDA context, cuBLAS workspace, NCCL buffers; not torch allocations) counts against capacity.

Pipeline: layers split evenly over pp (and chunks); embedding on the first rank, final norm and
head on the last. Tensor parallelism: see plan/params.py and the regions in plan/activations.py.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GPU, GiB, Node
from llmscale.plan import activations as act
from llmscale.plan.params import StageParams, stage_params
from llmscale.plan.setup import Plan

PARAM_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MemoryOptions:
    """Modelling choices that are not part of the plan, each with its default stated once."""

    kernels: act.Kernels = act.RUNTIME
    allocator_overhead: float = 0.05
    device_reserve_GiB: float = 1.5
    prefetch_blocks: int = 2


DEFAULT_OPTIONS = MemoryOptions()


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline rank `stage` at the step's peak (plus host bytes)."""

    stage: int
    params: float
    grads: float
    optimizer: float
    working_params: float
    activations: float
    transient: float
    allocator: float
    host: float
    inflight: float  # micro-batches of the stage's layers whose activations are held

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def allocated(self) -> float:
        """Predicted peak of torch.cuda.max_memory_allocated()."""
        return self.states + self.working_params + self.activations + self.transient

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
            "transient": self.transient,
            "allocator": self.allocator,
        }


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-stage memory; `worst` is the stage that decides whether the plan fits."""

    plan: Plan
    stages: tuple[StageMemory, ...]
    options: MemoryOptions = field(default=DEFAULT_OPTIONS)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def total(self) -> float:
        return self.worst.total

    def fits(self, gpu: GPU) -> bool:
        return self.total + self.options.device_reserve_GiB * GiB <= gpu.memory_bytes

    def fits_host(self, node: Node) -> bool:
        """The node's GPUs' host bytes (offload) within its host memory."""
        return max(s.host for s in self.stages) * node.gpus_per_node <= node.host_memory_bytes

    def headroom(self, gpu: GPU) -> float:
        """Bytes left on the fullest GPU (negative: does not fit)."""
        return gpu.memory_bytes - self.options.device_reserve_GiB * GiB - self.total


# ---- pipeline in-flight micro-batches -----------------------------------------------------


def inflight_units(schedule: str, pp: int, microbatches: int, chunks: int, rank: int) -> int:
    """Peak micro-batch-chunks whose forward is done and backward is not, on pipeline `rank`.

    GPipe runs every forward first: m. 1F1B warms up with pp - rank - 1 forwards, then one more
    before the first backward: min(pp - rank, m). Interleaved 1F1B (v chunks) warms up with
    (v - 1) * pp forwards to fill the earlier chunks and 2 (pp - rank - 1) to cover the last
    chunk's round trip, plus one: min((v-1)pp + 2(pp-rank-1) + 1, m v) chunk units, each 1/v of
    the rank's layers; on rank 0 that is pp(1 + (pp-1)/(pp v)) micro-batches' worth, Korthikanti
    et al. 2022 section 4.2.3. pp = 1 (accumulation only): one micro-batch at a time.
    """
    if pp == 1:
        return 1 * chunks
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - rank, microbatches)
    if schedule == "interleaved_1f1b":
        return min((chunks - 1) * pp + 2 * (pp - rank - 1) + 1, microbatches * chunks)
    raise ConfigError("parallel.pp_schedule", schedule, "gpipe | 1f1b | interleaved_1f1b")


def head_inflight(plan: Plan) -> int:
    """Micro-batches whose logits the last stage holds: all under GPipe, else one."""
    return plan.microbatches if plan.pp > 1 and plan.pp_schedule == "gpipe" else 1


def embedding_inflight(plan: Plan) -> int:
    """Micro-batches whose token ids the first stage holds (its first chunk's share)."""
    units = inflight_units(plan.pp_schedule, plan.pp, plan.microbatches, plan.chunks, 0)
    return min(math.ceil(units / plan.chunks), plan.microbatches)


# ---- states -------------------------------------------------------------------------------


def _states(plan: Plan, sp: StageParams, opt: MemoryOptions) -> tuple[float, ...]:
    """(params, grads, optimizer, working_params, fsdp_transient, host) in bytes."""
    pb = PARAM_DTYPE_BYTES[plan.precision]
    low = plan.precision != "fp32"
    counters = 4.0 * sp.tensors  # AdamW's fp32 `step` per tensor (on the CPU)
    if plan.sharded:
        shard = float(sp.shard_numel)
        blocks_live = min(opt.prefetch_blocks, sp.blocks) if plan.zero_stage == 3 else sp.blocks
        unsharded: float = pb * (blocks_live * sp.block.numel + sp.root_numel)
        rs_transient: float = (pb + 4) * sp.block.numel if low else 4 * sp.block.numel
    else:
        shard = float(sp.numel)
        unsharded = 2.0 * sp.autocast_numel if low else 0.0  # autocast's cast weights
        rs_transient = 0.0
    if plan.offload == "none":
        return 4 * shard, 4 * shard, 8 * shard + counters, unsharded, rs_transient, 0.0
    host = 12 * shard + counters
    if plan.offload == "optimizer":
        # Low-precision params stay on the device; autocast has nothing left to cast. Each
        # gradient goes to the host as soon as backward produces it and its device copy is
        # freed: about one block's gradients are on the device at a time (a transient).
        working = unsharded if plan.sharded else 0.0
        grads_in_flight = pb * sp.block.numel
        return pb * shard, 0.0, 0.0, working, max(rs_transient, grads_in_flight), host
    if plan.fsdp_cpu_offload:
        # optimizer+params under data parallelism is FSDP2's CPUOffloadPolicy: the fp32 shards
        # (the master), their fp32 gradients and Adam's moments on the host (16 B per parameter
        # of the shard); the device holds the unsharded units in use, as without offload.
        # Under replicate every unit stays from its forward to its backward (as ZeRO-1/2), and
        # its gradients are all-reduced in fp32 on the device before they go down.
        if not plan.sharded:
            unsharded = pb * float(sp.numel)
            rs_transient = (pb + 4) * sp.block.numel if low else 4 * sp.block.numel
        return 0.0, 0.0, 0.0, unsharded, rs_transient, 16 * shard + counters
    # optimizer+params: between uses the device holds no parameter; during forward and backward
    # `param_window` of them, plus one block's gradients in flight. The host also keeps a
    # working-dtype copy to upload (in fp32 the master itself is uploaded).
    window = pb * param_window(plan, sp, opt.prefetch_blocks)
    grads_in_flight = pb * sp.block.numel
    return (
        0.0,
        0.0,
        0.0,
        window,
        max(rs_transient, grads_in_flight),
        host + (pb * shard if low else 0),
    )


def param_window(plan: Plan, sp: StageParams, prefetch_blocks: int) -> float:
    """Most parameter elements on the device at once under optimizer+params (one process, TP, PP).

    The runtime's units are the embedding, each block and the head, in forward order, per model
    chunk of the rank; a unit is fetched with the next `prefetch_blocks - 1` after it (in
    backward, before it) and released when the next one begins (its gradients are in), so the
    device holds `prefetch_blocks` consecutive units. A tied embedding (read by the head too)
    stays from its forward to its gradient, on top of every window.
    """
    per_chunk = sp.blocks // plan.chunks
    tied = plan.model.tie_embeddings and sp.embedding is not None and sp.head is not None
    kept = sp.embedding.numel if tied and sp.embedding is not None else 0
    best = 0
    for c in range(plan.chunks):
        units: list[int] = [sp.block.numel] * per_chunk
        if c == 0 and sp.embedding is not None:
            units.insert(0, 0 if tied else sp.embedding.numel)
        if c == plan.chunks - 1 and sp.head is not None:
            units.append(sp.head.numel)
        width = max(1, min(prefetch_blocks, len(units)))
        for i in range(len(units) - width + 1):
            best = max(best, sum(units[i : i + width]))
    return float(best + kept)


# ---- activations --------------------------------------------------------------------------


def _block_modes(plan: Plan, layer_ids: list[int]) -> Counter[str]:
    """How many of `layer_ids` run each recompute mode (every_k: layers k-1, 2k-1, ... full)."""
    if plan.recompute == "every_k":
        k = plan.recompute_every_k
        return Counter("full" if (i + 1) % k == 0 else "none" for i in layer_ids)
    return Counter({plan.recompute: len(layer_ids)})


def _rank_layers(plan: Plan, rank: int) -> list[int]:
    """Global layer ids on pipeline rank `rank` (loop-style chunks for interleaved)."""
    per = plan.model.n_layers // (plan.pp * plan.chunks)
    out: list[int] = []
    for c in range(plan.chunks):
        start = (c * plan.pp + rank) * per
        out += range(start, start + per)
    return out


def plan_kernels(plan: Plan, kernels: act.Kernels) -> act.Kernels:
    """The kernel facts as they apply to this plan (are its forward weights low precision?)."""
    return act.with_weights(kernels, plan.lowp_weights)


def _block_bytes(plan: Plan, mode: str, opt: MemoryOptions) -> float:
    return act.block_bytes(
        plan.model,
        plan.micro_batch_size,
        plan.seq_len,
        plan.precision,
        plan.tp,
        plan.sequence_parallel,
        plan_kernels(plan, opt.kernels),
        mode,
    )


_ACT_CACHE: dict[tuple[object, ...], float] = {}


def stage_activation_bytes(plan: Plan, rank: int, opt: MemoryOptions = DEFAULT_OPTIONS) -> float:
    """Saved activations on pipeline `rank` at its peak (all in-flight micro-batches)."""
    key = (
        id(plan.model), id(opt), plan.seq_len, plan.micro_batch_size, plan.precision, plan.tp,
        plan.sequence_parallel, plan.recompute, plan.recompute_every_k, plan.pp,
        plan.pp_schedule, plan.chunks, plan.microbatches, rank, plan.lowp_weights,
    )  # fmt: skip
    return _memo(_ACT_CACHE, key, plan, opt, lambda: _stage_activation_bytes(plan, rank, opt))


_KEEP: dict[int, object] = {}
_T = TypeVar("_T")


def _memo(
    cache: dict[tuple[object, ...], _T],
    key: tuple[object, ...],
    plan: Plan,
    opt: MemoryOptions,
    compute: Callable[[], _T],
) -> _T:
    """`cache[key]`, computed on a miss. The key names the plan's model and options by id (the
    search builds many plans that share them, and hashing them is slow), so both are kept alive
    for as long as any entry may name them, and no other object can take their ids."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) > 1 << 16:
            cache.clear()
        _KEEP[id(plan.model)], _KEEP[id(opt)] = plan.model, opt
        hit = cache[key] = compute()
    return hit


def _stage_activation_bytes(plan: Plan, rank: int, opt: MemoryOptions) -> float:
    modes = _block_modes(plan, _rank_layers(plan, rank))
    per_micro = sum(n * _block_bytes(plan, m, opt) for m, n in modes.items())
    units = inflight_units(plan.pp_schedule, plan.pp, plan.microbatches, plan.chunks, rank)
    total = units * per_micro / plan.chunks
    if rank == 0:
        emb = sum(t.nbytes for t in act.embedding_tensors(plan.micro_batch_size, plan.seq_len))
        total += embedding_inflight(plan) * emb
    if rank == plan.pp - 1:
        head = act.head_bytes(
            plan.model,
            plan.micro_batch_size,
            plan.seq_len,
            plan.precision,
            plan.tp,
            plan.sequence_parallel,
            plan_kernels(plan, opt.kernels),
        )
        total += head_inflight(plan) * head
    return total


def estimate_memory(plan: Plan, options: MemoryOptions = DEFAULT_OPTIONS) -> MemoryEstimate:
    """Per-GPU bytes of every pipeline stage for `plan` (validated first)."""
    plan.validate()
    return _estimate(plan, options)


_STATES_CACHE: dict[tuple[object, ...], tuple[float, ...]] = {}


def _rank_states(plan: Plan, rank: int, opt: MemoryOptions) -> tuple[float, ...]:
    """`_states` of pipeline `rank`, cached on the fields it reads."""
    key = (
        id(plan.model), id(opt), plan.tp, plan.pp, rank, plan.dp_shard, plan.zero_stage,
        plan.offload, plan.precision, plan.dp_replicate > 1, plan.chunks,
    )  # fmt: skip

    def compute() -> tuple[float, ...]:
        vp = opt.kernels.vocab_parallel
        return _states(
            plan, stage_params(plan.model, plan.tp, plan.pp, rank, plan.dp_shard, vp), opt
        )

    return _memo(_STATES_CACHE, key, plan, opt, compute)


def _rank_pieces(plan: Plan, rank: int, opt: MemoryOptions) -> tuple[float, ...]:
    """(params, grads, optimizer, working, activations, transient, host) of one rank."""
    params, grads, optim, working, transient, host = _rank_states(plan, rank, opt)
    acts = stage_activation_bytes(plan, rank, opt)
    if rank == plan.pp - 1:
        loss = act.loss_transient_bytes(
            plan.model, plan.micro_batch_size, plan.seq_len, opt.kernels, plan.tp
        )
        transient = max(transient, loss)
    if plan.recompute in ("full", "every_k"):
        transient = max(transient, _block_bytes(plan, "none", opt))
    return params, grads, optim, working, acts, transient, host


def worst_total(plan: Plan, opt: MemoryOptions, ranks: tuple[int, ...]) -> float:
    """The largest `StageMemory.total` over `ranks`, without building the records."""
    worst = 0.0
    for rank in ranks:
        p = _rank_pieces(plan, rank, opt)
        worst = max(worst, (1 + opt.allocator_overhead) * sum(p[:6]))
    return worst


def _estimate(
    plan: Plan, opt: MemoryOptions, ranks: tuple[int, ...] | None = None
) -> MemoryEstimate:
    """Without validation; `ranks` limits the stages computed (the search's first and last)."""
    stages = []
    for rank in ranks if ranks is not None else range(plan.pp):
        params, grads, optim, working, acts, transient, host = _rank_pieces(plan, rank, opt)
        allocated = params + grads + optim + working + acts + transient
        units = inflight_units(plan.pp_schedule, plan.pp, plan.microbatches, plan.chunks, rank)
        stages.append(
            StageMemory(
                stage=rank,
                params=params,
                grads=grads,
                optimizer=optim,
                working_params=working,
                activations=acts,
                transient=transient,
                allocator=opt.allocator_overhead * allocated,
                host=host,
                inflight=units / plan.chunks,
            )
        )
    return MemoryEstimate(plan, tuple(stages), opt)


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
