"""When the llmscale runtime gathers parameters and reduces gradients, and what that costs.

The ZeRO stages, as DeepSpeed and Megatron define them, on FSDP2 over `dp_shard` (each
transformer block one FSDP unit, the model or pipeline stage root a unit of the rest):

| zero_stage | parameters gathered | gradients reduced | optimizer states |
|---|---|---|---|
| 1 | once per optimizer step, kept unsharded across micro-batches | accumulated unsharded, reduce-scattered once per step | sharded |
| 2 | once per optimizer step, kept unsharded across micro-batches | reduce-scattered after every micro-batch into sharded accumulators | sharded |
| 3 | in each micro-batch's forward and again in its backward | reduce-scattered after every micro-batch | sharded |

The runtime (`parallel/data_parallel.py`) reads its FSDP2 switches from `reshard_after_forward`
and `micro_batch_controls` below; `predict_collectives` counts what they cause, the four figures
every metrics row carries (`param_allgathers`, `grad_reduces` and their bytes, per rank and
optimizer step), so the planner and the runtime read one rule.

Under a pipeline schedule torch 2.13's `PipelineStage` drives FSDP itself: every backward runs
with resharding and gradient sync off, and one REDUCE_GRAD per stage at the end of the step
reduce-scatters the accumulated gradients (one reduction per unit per step, whatever the zero
stage: ZeRO-1's reduction). Parameters are gathered by the units' own forward hooks:
zero 1 and 2 keep them from the first forward to the end of the step (one gather per unit per
step), zero 3 reshards after every forward, so each forward gathers and the following backward
gathers again unless it comes straight after the same stage's forward. `predict_collectives`
counts this per schedule, from the schedule's own order of forwards and backwards.

Torch-free: the planner imports it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from llmscale.config import V_SCHEDULES, pipeline_chunks
from llmscale.model.config import ModelConfig, split_layers, stage_ids

ZERO_STAGES_SHARDED = (1, 2, 3)


def reshard_after_forward(zero_stage: int) -> bool:
    """FSDP2's `reshard_after_forward` for every unit, the root included: zero 3 only."""
    return zero_stage == 3


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
    if zero_stage == 3:
        return MicroBatchControls(True, True)
    if zero_stage == 2:
        return MicroBatchControls(True, last)
    return MicroBatchControls(last, last)


@dataclass(frozen=True)
class Collectives:
    """Data-parallel collectives of one rank in one optimizer step.

    `param_allgathers`: FSDP all-gathers of parameters; `param_allgather_bytes`: the bytes they
    gather (each all-gather's output, the unit's whole padded flat buffer in the compute dtype).
    `grad_reduces`: FSDP reduce-scatters of gradients; `grad_reduce_bytes`: their input bytes
    (the unit's padded unsharded gradients in the reduce dtype, fp32). Not counted: HSDP's
    all-reduce across replicas and `replicate`'s all-reduce.
    """

    param_allgathers: int = 0
    grad_reduces: int = 0
    param_allgather_bytes: int = 0
    grad_reduce_bytes: int = 0

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
    model: ModelConfig, stage: int, n_stages: int, pp_layers: list[int] | tuple[int, ...] = ()
) -> list[list[tuple[int, ...]]]:
    """The FSDP units of pipeline stage `stage` of `n_stages` (1: the whole model), each a list
    of parameter shapes: one per block, then the root's (embedding on the first stage, final norm
    and untied output projection on the last), left out when it holds no parameter."""
    groups = model.parameter_shapes()
    block = [s for _, s in groups["block"]]
    layers = split_layers(model.n_layers, n_stages, pp_layers)[stage]
    units = [list(block) for _ in layers]
    root: list[tuple[int, ...]] = []
    if stage == 0:
        root += [s for _, s in groups["embedding"]]
    if stage == n_stages - 1:
        root += [s for _, s in groups["head"]]
    if root:
        units.append(root)
    return units


def _pipeline_gathers(
    zero_stage: int, order: list[tuple[int, str]], stage: int, microbatches: int
) -> int:
    """All-gathers per unit of `stage` in one step under a pipeline, from this rank's op order
    (`order`: (stage, "F" | "B" | "W") in schedule order).

    zero 1/2: one. zero 3: each forward gathers; a backward gathers unless the stage's previous
    op was its own forward with nothing resharded since (the stage stays gathered after a
    backward: `PipelineStage` turns reshard-after-backward off until REDUCE_GRAD).
    """
    if zero_stage != 3:
        return 1
    gathered = False
    count = 0
    for s, op in order:
        if s != stage:
            continue
        if op == "F":
            if not gathered:
                count += 1
            gathered = False  # resharded after forward
        elif op == "B":
            if not gathered:
                count += 1
            gathered = True
    return count


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
    pp_layers: list[int] | tuple[int, ...] = (),
    param_bytes: int = 4,
    reduce_bytes: int = 4,
    order: list[tuple[int, str]] | None = None,
) -> Collectives:
    """The four counts one rank (pipeline rank `pp_rank`) issues per optimizer step.

    `microbatches`: micro-batches per rank per step (accumulation, or the pipeline's). Under a
    multi-stage zero-3 pipeline `order` is this rank's (stage, op) order from the schedule;
    without it each stage's micro-batches are assumed to run F then B back to back
    (GPipe-like gathers: 2 per micro-batch except the last forward's backward).
    `param_bytes`: the compute dtype's size (FSDP2 gathers in it); `reduce_bytes`: 4 (fp32).
    Zero when `dp_shard` is 1 (nothing is sharded).
    """
    if dp_shard <= 1:
        return Collectives()
    if zero_stage not in ZERO_STAGES_SHARDED:
        raise ValueError(f"zero_stage {zero_stage} with dp_shard {dp_shard} > 1")
    if pp <= 1:
        units = stage_units(model, 0, 1, pp_layers)
        gathers = 2 * microbatches if zero_stage == 3 else 1
        reduces = 1 if zero_stage == 1 else microbatches
        per_unit = [(gathers, reduces)] * len(units)
    else:
        n_chunks = pipeline_chunks(schedule, chunks)
        n_stages = pp * n_chunks
        mine = stage_ids(pp_rank, pp, n_chunks, v_shape=schedule in V_SCHEDULES)
        units, per_unit = [], []
        for s in mine:
            stage_order = order
            if stage_order is None:
                stage_order = [(s, op) for _ in range(microbatches) for op in "F"] + [
                    (s, "B") for _ in range(microbatches)
                ]
            g = _pipeline_gathers(zero_stage, stage_order, s, microbatches)
            for u in stage_units(model, s, n_stages, pp_layers):
                units.append(u)
                per_unit.append((g, 1))
    out = Collectives()
    ag = rs = ag_b = rs_b = 0
    for shapes, (g, r) in zip(units, per_unit, strict=True):
        n = unit_numel(shapes, dp_shard)
        ag += g
        rs += r
        ag_b += g * n * param_bytes
        rs_b += r * n * reduce_bytes
    out = Collectives(ag, rs, ag_b, rs_b)
    return out
