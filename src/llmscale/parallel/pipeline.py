"""Pipeline parallelism: split the model by layers into stages, run them with a torch schedule.

Stages are contiguous runs of blocks: `parallel.pp_layers` of them each, or automatically as even
as the layer count allows with the first and last stages the lighter ones (the first also carries
the embedding, the last the output projection and the loss): `model.config.stage_layer_counts`,
which the planner reads too. Stage 0 keeps the
embeddings, the last stage the final norm and output; the model's forward already handles each
of them being absent, and blocks keep their names (`layers.5...`), so a checkpoint saved under
one split loads under another.

With `pp_chunks` = v > 1 (interleaved 1F1B) there are pp x v stages and rank r holds stages
r, r + pp, r + 2 pp, ... (loop style, as `ScheduleInterleaved1F1B` expects).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from llmscale.instrument.pipeline import PipelineRecorder
from llmscale.model.config import split_layers, stage_ids
from llmscale.model.transformer import Transformer

__all__ = [
    "build_pipeline_schedule",
    "build_stage_module",
    "pipeline_split",
    "split_layers",
    "stage_ids",
]


def build_stage_module(
    model: Transformer, stage: int, n_stages: int, pp_layers: list[int] | tuple[int, ...] = ()
) -> Transformer:
    """A copy of `model` with only stage `stage`'s layers (and embeddings/head where they live)."""
    part = copy.deepcopy(model)
    keep = split_layers(model.cfg.n_layers, n_stages, pp_layers)[stage]
    for name in list(part.layers.keys()):
        if int(name) not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
        part.pos_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def pipeline_split(
    model: Transformer,
    pp_rank: int,
    pp: int,
    chunks: int,
    pp_layers: list[int] | tuple[int, ...] = (),
) -> tuple[list[Transformer], list[int]]:
    """This pipeline rank's model chunks and their stage indices (`pp_layers`: layers per stage,
    empty for the automatic split)."""
    ids = stage_ids(pp_rank, pp, chunks)
    return [build_stage_module(model, s, pp * chunks, pp_layers) for s in ids], ids


def build_pipeline_schedule(
    parts: list[nn.Module],
    ids: list[int],
    n_stages: int,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    group: torch.distributed.ProcessGroup,
    timeline: PipelineRecorder | None = None,
) -> object:
    """A torch.distributed.pipelining schedule over this rank's stages.

    `loss_fn` must already divide by the number of micro-batches (the schedule is built with
    scale_grads=False), so accumulated gradients equal those of one pass over the whole batch.
    With `timeline`, the stages' per-chunk forward and backward (and the loss) are timed.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    stages = [
        PipelineStage(part, stage_index=s, num_stages=n_stages, device=device, group=group)
        for part, s in zip(parts, ids, strict=True)
    ]
    if timeline is not None:
        timeline.watch(stages)
        loss_fn = timeline.timed_loss(loss_fn)
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    (stage,) = stages
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
