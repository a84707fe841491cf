"""Job configuration: TOML file, one dataclass section per concern, overridable from the CLI.

`llmscale train --config configs/default.toml --train.steps 20 --precision.mode bf16`

This module does not import torch: the planner reads the same sections.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from llmscale.errors import ConfigError, UsageError
from llmscale.model.config import (
    PRESETS,
    SHAPE_KEYS,
    ModelConfig,
    auto_split_ok,
    from_hf_config,
    get_preset,
    pp_layers_problem,
)
from llmscale.paths import folder_problem

# Every choice a job can make, once. Validation, `--help`, the planner and the docs read these.
Precision = Literal["fp32", "bf16", "fp16", "fp8", "nvfp4"]
# Float8 recipes under fp8: torchao's (`Float8LinearConfig.from_recipe_name`), which this runtime
# trains with, and TransformerEngine's MXFP8 block scaling ("mxfp8"), which it plans only.
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"]
Recompute = Literal["none", "full", "selective", "selective_op", "every_k"]
PPSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"]
LRDecay = Literal["cosine", "linear", "constant"]
Device = Literal["auto", "cpu", "cuda"]
Offload = Literal["none", "optimizer", "optimizer+params", "lsp"]
MemoryCheck = Literal["error", "warn", "off"]
OffloadKernel = Literal["fused", "exact"]
OptimizerName = Literal["adamw"]
ZeroStage = Literal[0, 1, 2, 3]

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
FLOAT8_RECIPES: tuple[Float8Recipe, ...] = get_args(Float8Recipe)
# The float8 recipes this runtime trains with: torchao's (mxfp8, TransformerEngine's MXFP8 block
# scaling, is planned only: parallel/parallelize.py).
RUNTIME_FLOAT8_RECIPES: tuple[Float8Recipe, ...] = tuple(r for r in FLOAT8_RECIPES if r != "mxfp8")


def float8_recipe_needs_fp8(mode: str, recipe: str, mode_name: str) -> str | None:
    """What a float8 recipe other than tensorwise (the default) needs: precision fp8. None when
    `recipe` applies, else what is allowed, naming the precision as `mode_name` does (a config
    key, a flag)."""
    if recipe == "tensorwise" or mode == "fp8":
        return None
    return f"tensorwise with {mode_name} {mode}"


# The precisions this runtime trains in (nvfp4 is planned only: parallel/parallelize.py).
RUNTIME_PRECISIONS: tuple[Precision, ...] = tuple(p for p in PRECISIONS if p != "nvfp4")
RECOMPUTE_MODES: tuple[Recompute, ...] = get_args(Recompute)
PP_SCHEDULES: tuple[PPSchedule, ...] = get_args(PPSchedule)
LR_DECAYS: tuple[LRDecay, ...] = get_args(LRDecay)
DEVICES: tuple[Device, ...] = get_args(Device)
OFFLOAD_MODES: tuple[Offload, ...] = get_args(Offload)
MEMORY_CHECKS: tuple[MemoryCheck, ...] = get_args(MemoryCheck)
OFFLOAD_KERNELS: tuple[OffloadKernel, ...] = get_args(OffloadKernel)
ZERO_STAGES: tuple[ZeroStage, ...] = get_args(ZeroStage)
# Pipeline schedules with pp_chunks >= 2 model chunks per rank, placed loop-style (rank r holds
# stages r, r + pp, ...), and those with exactly two chunks placed in a V (rank r holds stages r
# and 2 pp - 1 - r). zero_bubble, zbv and dualpipev split each backward into B and W.
LOOP_MULTI_CHUNK_SCHEDULES: tuple[PPSchedule, ...] = ("interleaved_1f1b", "zero_bubble")
V_SCHEDULES: tuple[PPSchedule, ...] = ("zbv", "dualpipev")
SPLIT_BACKWARD_SCHEDULES: tuple[PPSchedule, ...] = ("zero_bubble", "zbv", "dualpipev")


def microbatch_rule(schedule: str, pp: int, microbatches: int) -> str | None:
    """What `schedule` needs of the micro-batches per step on `pp` stages, or None when
    `microbatches` meets it: every schedule but gpipe at least one per stage (pp); the
    loop-style multi-chunk ones a multiple of pp (interleaved_1f1b: Megatron's rule; zero_bubble:
    torch's ScheduleInterleavedZeroBubble needs whole rounds, taken as a multiple of pp);
    dualpipev (ScheduleDualPipeV) one per stage of its V, 2 pp. The runtime refuses a config
    that breaks it and the planner's search skips such layouts. (FSDP's zero 3 runs under the
    split-backward schedules too: parallel/pipeline.py gathers a stage before torch's split
    backward reads its parameters.)"""
    if pp <= 1:
        return None
    if schedule != "gpipe" and microbatches < pp:
        return f"at least pp={pp} for {schedule}"
    if schedule in LOOP_MULTI_CHUNK_SCHEDULES and microbatches % pp:
        return f"a multiple of pp={pp} for {schedule}"
    if schedule == "dualpipev" and microbatches < 2 * pp:
        return f"at least 2 x pp={2 * pp} for dualpipev"
    return None


def pipeline_chunks(schedule: str, pp_chunks: int) -> int:
    """Model chunks per pipeline rank that `schedule` runs: 2 for the V schedules (whatever
    `pp_chunks` says), `pp_chunks` for the loop-style multi-chunk ones, 1 otherwise."""
    if schedule in V_SCHEDULES:
        return 2
    return pp_chunks if schedule in LOOP_MULTI_CHUNK_SCHEDULES else 1


# Bytes of one element in each precision: the planner's and the runtime's one table. fp8 is
# torchao's float8 training: bf16 autocast whose linears run their matmuls in float8 (inputs and
# weights cast per matmul, the bf16 tensors are what autograd saves), so its tensors are 2 bytes;
# FP8_MATMUL_BYTES is the matmul operands' width.
DTYPE_BYTES: dict[Precision, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2, "nvfp4": 2}
FP8_MATMUL_BYTES = 1
# nvfp4 is TransformerEngine's NVFP4 recipe (NVFP4BlockScaling), which Megatron-Core runs and this
# runtime does not: bf16 tensors, the linears' matmuls on FP4 (E2M1) operands with one E4M3 scale
# per 16 elements (and one fp32 scale per tensor): 0.5 + 1/16 bytes per element.
NVFP4_MATMUL_BYTES = 0.5 + 1 / 16

# Token ids the byte-level data holds: the 256 bytes, then BOS, EOS and PAD (data/tokenizer.py).
BYTE_TOKEN_IDS = 256 + 3
# TOML's integers are 64-bit; a larger one is a typo, not a plan.
INT64_RANGE = (-(2**63), 2**63 - 1)


# ---- degrees, derived once (JobConfig, ParallelDims and the planner's Plan read these) ----


class MeshDegrees:
    """What follows from a layout's mesh degrees (pp, dp_replicate, dp_shard, cp, tp), derived
    once here for the ones that hold them: ParallelSection, the runtime's ParallelDims and the
    planner's Plan."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas times shards (different slices of each global batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Processes of the layout: the product of the mesh's degrees."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def fsdp(self) -> bool:
        """FSDP2 (fully_shard) holds the states, sharded over dp_shard (HSDP with dp_replicate)."""
        return self.dp_shard > 1


def n_microbatches(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Micro-batches each pipeline runs per optimizer step: global = micro x accum x dp."""
    return global_batch_size // (micro_batch_size * dp)


def offload_layout_problem(offload: str, cp: int, pp: int, tied: bool) -> str | None:
    """What optimizer.offload must be instead for this layout (None when it can run): the
    runtime's one rule, read by `train`, `train --dry-run` and the planner's search."""
    if offload in ("none", "lsp"):  # lsp: its own layout rule (_validate_lsp_layout)
        return None
    if cp > 1:
        return "none with parallel.cp > 1 (not supported yet)"
    if pp > 1 and tied:
        # The last stage's copy of the embedding is summed on the device before each step.
        return "none with parallel.pp > 1 and model.tie_embeddings"
    return None


def uses_fsdp_cpu_offload(offload: str, dp: int) -> bool:
    """`optimizer+params` under data parallelism is FSDP2's CPUOffloadPolicy (see JobConfig)."""
    return offload == "optimizer+params" and dp > 1


@dataclass
class JobSection:
    """[job]: where a run writes, its seed and its device."""

    name: str = "demo"
    """Name of the run, shown in logs."""
    run_dir: str = "runs/demo"
    """Folder the run writes: config.toml, metrics.jsonl, checkpoints."""
    overwrite: bool = False
    """Start fresh in a run_dir that holds an earlier run: delete its metrics, checkpoints,
    prediction and timelines first (llmscale train --overwrite; without it, or --resume, such
    a folder is refused)."""
    seed: int = 0
    """Seed for the model's initialisation and the data order."""
    device: Device = "auto"
    """Where to train; auto = CUDA when available, else the CPU."""
    memory_check: MemoryCheck = "error"
    """Before the model is built, the planner's memory prediction against the device: a run that
    cannot fit is stopped (error), only warned about (warn), or not checked (off)."""

    def validate(self) -> None:
        _choice("job", self, "device")
        _choice("job", self, "memory_check")
        _nonneg("job.seed", self.seed)
        if not self.run_dir:
            raise ConfigError("job.run_dir", self.run_dir, "a non-empty folder path")
        problem = folder_problem(self.run_dir)
        if problem:  # found now, not when the first write comes after the model is built
            raise ConfigError(
                "job.run_dir", self.run_dir, f"a folder that can be created and written ({problem})"
            )


@dataclass
class DataSection:
    """[data]: a folder of text files read as bytes; empty path = the Python standard library."""

    path: str = ""
    """Folder of text files, read as bytes; empty = the Python standard library's source."""
    glob: str = "**/*.py"
    """Which files under path to read."""
    seq_len: int = 128
    """Tokens (bytes) per training sequence."""
    val_fraction: float = 0.05
    """Share of the tokens held out for evaluation, in [0, 1)."""
    max_files: int = 0
    """Read at most this many files; 0 = every file that matches."""
    dataset: str = ""
    """A folder written by `llmscale data prepare` (its meta.json, tokenizer and token shards),
    read through memory maps; the model's vocab_size follows its tokenizer, padded to a multiple
    of 64 x tp. Empty = the raw bytes of path."""

    def validate(self) -> None:
        _positive("data.seq_len", self.seq_len)
        if self.dataset and not (Path(self.dataset) / "meta.json").is_file():
            raise ConfigError(
                "data.dataset", self.dataset, "a folder written by `llmscale data prepare`"
            )
        _nonneg("data.max_files", self.max_files)
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError("data.val_fraction", self.val_fraction, "a number in [0, 1)")
        if self.path and not Path(self.path).is_dir():
            raise ConfigError("data.path", self.path, "an existing folder of text files")


@dataclass
class TrainSection:
    """[train]: steps, batch sizes (in sequences), activation recomputation, clipping."""

    steps: int = 50
    """Optimizer steps to train."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step: micro_batch_size x accumulation steps x dp."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (attention core), selective_op (every other
    matmul and the attention kernel saved, the rest recomputed), every_k blocks, or full."""
    recompute_every_k: int = 2
    """With recompute = every_k: recompute one transformer block in every k."""
    offload_activations: int = 0
    """Transformer blocks, from the first, whose saved activations are moved to pinned host
    memory after their forward and back before their backward (torch.autograd.graph.save_on_cpu;
    Megatron-Core's --cpu-offloading-num-layers). 0 = none. As in Megatron-Core: pp = 1,
    recompute = none, and fewer than model.n_layers."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    eval_every: int = 0
    """Steps between evaluations; 0 = only at the end."""
    eval_sequences: int = 32
    """Validation sequences scored per evaluation: the first this many windows of the validation
    files (all of them when there are fewer); 0 = no evaluation. The validation loss is the mean
    over their tokens, the same whatever the micro-batch size or parallel layout."""
    compile: bool = False
    """Compile each transformer block with torch.compile (regional compilation, as torchtitan):
    the first steps pay the compilation, later ones run fused kernels. Refused with tp > 1 on a
    CPU (torch fails in a compiled block's backward under DTensor TP there)."""
    max_bad_steps: int = 5
    """Stop the run (exit 3) when the loss or the gradient norm is NaN or inf for this many
    optimizer steps in a row (fp16 steps skipped on a gradient overflow, with a finite loss, do
    not count); 0 = never stop."""

    def validate(self) -> None:
        _positive("train.steps", self.steps)
        _positive("train.micro_batch_size", self.micro_batch_size)
        _positive("train.global_batch_size", self.global_batch_size)
        _choice("train", self, "recompute")
        _positive("train.recompute_every_k", self.recompute_every_k)
        _nonneg("train.offload_activations", self.offload_activations)
        _nonneg("train.max_grad_norm", self.max_grad_norm)
        _nonneg("train.eval_every", self.eval_every)
        _nonneg("train.eval_sequences", self.eval_sequences)
        _nonneg("train.max_bad_steps", self.max_bad_steps)


@dataclass
class PrecisionSection:
    """[precision]: autocast dtype over fp32 master weights, and fp16 dynamic loss scaling."""

    mode: Precision = "fp32"
    """Autocast dtype of the forward and backward; the master weights stay fp32. fp8: bf16 with
    float8 matmuls in the linears (torchao's float8 training; GPUs with FP8 only). nvfp4:
    TransformerEngine's NVFP4 recipe, plannable (`llmscale plan --stack megatron-core`) but not
    trained by this runtime."""
    float8_recipe: Float8Recipe = "tensorwise"
    """fp8: torchao's float8 recipe. tensorwise: one scale per tensor (the fastest); rowwise: a
    scale per row of each operand, all three matmuls in float8 (more accurate); rowwise_with_gw_hp:
    rowwise, the weight gradient's matmul in bf16 (the most accurate). mxfp8: TransformerEngine's
    MXFP8 block scaling (an E8M0 scale per 32 elements, Blackwell), plannable (`llmscale plan
    --stack megatron-core`) but not trained by this runtime."""
    initial_scale: float = 2.0**15
    """fp16: the loss scale at the first step."""
    growth_factor: float = 2.0
    """fp16: multiply the scale by this after growth_interval steps without overflow."""
    backoff_factor: float = 0.5
    """fp16: multiply the scale by this when gradients overflow (the step is skipped)."""
    growth_interval: int = 200
    """fp16: steps without overflow before the scale grows."""
    min_scale: float = 2.0**3
    """fp16: the scale never goes below this."""
    max_scale: float = 2.0**15
    """fp16: the scale never goes above this."""
    underflow_steps: list[int] = field(default_factory=list)
    """Steps (1-based) at which to report the share of fp16 gradient values that underflow."""

    def validate(self) -> None:
        _choice("precision", self, "mode")
        _choice("precision", self, "float8_recipe")
        needs = float8_recipe_needs_fp8(self.mode, self.float8_recipe, "precision.mode")
        if needs:
            raise ConfigError(
                "precision.float8_recipe", self.float8_recipe,
                f"{needs} (a float8 recipe applies to fp8)",
            )  # fmt: skip
        for name in ("initial_scale", "min_scale", "max_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"precision.{name}", getattr(self, name), "a positive number")
        if not self.growth_factor > 1.0:
            raise ConfigError("precision.growth_factor", self.growth_factor, "a number > 1")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError("precision.backoff_factor", self.backoff_factor, "a number in (0, 1)")
        _positive("precision.growth_interval", self.growth_interval)
        if self.min_scale > self.max_scale:
            raise ConfigError("precision.min_scale", self.min_scale, "<= precision.max_scale")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ConfigError(
                "precision.initial_scale",
                self.initial_scale,
                f"within [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]",
            )
        for s in self.underflow_steps:
            _positive("precision.underflow_steps[]", s)


@dataclass
class OptimizerSection:
    """[optimizer]: AdamW hyper-parameters and CPU offload."""

    name: OptimizerName = "adamw"
    """The optimizer (AdamW with decoupled weight decay)."""
    lr: float = 3e-3
    """Peak learning rate, reached after the warm-up."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the 2-D weights (norms and biases are not decayed)."""
    offload: Offload = "none"
    """Keep the optimizer states (optimizer), or also the fp32 params (optimizer+params), in host
    memory and step on the CPU; lsp: LSP-Offload, the blocks' matrices through learned sparse
    projectors (d x d gradients, moments and updates on the host), the rest as optimizer."""
    offload_overlap: bool = True
    """With offload: overlap the transfers and the CPU step with the backward."""
    offload_kernel: OffloadKernel = "fused"
    """CPU AdamW kernel with offload: torch's fused one, or exact (bit-equal to the on-device
    foreach AdamW, ~3x slower on CPU)."""
    lsp_dim: int = 512
    """offload lsp: rows d of each matrix's projectors (capped per matrix at half its smaller
    dimension); the host holds d x d per matrix."""
    lsp_nonzeros: int = 16
    """offload lsp: non-zeros per projector column (count-sketch; at most lsp_dim)."""
    lsp_refit_threshold: float = 0.2
    """offload lsp: refit a matrix's projectors when a check step's relative gradient
    reconstruction error exceeds this."""
    lsp_check_every: int = 50
    """offload lsp: optimizer steps between reconstruction-error checks (the first step
    always fits)."""

    def validate(self) -> None:
        _choice("optimizer", self, "name")
        if not self.lr > 0:
            raise ConfigError("optimizer.lr", self.lr, "a positive finite number")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optimizer.{name}", getattr(self, name), "a number in [0, 1)")
        if not self.eps > 0:
            raise ConfigError("optimizer.eps", self.eps, "a positive number")
        _nonneg("optimizer.weight_decay", self.weight_decay)
        _choice("optimizer", self, "offload")
        _choice("optimizer", self, "offload_kernel")
        self._validate_lsp()

    def _validate_lsp(self) -> None:
        _positive("optimizer.lsp_dim", self.lsp_dim)
        _positive("optimizer.lsp_nonzeros", self.lsp_nonzeros)
        _positive("optimizer.lsp_refit_threshold", self.lsp_refit_threshold)
        _positive("optimizer.lsp_check_every", self.lsp_check_every)
        if self.lsp_nonzeros > self.lsp_dim:
            raise ConfigError(
                "optimizer.lsp_nonzeros", self.lsp_nonzeros, f"<= optimizer.lsp_dim={self.lsp_dim}"
            )


@dataclass
class LRSchedulerSection:
    """[lr_scheduler]: linear warm-up, then decay to min_lr_ratio * lr."""

    warmup_steps: int = 5
    """Steps of linear warm-up from 0 to lr."""
    decay: LRDecay = "cosine"
    """Shape of the decay after the warm-up, down to min_lr_ratio x lr at the last step."""
    min_lr_ratio: float = 0.1
    """The final learning rate as a fraction of lr, in [0, 1]."""

    def validate(self) -> None:
        _nonneg("lr_scheduler.warmup_steps", self.warmup_steps)
        _choice("lr_scheduler", self, "decay")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("lr_scheduler.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")


@dataclass
class CheckpointSection:
    """[checkpoint]: distributed checkpoints under run_dir/folder, written atomically."""

    enabled: bool = True
    """Write checkpoints at all."""
    interval: int = 0
    """Steps between checkpoints; 0 = only at the end."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted (never the run's newest)."""
    folder: str = "checkpoints"
    """Folder under job.run_dir that holds the checkpoints. A folder outside job.run_dir must be
    new or empty (the run marks it as its own) or already this run's: another run's is refused."""
    resume: bool = False
    """Continue from the newest intact checkpoint in folder, or from step 0 when there is none
    (llmscale train --resume). Refused when train.steps is at or below its step, or when
    [model] differs from the model it holds."""
    stop_after: int = 0
    """Stop after this step as if interrupted (0 = never); used to test resumption."""
    init_from: str = ""
    """Start a new run from existing weights: hf:DIR (a Hugging Face Llama folder) or RUN_DIR
    (another run's newest intact checkpoint; weights only). The model's shape is then the source's, not
    [model]'s. Ignored when the run resumes its own checkpoint."""

    def validate(self) -> None:
        _nonneg("checkpoint.interval", self.interval)
        _positive("checkpoint.keep_last", self.keep_last)
        _nonneg("checkpoint.stop_after", self.stop_after)
        self._validate_init_from()

    def _validate_init_from(self) -> None:
        if not self.init_from:
            return
        folder = self.init_from.removeprefix("hf:")
        if not folder or not Path(folder).is_dir():
            raise ConfigError(
                "checkpoint.init_from", self.init_from, "hf:DIR or RUN_DIR, an existing folder"
            )


@dataclass
class MetricsSection:
    """[metrics]: what is logged, how often, and the peak used for MFU."""

    log_every: int = 1
    """Steps between printed and logged metric rows."""
    progress: bool = True
    """A progress bar when printing to a terminal."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device, for MFU; 0 = from the hardware catalog when the device is
    known (CUDA), else MFU is not reported."""
    activation_memory: bool = True
    """Count saved-activation bytes each step (cheap; needed for CPU memory reports)."""
    pipeline_timeline: bool = False
    """With pp > 1: record when every forward/backward chunk ran on each rank and write
    run_dir/pipeline_timeline.json at the end (about 1 us per op)."""
    tensorboard: bool = False
    """Also write TensorBoard event files under run_dir/tensorboard/ (loss, val loss, lr, grad
    norm, loss scale, tokens/s, MFU, each memory component), from rank 0: tensorboard --logdir
    runs/."""

    def validate(self) -> None:
        _positive("metrics.log_every", self.log_every)
        _nonneg("metrics.peak_tflops", self.peak_tflops)


@dataclass
class ParallelSection(MeshDegrees):
    """[parallel]: degrees of one N-D device mesh (pp, dp_replicate, dp_shard, cp, tp)."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP-style: every replica holds the whole states)."""
    dp_shard: int = 1
    """Data-parallel shards (FSDP2: parameters, gradients and optimizer states sharded)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads, FFN and vocabulary split over tp ranks."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split over pp ranks."""
    pp_schedule: PPSchedule = "1f1b"
    """Order of the pipeline's forward and backward micro-batches."""
    pp_chunks: int = 1
    """Model chunks per pipeline rank (interleaved_1f1b and zero_bubble: >= 2; zbv and
    dualpipev always run 2, placed in a V: leave unset or set 2; 1 otherwise)."""
    pp_layers: list[int] = field(default_factory=list)
    """Layers of each pipeline stage (pp x pp_chunks entries, summing to model.n_layers; the
    first or last may be 0: the embedding or the head on a stage of its own); empty = automatic:
    floor or ceil of n_layers / stages each, the first and last stages the lighter, and over
    n_layers + 2 stages the embedding and the head each alone (Megatron-Core's
    account_for_embedding/loss_in_pipeline_split)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks in load-balanced chunks, causal
    ring attention between them (seq_len a multiple of 2 x cp); FSDP shards over dp_shard x cp.
    Not with optimizer.offload yet."""
    sequence_parallel: bool = False
    """With tp > 1: the residual stream and the norms are split over tp ranks on the sequence."""
    zero_stage: ZeroStage = 3
    """With dp_shard > 1: 1 and 2 keep the params unsharded from forward to backward, 3 reshards
    them after the forward."""

    def validate(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "pp_chunks", "cp"):
            _positive(f"parallel.{name}", getattr(self, name))
        _choice("parallel", self, "pp_schedule")
        _choice("parallel", self, "zero_stage")
        multi = " | ".join(LOOP_MULTI_CHUNK_SCHEDULES)
        if self.pp_schedule in V_SCHEDULES:
            if self.pp_chunks not in (1, 2):
                raise ConfigError(
                    "parallel.pp_chunks",
                    self.pp_chunks,
                    f"unset or 2 with pp_schedule = '{self.pp_schedule}' (two chunks in a V)",
                )
        elif self.pp_schedule not in LOOP_MULTI_CHUNK_SCHEDULES and self.pp_chunks != 1:
            raise ConfigError(
                "parallel.pp_chunks", self.pp_chunks, f"1 unless pp_schedule is {multi}"
            )
        if self.pp_schedule in LOOP_MULTI_CHUNK_SCHEDULES and self.pp > 1 and self.pp_chunks < 2:
            raise ConfigError(
                "parallel.pp_chunks",
                self.pp_chunks,
                f">= 2 with pp_schedule = '{self.pp_schedule}'",
            )
        if self.pp == 1 and self.pp_schedule in V_SCHEDULES:
            raise ConfigError(
                "parallel.pp_schedule", self.pp_schedule, "a V schedule needs parallel.pp > 1"
            )
        if self.pp == 1 and self.pp_chunks != 1:
            raise ConfigError("parallel.pp_chunks", self.pp_chunks, "1 when parallel.pp = 1")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel", True, "false when parallel.tp = 1")
        if self.dp_shard > 1 and self.zero_stage == 0:
            raise ConfigError(
                "parallel.zero_stage", 0, "1 | 2 | 3 when parallel.dp_shard > 1 (FSDP shards)"
            )


@dataclass
class CommSection:
    """[comm]: how long a rank waits for its peers before the job stops (exit code 4)."""

    timeout_seconds: float = 600.0
    """Seconds any wait on another rank may last (the rendezvous, each collective); a peer that
    stops answering for longer (dead, or stalled) stops the job with exit code 4 and a message
    naming it, found by a heartbeat every rank keeps in the rendezvous store."""

    def validate(self) -> None:
        v = self.timeout_seconds
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError("comm.timeout_seconds", v, "a finite number of seconds > 0")


@dataclass
class JobConfig:
    """A whole training job: every section, plus the model shape."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelConfig = field(default_factory=lambda: get_preset("tiny"))
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    comm: CommSection = field(default_factory=CommSection)

    @property
    def fsdp_cpu_offload(self) -> bool:
        """`optimizer+params` under data parallelism: FSDP2's CPUOffloadPolicy holds the params.

        FSDP2 (and replicate, built on it) owns its parameters' storage: it frees and
        all-gathers it itself, so `offload.params` cannot free and refill it. Its own policy does
        the same job: the fp32 shards (the master weights) and their gradients stay in host
        memory, every all-gather copies the shards up and every reduce-scatter the gradients
        down, and torch's AdamW steps on the host (`parallel.data_parallel.apply_fsdp`).
        """
        return uses_fsdp_cpu_offload(self.optimizer.offload, self.parallel.dp)

    @property
    def n_microbatches(self) -> int:
        """Micro-steps per optimizer step: global = micro x accum x dp."""
        return n_microbatches(
            self.train.global_batch_size, self.train.micro_batch_size, self.parallel.dp
        )

    def validate(self, world_size: int | None = None) -> None:
        """Check every section, then the facts that tie sections together."""
        for f in fields(self):
            _finite_floats(f.name, getattr(self, f.name))
            getattr(self, f.name).validate()
        t, p, m = self.train, self.parallel, self.model
        # Byte-level data (no data.dataset, whose tokenizer sets the vocabulary): else an
        # embedding lookup fails after the model is built.
        if not self.data.dataset and m.vocab_size < BYTE_TOKEN_IDS:
            raise ConfigError(
                "model.vocab_size",
                m.vocab_size,
                f">= {BYTE_TOKEN_IDS} (the byte-level data's 256 bytes + BOS, EOS, PAD)",
            )
        per_step = t.micro_batch_size * p.dp
        if t.global_batch_size % per_step:
            raise ConfigError(
                "train.global_batch_size",
                t.global_batch_size,
                f"a multiple of micro_batch_size x dp = {t.micro_batch_size} x {p.dp} = {per_step}",
            )
        if self.data.seq_len > m.max_seq_len:
            raise ConfigError(
                "data.seq_len", self.data.seq_len, f"<= model.max_seq_len={m.max_seq_len}"
            )
        if world_size is not None and p.world_size != world_size:
            raise ConfigError(
                "parallel",
                f"pp x dp_replicate x dp_shard x tp = {p.pp} x {p.dp_replicate} x {p.dp_shard} x {p.tp}"
                + (f" x cp {p.cp}" if p.cp > 1 else "")
                + f" = {p.world_size}",
                f"degrees whose product equals the world size {world_size}"
                + (
                    " (start that many processes: torchrun --nproc-per-node N -m llmscale train ...)"
                    if world_size == 1
                    else ""
                ),
            )
        if m.n_heads % p.tp:
            raise ConfigError("parallel.tp", p.tp, f"a divisor of model.n_heads={m.n_heads}")
        if m.n_kv_heads % p.tp:
            raise ConfigError("parallel.tp", p.tp, f"a divisor of model.n_kv_heads={m.n_kv_heads}")
        if m.ffn_dim % p.tp:
            raise ConfigError("parallel.tp", p.tp, f"a divisor of model.ffn_dim={m.ffn_dim}")
        if not m.tie_embeddings and m.vocab_size % p.tp:
            raise ConfigError(
                "parallel.tp",
                p.tp,
                f"a divisor of model.vocab_size={m.vocab_size} (vocab-parallel)",
            )
        if p.sequence_parallel and self.data.seq_len % p.tp:
            raise ConfigError(
                "data.seq_len", self.data.seq_len, f"a multiple of parallel.tp={p.tp}"
            )
        stages = p.pp * pipeline_chunks(p.pp_schedule, p.pp_chunks)
        if not p.pp_layers and not auto_split_ok(m.n_layers, stages):
            raise ConfigError(
                "parallel.pp",
                p.pp,
                f"pp x pp_chunks = {stages} stages, at most model.n_layers={m.n_layers} or "
                f"exactly n_layers + 2 = {m.n_layers + 2} (the embedding and the head each on "
                "a stage of their own)",
            )
        if p.pp_layers:
            problem = pp_layers_problem(p.pp_layers, m.n_layers, stages)
            if problem:
                raise ConfigError("parallel.pp_layers", p.pp_layers, problem)
        if p.cp > 1 and self.data.seq_len % (2 * p.cp):
            raise ConfigError(
                "data.seq_len",
                self.data.seq_len,
                f"a multiple of 2 x parallel.cp = {2 * p.cp} (load-balanced ring attention)",
            )
        why = offload_layout_problem(self.optimizer.offload, p.cp, p.pp, m.tie_embeddings)
        if why is not None:
            raise ConfigError("optimizer.offload", self.optimizer.offload, why)
        if t.compile and p.cp > 1:
            raise ConfigError(
                "train.compile",
                True,
                "false with parallel.cp > 1 (ring attention's point-to-point exchange inside a"
                " compiled block is not supported yet)",
            )
        rule = microbatch_rule(p.pp_schedule, p.pp, self.n_microbatches)
        if rule is not None:
            raise ConfigError(
                "train.global_batch_size",
                t.global_batch_size,
                f"micro-batches per step (global / (micro_batch_size x dp) = "
                f"{self.n_microbatches}) {rule}",
            )
        if self.optimizer.offload != "none" and self.precision.underflow_steps:
            raise ConfigError(
                "precision.underflow_steps",
                self.precision.underflow_steps,
                "[] with optimizer.offload (gradients are on the host, still scaled)",
            )
        self._validate_lsp_layout()
        self._validate_activation_offload()
        if t.recompute == "every_k" and t.recompute_every_k > m.n_layers:
            raise ConfigError(
                "train.recompute_every_k", t.recompute_every_k, f"<= model.n_layers={m.n_layers}"
            )

    def _validate_activation_offload(self) -> None:
        """train.offload_activations as Megatron-Core allows --cpu-offloading-num-layers
        (megatron/core/transformer/transformer_config.py): fewer than the model's layers, no
        pipeline, no recomputation."""
        n = self.train.offload_activations
        if n == 0:
            return
        if n >= self.model.n_layers:
            raise ConfigError(
                "train.offload_activations", n, f"< model.n_layers={self.model.n_layers}"
            )
        if self.parallel.pp != 1:
            raise ConfigError(
                "parallel.pp", self.parallel.pp, "1 with train.offload_activations > 0"
            )
        if self.train.recompute != "none":
            raise ConfigError(
                "train.recompute",
                self.train.recompute,
                "none with train.offload_activations > 0 (offload or recompute, not both)",
            )

    def _validate_lsp_layout(self) -> None:
        """offload lsp serves data parallelism (FSDP2's row shards: offload/lsp_shard.py; replicate)
        but not TP, PP or CP (their shards would split the projectors' matrices another way)."""
        if self.optimizer.offload != "lsp":
            return
        for name in ("tp", "pp", "cp"):
            value = getattr(self.parallel, name, 1)
            if value != 1:
                raise ConfigError(
                    f"parallel.{name}",
                    value,
                    "1 with optimizer.offload = lsp (it serves dp_shard and dp_replicate only)",
                )


# ---- loading ------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a TOML file (or the defaults), apply `--section.key value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        raw = _read_toml(p)
    for key, value in parse_overrides(overrides or []):
        section, _, name = key.partition(".")
        if not name:
            raise UsageError(f"override --{key}: expected --section.key (e.g. --train.steps 20)")
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(section, table, "a table of keys")
        table[name] = value
    cfg = from_dict(raw)
    cfg.validate()
    return cfg


def given_keys(path: str | Path | None, overrides: list[str] | None) -> set[str]:
    """The `section.key`s a user set: in the --config file or as overrides (not defaults)."""
    keys = {key for key, _ in parse_overrides(overrides or [])}
    raw = _read_toml(Path(path)) if path is not None else {}
    for section, table in raw.items():
        if isinstance(table, dict):
            keys.update(f"{section}.{k}" for k in table)
    return keys


def _read_toml(p: Path) -> dict[str, Any]:
    """The --config file's tables, or a UsageError saying why it cannot be read."""
    if p.is_dir():
        raise UsageError(f"--config: {str(p)!r} is a folder; allowed: a TOML file")
    if not p.is_file():
        raise UsageError(f"--config: no such file {str(p)!r}")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise UsageError(f"--config: cannot read {str(p)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--config: {str(p)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
            f"{e.start}); allowed: a TOML file, which is UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        if text.startswith("\ufeff"):  # Windows editors write one; TOML readers refuse it
            raise UsageError(
                f"--config: {p} starts with a byte-order mark (bytes ef bb bf); allowed: a TOML "
                "file saved as UTF-8 without one"
            ) from None
        raise UsageError(f"--config: {p} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib parses nested inline tables and arrays recursively
        raise UsageError(
            f"--config: {p} nests inline tables or arrays too deeply for the TOML reader; "
            "allowed: a config of [section] tables of keys"
        ) from None


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn ['--train.steps', '20', '--x.y=3'] into [('train.steps', 20), ('x.y', 3)]."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            raise UsageError(f"unexpected argument {a!r}; overrides look like --section.key value")
        key = a[2:]
        if "=" in key:
            key, text = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise UsageError(f"override --{key} needs a value")
            i += 1
            text = args[i]
        out.append((key, _parse_value(text)))
        i += 1
    return out


def _parse_value(text: str) -> Any:
    """A TOML literal when it parses as one (20, 1e-3, true, [1, 2]), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def from_dict(raw: dict[str, Any]) -> JobConfig:
    """Build a JobConfig from a parsed TOML table, naming any unknown or mistyped key."""
    cfg = JobConfig()
    sections = {f.name: f for f in fields(JobConfig)}
    for name, table in raw.items():
        if name not in sections:
            raise ConfigError(name, "(section)", "one of [" + "], [".join(sections) + "]")
        if not isinstance(table, dict):
            raise ConfigError(name, table, "a table of keys")
        if name == "model":
            cfg.model = _model_from_table(table)
        else:
            setattr(cfg, name, _section_from_table(name, getattr(cfg, name), table))
    return cfg


def _model_from_table(table: dict[str, Any]) -> ModelConfig:
    name = str(table.get("name", "tiny"))
    # "custom": a shape of no preset (e.g. from checkpoint.init_from), every key given.
    base = ModelConfig() if name == "custom" else get_preset(name)
    hints = typing.get_type_hints(ModelConfig)
    overrides = {}
    for key, value in table.items():
        if key == "name":
            continue
        if key not in hints:
            raise ConfigError(f"model.{key}", value, "a key of [model]: " + ", ".join(hints))
        overrides[key] = _coerce(f"model.{key}", value, hints[key])
    return base.with_overrides(**overrides) if overrides else base


# Keys a [model] table without `name` must give: the shape of no preset.
CUSTOM_MODEL_KEYS = SHAPE_KEYS


def load_model(spec: str, field: str = "--model") -> ModelConfig:
    """A model shape from a preset NAME, a FILE.toml holding a [model] table, or a Hugging Face
    DIR holding config.json (`model.config.from_hf_config`); ConfigError naming what is wrong.

    In the TOML table, `name` picks a preset whose shape the other keys override; without it the
    shape is custom: CUSTOM_MODEL_KEYS are required and every other key takes its default.
    """
    p = Path(spec)
    if spec in PRESETS or not (p.exists() or spec.endswith(".toml")):
        return get_preset(spec)
    if p.is_dir():
        try:
            raw = json.loads((p / "config.json").read_text())
        except OSError:
            raise ConfigError(field, spec, "a Hugging Face folder holding config.json") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(field, spec, f"a folder whose config.json is JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(field, spec, "a folder whose config.json is a JSON object")
        return from_hf_config(raw, field, spec)
    try:
        table = tomllib.loads(p.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(field, spec, f"a readable TOML file ({e.strerror or e})") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(field, spec, f"a TOML file ({e})") from None
    model = table.get("model")
    if not isinstance(model, dict):
        raise ConfigError(field, spec, "a TOML file holding a [model] table")
    return model_from_table(model, spec)


def model_from_table(table: dict[str, Any], source: str) -> ModelConfig:
    """A shape from a [model] table read from `source`: with `name`, that preset with the other
    keys overriding it; without, a custom shape of which CUSTOM_MODEL_KEYS are required."""
    if "name" not in table:
        missing = [k for k in CUSTOM_MODEL_KEYS if k not in table]
        if missing:
            raise ConfigError(
                f"model.{missing[0]}",
                source,
                "a value: a [model] table without name (a custom shape) gives "
                + ", ".join(CUSTOM_MODEL_KEYS),
            )
        table = {"name": "custom", **table}
    return _model_from_table(table)


# Keys that were renamed or replaced: a config still using one gets the new name in its error.
REPLACED_KEYS: dict[str, str] = {
    "train.eval_batches": "no longer a key: replaced by train.eval_sequences (validation "
    "sequences scored per evaluation; the old eval_batches x micro_batch_size)",
}


def _section_from_table(name: str, default: Any, table: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(type(default))
    values = {}
    for key, value in table.items():
        if f"{name}.{key}" in REPLACED_KEYS:
            raise ConfigError(f"{name}.{key}", value, REPLACED_KEYS[f"{name}.{key}"])
        if key not in hints:
            raise ConfigError(f"{name}.{key}", value, f"a key of [{name}]: " + ", ".join(hints))
        values[key] = _coerce(f"{name}.{key}", value, hints[key])
    return dataclasses.replace(default, **values)


def _coerce(field_name: str, value: Any, tp: Any) -> Any:
    """Check a TOML value against a field's type; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if not _is_one_of(value, allowed):
            raise ConfigError(field_name, value, _allowed_text(allowed))
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(field_name, value, f"a list of {_type_name(item_tp)}")
        return [_coerce(f"{field_name}[]", v, item_tp) for v in value]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(field_name, value, option)
            except ConfigError:
                continue
        raise ConfigError(
            field_name, value, " or ".join(_type_name(t) for t in typing.get_args(tp))
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(field_name, value, "true or false")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(field_name, value, "an integer")
        if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
            raise ConfigError(field_name, value, "an integer in the 64-bit range (TOML's)")
        return value
    if tp is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(field_name, value, "a number")
        if not math.isfinite(value):  # TOML's nan and inf pass every `<= 0` style range check
            raise ConfigError(field_name, value, "a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(field_name, value, "a string")
        return value
    raise TypeError(f"unsupported config type {tp!r} for {field_name}")


def _type_name(tp: Any) -> str:
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(tp, str(tp))


def choices(cls: type, name: str) -> tuple[Any, ...]:
    """The values a Literal-typed field of a config dataclass allows (empty for other fields)."""
    tp = _field_types(cls)[name]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _choice(section: str, obj: Any, name: str) -> None:
    """Check a Literal-typed field against the values its own type allows."""
    value, allowed = getattr(obj, name), choices(type(obj), name)
    if not _is_one_of(value, allowed):
        raise ConfigError(f"{section}.{name}", value, _allowed_text(allowed))


def _is_one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    # Compare types too: True == 1, yet `zero_stage = true` is no ZeRO stage.
    return any(type(value) is type(a) and value == a for a in allowed)


def _allowed_text(allowed: tuple[Any, ...]) -> str:
    return " | ".join(str(a) for a in allowed)


# The range checks are written `not value > 0`, not `value <= 0`: NaN fails every comparison.
def _positive(name: str, value: int | float) -> None:
    if not value > 0:
        raise ConfigError(name, value, "a positive integer" if isinstance(value, int) else "> 0")


def _nonneg(name: str, value: int | float) -> None:
    if not value >= 0:
        raise ConfigError(name, value, ">= 0")


def _finite_floats(section: str, obj: Any) -> None:
    """Every float field of a section (and every float in a list field) is finite: NaN and inf
    are refused before any range check, whether they came from a file, the command line or
    code that built the config."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        for v in value if isinstance(value, list | tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{section}.{f.name}", value, "a finite number")


# ---- writing ------------------------------------------------------------------------------


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """Every section as a plain table (the model as its full shape)."""
    return {f.name: dataclasses.asdict(getattr(cfg, f.name)) for f in fields(cfg)}


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML, written into each run folder."""
    lines: list[str] = []
    for section, table in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(v: Any) -> str:
    """One value as a TOML literal (the form `--section.key value` and config files take)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")
