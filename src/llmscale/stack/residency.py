"""When the llmscale runtime gathers parameters and reduces gradients, and what that costs.

The ZeRO stages, as DeepSpeed and Megatron define them, on FSDP2 over `dp_shard` (each
transformer block one FSDP unit, the model or pipeline stage root a unit of the rest):

| zero_stage | parameters gathered | gradients reduced | optimizer states |
|---|---|---|---|
| 1 | once per optimizer step, kept unsharded across micro-batches | accumulated unsharded, reduce-scattered once per step | sharded |
| 2 | once per optimizer step, kept unsharded across micro-batches | reduce-scattered after every micro-batch into sharded accumulators | sharded |
| 3 | in each micro-batch's forward and again in its backward | reduce-scattered after every micro-batch | sharded |

The rule itself is the llmscale stack's `param_residency` (`stack/__init__.py`), which the
planner's memory and time models read; the runtime (`parallel/data_parallel.py`) reads its
FSDP2 switches from `reshard_after_forward` and `micro_batch_controls` below, derived from it;
`predict_collectives` counts what they cause, the figures every metrics row carries
(`param_allgathers`, `grad_reduces`, `grad_allreduces` and their bytes, per rank and optimizer
step), so the planner and the runtime read one rule.

Under a pipeline schedule torch 2.13 drives FSDP itself (measured: pp 2 x dp_shard 2, every
schedule, 2 and 4 chunks; `pipeline_gathers`):
- gradients: `PipelineStage` runs every backward with gradient sync and reshard-after-backward
  off, and one REDUCE_GRAD per stage at the end of the step reduce-scatters the accumulated
  unsharded gradients: one reduction per unit per step whatever the zero stage (ZeRO-1's rule;
  zero 2 and 3 do not reduce per micro-batch under a pipeline).
- parameters: the multi-stage schedules unshard the next 3 stages a rank will compute on and
  reshard the others (`_add_unshard_reshard`), so with at most 3 chunks per rank a stage is
  gathered once and kept for the step under zero 1 and 2, and with 4 or more chunks stages are
  evicted and re-gathered within the step (4 chunks, 4 micro-batches: 3 gathers per unit on
  rank 0, about 2 on rank 1, instead of 1). Under zero 3 each forward reshards its stage; the
  next backward gathers it again and keeps it until that stage's next forward: m + 1 gathers
  per unit for m micro-batches under every schedule measured with 2 chunks.

Torch-free: the planner imports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from llmscale.config import V_SCHEDULES, pipeline_chunks
from llmscale.model.config import (
    EMBEDDING_WEIGHT,
    ModelConfig,
    split_layers,
    stage_ids,
    tied_copy,
)
from llmscale.stack import LLMSCALE, Residency, param_residency


def _residency(zero_stage: int, pp: int = 1, microbatches: int = 2) -> Residency:
    """The llmscale stack's gather and reduce rule (`stack.param_residency`, which the
    planner's memory and time read too)."""
    return param_residency(LLMSCALE, zero_stage=zero_stage, pp=pp, n_microbatches=microbatches)


def reshard_after_forward(zero_stage: int) -> bool:
    """FSDP2's `reshard_after_forward` for every unit, the root included: where the rule
    gathers again in backward (zero 3)."""
    return _residency(zero_stage).gathers_per_microbatch == 2


@dataclass(frozen=True)
class MicroBatchControls:
    """FSDP2's switches for one micro-batch's backward (no pipeline)."""

    requires_gradient_sync: bool  # reduce-scatter this micro-batch's gradients
    reshard_after_backward: bool  # free the unsharded parameters after this backward


def micro_batch_controls(zero_stage: int, last: bool) -> MicroBatchControls:
    """The switches for a micro-batch (`last`: the step's final one), without a pipeline.

    zero 1: no reduction and no reshard until the last micro-batch (gradients accumulate
    unsharded, parameters stay gathered); zero 2: reduce every micro-batch, reshard on the last;
    zero 3: reduce and reshard every micro-batch. Plain data parallelism (`dp_shard = 1`,
    `replicate`) follows zero 1's reduction rule: one all-reduce per step.
    """
    res = _residency(zero_stage)
    return MicroBatchControls(
        requires_gradient_sync=last or not res.grads_per_step,
        reshard_after_backward=last or res.gathers_per_microbatch > 0,
    )


@dataclass(frozen=True)
class Collectives:
    """Data-parallel collectives of one rank in one optimizer step.

    `param_allgathers`: FSDP all-gathers of parameters; `param_allgather_bytes`: the bytes they
    gather (each all-gather's output, the unit's whole padded flat buffer in the compute dtype).
    `grad_reduces`: FSDP reduce-scatters of gradients; `grad_reduce_bytes`: their input bytes
    (the unit's padded unsharded gradients in the reduce dtype, fp32). `grad_allreduces`:
    gradient all-reduces, of three kinds: HSDP's across replicas after each reduce-scatter (of
    its output, the unit's shard), `replicate`'s (dp_shard 1: the unit's whole gradients) and a
    tied pipeline's embedding all-reduce between the first and the last stage (this rank's
    local embedding gradient); `grad_allreduce_bytes`: their tensors' bytes (fp32).
    """

    param_allgathers: int = 0
    grad_reduces: int = 0
    param_allgather_bytes: int = 0
    grad_reduce_bytes: int = 0
    grad_allreduces: int = 0
    grad_allreduce_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def unit_numel(shapes: list[tuple[int, ...]], dp_shard: int) -> int:
    """Elements of one FSDP unit's flat all-gather buffer over `dp_shard` ranks: each tensor's
    first dimension padded to a multiple of `dp_shard` (FSDP2's dim-0 sharding)."""
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        total += math.ceil(shape[0] / dp_shard) * dp_shard * rest
    return total


def stage_units(
    model: ModelConfig,
    stage: int,
    n_stages: int,
    pp_layers: list[int] | tuple[int, ...] = (),
    v_shape: bool = False,
) -> list[list[tuple[int, ...]]]:
    """The FSDP units of pipeline stage `stage` of `n_stages` (1: the whole model), each a list
    of parameter shapes: one per block, then the root's (embedding on the first stage, final norm
    and output projection on the last: under a pipeline a tied embedding's copy), left out when
    it holds no parameter. In a tied V (`v_shape`) the one tied tensor is the last stage's: its
    root holds it, the first stage's root does not (`model.config.tied_copy`)."""
    groups = model.parameter_shapes()
    block = [s for _, s in groups["block"]]
    layers = split_layers(model.n_layers, n_stages, pp_layers)[stage]
    units = [list(block) for _ in layers]
    root: list[tuple[int, ...]] = []
    tied = n_stages > 1 and model.tie_embeddings
    shared = tied and not tied_copy(model, n_stages, v_shape=v_shape)  # a V: one tensor
    if stage == 0:
        root += [s for n, s in groups["embedding"] if not (shared and n == EMBEDDING_WEIGHT)]
    if stage == n_stages - 1:
        root += [s for _, s in groups["head"]]
        if tied:  # the last stage's copy of a tied embedding, or in a V the one tied tensor
            root.append((model.vocab_size, model.dim))
    if root:
        units.append(root)
    return units


# torch 2.13's `_add_unshard_reshard`: how many stages a multi-stage schedule keeps gathered.
MAX_ACTIVE_STAGES = 3


def pipeline_gathers(zero_stage: int, order: Sequence[tuple[str, int]]) -> dict[int, int]:
    """All-gathers per FSDP unit of each stage in one step under a pipeline schedule, from this
    rank's compute order (`order`: (kind "F" | "B" | "W", stage) in the order the rank runs them).

    What torch 2.13 does, replayed: before each op the schedule unshards the next
    `MAX_ACTIVE_STAGES` distinct stages it will compute on and reshards the others
    (`_add_unshard_reshard`; with at most 3 stages per rank a stage is resharded only once it
    has no work left in the step, so none is gathered twice); a
    forward gathers its stage if it is not gathered, and under zero 3 reshards it after; a
    backward gathers it if needed and leaves it gathered (`PipelineStage` turns
    reshard-after-backward off until the step's REDUCE_GRAD, which reshards). A W op needs no
    parameters. An unshard of a gathered stage costs nothing.
    """
    gathered: dict[int, bool] = {}
    count: dict[int, int] = {}

    def gather(stage: int) -> None:
        if not gathered.get(stage, False):
            count[stage] = count.get(stage, 0) + 1
            gathered[stage] = True

    # The window before each op: the next MAX_ACTIVE_STAGES distinct stages from it on, built
    # from the end (the window at i is stage i, then the window at i + 1 without it).
    windows: list[list[int]] = [[] for _ in order]
    after: list[int] = []
    for i in range(len(order) - 1, -1, -1):
        stage = order[i][1]
        after = [stage, *(s for s in after if s != stage)][:MAX_ACTIVE_STAGES]
        windows[i] = after
    active: list[int] = []
    for i, (kind, stage) in enumerate(order):
        count.setdefault(stage, 0)
        upcoming = windows[i]
        for s in [s for s in active if s not in upcoming]:
            active.remove(s)
            gathered[s] = False
        for s in upcoming:
            if s not in active:
                active.append(s)
                gather(s)
        if kind == "F":
            gather(stage)
            if reshard_after_forward(zero_stage):
                gathered[stage] = False
        elif kind == "B":
            gather(stage)
    return count


def few_stage_gathers(zero_stage: int, microbatches: int, rank_chunks: int) -> int | None:
    """`pipeline_gathers`' count per unit, in closed form, where a rank runs at most
    `MAX_ACTIVE_STAGES` chunks (none is then evicted): 1 under zero 1 and 2 (gathered at the
    step's start, kept), m + 1 under zero 3 (each forward reshards, each backward after one
    gathers again, and the step's start gathers once more). None beyond: replay the order.
    (Equal to the replay for gpipe, 1f1b, interleaved_1f1b and zero_bubble with up to 3
    chunks, zbv and dualpipev: tests/stack/test_residency.py.)"""
    if rank_chunks > MAX_ACTIVE_STAGES:
        return None
    return microbatches + 1 if reshard_after_forward(zero_stage) else 1


def predict_collectives(
    model: ModelConfig,
    *,
    dp_shard: int,
    zero_stage: int,
    microbatches: int,
    pp: int = 1,
    schedule: str = "1f1b",
    chunks: int = 1,
    pp_rank: int = 0,
    order: Sequence[tuple[str, int]] = (),
    pp_layers: list[int] | tuple[int, ...] = (),
    param_bytes: int = 4,
    reduce_bytes: int = 4,
    first_step: bool = False,
    replicas: int = 1,
) -> Collectives:
    """The counts pipeline rank `pp_rank` issues per optimizer step (its dp rank 0).

    `microbatches`: micro-batches per rank per step (accumulation, or the pipeline's).
    Without a pipeline: per unit, zero 1 one gather and one reduce-scatter, zero 2 one gather
    and `microbatches` reduce-scatters, zero 3 two gathers (forward, backward) and one
    reduce-scatter per micro-batch. Under a pipeline (`pp > 1`): one reduce-scatter per unit
    (REDUCE_GRAD) and the gathers `pipeline_gathers` counts from `order`, this rank's compute
    order (`plan.schedule.schedule_ops`, or torch's own); `first_step`: the run's first step,
    whose shape inference runs one more forward per stage: one more gather per unit, exact under
    zero 1 and 2 (measured, every schedule); under zero 3 the first step measured 1 to 2 more
    per unit still, not modelled (pp 2 x dp_shard 2, 4 micro-batches: 30-39 against 24-36).
    `param_bytes`: the compute dtype's size (FSDP2 gathers in it); `reduce_bytes`: 4 (fp32).
    `dp_shard`: the ranks FSDP shards over (dp_shard x cp); zero when it is 1 (nothing is
    sharded). zero_stage 0 (FSDP over cp alone) runs as 1.
    `replicas`: the ranks gradients are all-reduced over across replicas (dp_replicate under
    HSDP, or `replicate`'s group with dp_shard 1): each unit's reduction is then followed by
    (HSDP), or is (`replicate`, zero 1's rule: once per step), an all-reduce of its shard.
    A tied embedding under a pipeline not placed in a V adds one all-reduce on pp ranks 0 and
    pp - 1: the local embedding gradient, fp32 (dim 0 sharded over `dp_shard`).
    """
    fsdp = dp_shard > 1
    tied = tied_allreduce_numel(model, pp, schedule, pp_rank, dp_shard)
    tied_counts = Collectives(grad_allreduces=1, grad_allreduce_bytes=4 * tied) if tied else None
    if not fsdp and replicas <= 1:
        return tied_counts or Collectives()
    per_unit: list[tuple[list[tuple[int, ...]], int, int]] = []  # (shapes, gathers, reduces)
    if pp <= 1:
        res = _residency(zero_stage if fsdp else 1, 1, microbatches)
        gathers = res.gathers_per_microbatch * microbatches or 1
        reduces = 1 if res.grads_per_step else microbatches
        per_unit = [(u, gathers, reduces) for u in stage_units(model, 0, 1, pp_layers)]
    else:
        if not order:
            raise ValueError("a pipeline's collectives need the rank's compute order")
        n_chunks = pipeline_chunks(schedule, chunks)
        n_stages = pp * n_chunks
        gathers_of = pipeline_gathers(zero_stage, order)
        v_shape = schedule in V_SCHEDULES
        for s in stage_ids(pp_rank, pp, n_chunks, v_shape=v_shape):
            g = gathers_of.get(s, 0) + (1 if first_step else 0)
            per_unit += [(u, g, 1) for u in stage_units(model, s, n_stages, pp_layers, v_shape)]
    ag = rs = ag_b = rs_b = ar = ar_b = 0
    for shapes, g, r in per_unit:
        n = unit_numel(shapes, dp_shard)
        if fsdp:
            ag, rs = ag + g, rs + r
            ag_b += g * n * param_bytes
            rs_b += r * n * reduce_bytes
        if replicas > 1:  # each reduction's output (the shard) all-reduced across replicas
            ar += r
            ar_b += r * n // dp_shard * reduce_bytes
    if tied_counts is not None:
        ar += tied_counts.grad_allreduces
        ar_b += tied_counts.grad_allreduce_bytes
    return Collectives(ag, rs, ag_b, rs_b, ar, ar_b)


def tied_allreduce_numel(
    model: ModelConfig, pp: int, schedule: str, pp_rank: int, dp_shard: int = 1
) -> int:
    """Elements pipeline rank `pp_rank` all-reduces per step to sum a tied embedding's two
    gradients (`parallel.tied_embeddings`): its local embedding gradient on pp ranks 0 and
    pp - 1 (dim 0 sharded over `dp_shard` under FSDP2: dp rank 0's share), none in a V (both
    stages on one rank) or without a pipeline."""
    v_shape = schedule in V_SCHEDULES
    if not tied_copy(model, pp) or v_shape or pp_rank not in (0, pp - 1):
        return 0
    return math.ceil(model.vocab_size / dp_shard) * model.dim
