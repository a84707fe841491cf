"""Apply the job's parallel layout to a model, in torchtitan's order.

(fp8: the float8 linears swapped in) -> pipeline split -> tensor (and sequence) parallelism ->
context parallelism (ring attention) -> activation checkpointing -> (train.compile: each
block compiled) -> FSDP2.

Each step only rewrites modules in place (or, for the split, copies and prunes them), so
parameter names never change: checkpoints load across layouts and the model file knows nothing
of any of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmscale.config import RUNTIME_FLOAT8_RECIPES, RUNTIME_PRECISIONS, JobConfig, pipeline_chunks
from llmscale.errors import ConfigError
from llmscale.model.transformer import Transformer
from llmscale.parallel.activation_checkpoint import apply_recompute
from llmscale.parallel.activation_offload import apply_activation_offload
from llmscale.parallel.compile import apply_compile, compile_problem
from llmscale.parallel.context_parallel import apply_cp
from llmscale.parallel.data_parallel import CollectiveCounter, apply_fsdp
from llmscale.parallel.dims import ParallelDims
from llmscale.parallel.float8 import convert_to_fp8, fp8_problem
from llmscale.parallel.pipeline import pipeline_split
from llmscale.parallel.tensor_parallel import apply_tp


@dataclass
class ParallelModel:
    """This rank's model chunks: one, or several under a multi-chunk pipeline schedule."""

    parts: list[nn.Module]
    stage_ids: list[int]  # pipeline stage index of each part ([0] without pipelining)
    n_stages: int
    # FSDP's all-gathers and reduce-scatters on this rank (zero without dp_shard)
    collectives: CollectiveCounter = field(default_factory=CollectiveCounter)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids


def parallelize(model: Transformer, dims: ParallelDims, cfg: JobConfig) -> ParallelModel:
    """Split, shard and wrap `model` for this rank; in a single process only recompute applies."""
    p = cfg.parallel
    if cfg.precision.mode == "fp8":  # before any split or sharding, as torchtitan converts
        convert_to_fp8(model, cfg.precision.float8_recipe)
    if dims.pp > 1:
        parts, ids = pipeline_split(
            model, dims.pp_rank, dims.pp, p.pp_chunks, p.pp_layers, p.pp_schedule
        )
        n_stages = dims.pp * pipeline_chunks(p.pp_schedule, p.pp_chunks)
    else:
        parts, ids, n_stages = [model], [0], 1
    counter = CollectiveCounter()
    for part in parts:
        if dims.tp > 1:
            apply_tp(part, dims.submesh("tp"), p.sequence_parallel)
        if dims.cp > 1:
            apply_cp(part, dims.cp_group())
        apply_recompute(part, cfg.train.recompute, cfg.train.recompute_every_k)
        apply_activation_offload(part, cfg.train.offload_activations)
        if cfg.train.compile:  # after TP and recompute, before FSDP's hooks (torchtitan's order)
            apply_compile(part)
        if dims.reduces_grads:  # dp x cp > 1: the cp ranks' gradients are reduced too
            apply_fsdp(
                part,
                dims.dp_mesh(),
                shard=dims.fsdp,
                zero_stage=p.zero_stage,
                precision=cfg.precision.mode,
                cpu_offload=cfg.fsdp_cpu_offload,
                counter=counter,
            )
    return ParallelModel(list(parts), ids, n_stages, counter)


def check_runtime_support(cfg: JobConfig, device: torch.device) -> None:
    """Refuse, with one line, config values the planner costs but this runtime cannot run here.

    `parallel.cp > 1` runs with data, tensor (and sequence) and pipeline parallelism and
    activation checkpointing, not with optimizer offload (not built: refused).
    `precision.mode = "nvfp4"`: not trained here (a planner precision: Megatron-Core's).
    `precision.mode = "fp8"`: torchao's float8 training (parallel/float8.py), which needs
    torchao, a CUDA GPU with FP8 matmuls (compute capability 8.9 or later) and tp = 1; the
    message names what is missing.
    `train.compile` with tp > 1 off CUDA, or with cp > 1 (parallel/compile.py's
    `compile_problem`), or with `train.offload_activations` (save_on_cpu around a block).
    """
    # (cp > 1 with offload or compile: JobConfig.validate refuses them, for the dry run too.)
    if cfg.train.compile:
        why = compile_problem(cfg.parallel.tp, device)
        if why is not None:
            raise ConfigError("train.compile", True, f"false with tp > 1 here ({why})")
        if cfg.train.offload_activations:
            raise ConfigError(
                "train.compile",
                True,
                "false with train.offload_activations > 0 (save_on_cpu's hooks are not traced "
                "into a compiled block here)",
            )
    if cfg.precision.mode == "nvfp4":
        others = " | ".join(RUNTIME_PRECISIONS)
        raise ConfigError(
            "precision.mode",
            "nvfp4",
            f"{others} (this runtime has no NVFP4 training; plan TransformerEngine's NVFP4 recipe "
            "with `llmscale plan --stack megatron-core --precision nvfp4`)",
        )
    if cfg.precision.mode == "fp8" and cfg.precision.float8_recipe == "mxfp8":
        raise ConfigError(
            "precision.float8_recipe",
            "mxfp8",
            f"{' | '.join(RUNTIME_FLOAT8_RECIPES)} (this runtime has no MXFP8 training; plan "
            "TransformerEngine's MXFP8 recipe with `llmscale plan --stack megatron-core "
            "--precision fp8 --float8-recipe mxfp8`)",
        )
    if cfg.precision.mode == "fp8":
        why = fp8_problem(cfg, device)
        if why is not None:
            others = " | ".join(m for m in RUNTIME_PRECISIONS if m != "fp8")
            raise ConfigError("precision.mode", "fp8", f"{others} (fp8 training {why})")
