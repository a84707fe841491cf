"""The training loop: data, model, mixed precision, accumulation, checkpoints, metrics.

One process, or one rank of many under torchrun: the parallel layout (`parallel/`) decides which
model chunks this rank holds and how they are sharded; the loop around them is the same. Data is
split by data-parallel rank only (TP and PP ranks of one replica read the same batch); losses,
gradient norms and overflow flags are reduced over the job so every rank logs and decides alike;
rank 0 prints and writes metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from llmscale.config import JobConfig, to_toml
from llmscale.data.prepared import apply_dataset
from llmscale.data.stream import PackedStream, StreamState
from llmscale.errors import ConfigError, ExitCode, JobStopped
from llmscale.instrument.activations import ActivationMeter
from llmscale.instrument.pipeline import FILE_NAME as TIMELINE_FILE
from llmscale.instrument.pipeline import PipelineRecorder, write_timeline
from llmscale.model.transformer import build_model
from llmscale.parallel import heartbeat
from llmscale.parallel.data_parallel import apply_micro_batch_controls, reshard_all
from llmscale.parallel.dims import ParallelDims, env_world_size, init_distributed, job_store
from llmscale.parallel.materialize import materialize
from llmscale.parallel.parallelize import check_runtime_support, parallelize
from llmscale.parallel.pipeline import PipelineMemory, build_pipeline_schedule
from llmscale.parallel.tensor_parallel import loss_context
from llmscale.parallel.tied_embeddings import TiedEmbeddings, give_copies, store_once
from llmscale.train import metrics as M
from llmscale.train import shared_cores
from llmscale.train.checkpoint import Checkpointer, notice, read_manifest
from llmscale.train.data import (
    adopt_checkpoint_vocab,
    build_data,
    check_checkpoint_tokenizer,
    mask_padded_vocab,
)
from llmscale.train.divergence import DivergenceGuard, all_finite
from llmscale.train.evaluation import local_eval_rows, token_loss_sum
from llmscale.train.fault_injection import maybe_inject
from llmscale.train.launch import (
    ctrl_c_again_wait,
    die_with_launcher,
    mark_claimed,
    restart_attempt,
    resume_own_run,
    second_ctrl_c,
    under_launcher,
)
from llmscale.train.memcheck import check_memory
from llmscale.train.optim import build_optimizers
from llmscale.train.precision import DynamicLossScaler, autocast, gradients, underflow_report
from llmscale.train.prediction import write_run_prediction
from llmscale.train.progress import StepReporter
from llmscale.train.run_dir import open_run_folder
from llmscale.train.weights import apply_init_from, checkpoint_record, with_source_model


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present (the local rank's GPU under torchrun), else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("job.device", "cuda", "auto | cpu (no CUDA device is available)")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, n_valid_vocab: int | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32.

    Logits split over the vocabulary (a DTensor, under tensor parallelism) need torch's
    `loss_parallel` around this call and its backward (`loss_context`); the mean, the same on
    every tp rank, comes back as a plain tensor. Ids from `n_valid_vocab` up (a prepared
    dataset's padded vocabulary) are masked out.
    """
    logits = mask_padded_vocab(logits.float(), n_valid_vocab)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss


@dataclass
class TrainResult:
    """What a finished (or stopped) run returns; the same figures are in metrics.jsonl."""

    steps_done: int
    losses: list[float] = field(default_factory=list)  # losses of the steps run in this call
    val_loss: float | None = None
    interrupted: bool = False
    stop_signal: str | None = None  # "SIGINT" / "SIGTERM" when a signal stopped the run


class _AppState(Stateful):
    """Everything a resume needs, as one DCP-savable object.

    Model and optimizer entries are the union over this rank's model parts (pipeline stages hold
    disjoint names); DCP stores each DTensor shard with its global place, so a checkpoint written
    under one layout loads under any other.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    def state_dict(self) -> dict[str, Any]:
        model_sd: dict[str, Any] = {}
        for part in self.t.model_parts:
            model_sd.update(get_model_state_dict(part))
        optim_sd = self.t.optimizers.state_dict()
        if self.t.tied is not None:  # one tensor: the copy's entries under the embedding's names
            model_sd, optim_sd = store_once(model_sd), store_once(optim_sd)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "trainer": {
                "step": self.t.step,
                "data": self.t.train_stream.state.to_dict(),
                "scaler": self.t.scaler.state_dict(),
                "scheduler": self.t.optimizers.scheduler_state_dict(),
                # (left out only to load a checkpoint written before it was kept)
                **({"tokenizer_sha256": self.t.data.tokenizer_sha256} if self.t.sha_kept else {}),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model_sd, optim_sd = state["model"], state["optim"]
        if self.t.tied is not None:  # the copy takes the embedding's values
            model_sd, optim_sd = give_copies(model_sd), give_copies(optim_sd)
        for part in self.t.model_parts:
            # Each part takes its own names from the union.
            set_model_state_dict(part, model_sd, options=StateDictOptions(strict=False))
        self.t.optimizers.load_state_dict(optim_sd)
        tr = state["trainer"]
        self.t.step = int(tr["step"])
        self.t.train_stream.state = StreamState.from_dict(tr["data"])
        self.t.scaler.load_state_dict(tr["scaler"])
        self.t.optimizers.load_scheduler_state_dict(tr["scheduler"])


class Trainer:
    """One rank's view of a training run (the only rank, in a single process)."""

    def __init__(self, cfg: JobConfig) -> None:
        # data.dataset: the model's vocabulary follows its tokenizer (padded for tp).
        dataset_meta = apply_dataset(cfg)
        adopt_checkpoint_vocab(cfg, dataset_meta)  # a resume keeps its checkpoint's padding
        cfg = with_source_model(cfg)  # checkpoint.init_from: the source's model shape wins
        # The layout is checked against the world size before any process-group work, so a bad
        # one fails with its one-line message instead of hanging on peers.
        cfg.validate(world_size=env_world_size())
        die_with_launcher()  # a worker whose launcher is killed stops (SIGTERM), not trains on
        self.cfg = cfg
        self.device = resolve_device(cfg.job.device)
        check_runtime_support(cfg, self.device)  # fp8, and what context parallelism lacks
        # Will it fit? The planner's prediction against this device, before anything is built.
        self.memory_warnings = check_memory(cfg, self.device)
        init_distributed(self.device, cfg.comm.timeout_seconds)
        self.dims = ParallelDims.from_config(cfg.parallel)
        self.dims.build_mesh(self.device)
        self.rank = self.dims.rank
        # The run folder: checked (paths, free space), claimed (RUN_DIR/.lock), cleared
        # (--overwrite) or its newest intact checkpoint chosen (--resume), before any work.
        # --max-restarts: a restarted attempt resumes the run its first attempt claimed.
        if resume_own_run(cfg, job_store()) and self.rank == 0:
            sys.stderr.write(
                f"attempt {restart_attempt() + 1} of this job (--max-restarts): resuming its "
                f"run in {cfg.job.run_dir}\n"
            )
        self.run_folder = open_run_folder(cfg, self.rank)
        if self.rank == 0:
            mark_claimed(cfg, job_store())
        # The loss (and its backward) on vocabulary shards of the logits under TP.
        self.loss_context = functools.partial(loss_context, cfg.model, self.dims.tp)
        torch.manual_seed(cfg.job.seed)

        # Raw bytes of data.path, or a prepared dataset's memory-mapped shards (train/data.py).
        self.data = build_data(cfg, self.dims.dp_rank, self.dims.dp, dataset_meta)
        self.corpus_summary = self.data.summary
        self.train_stream = self.data.train_stream
        self.val_tokens = self.data.val_tokens
        self.sha_kept = True  # checkpoints hold the tokenizer's sha256
        self.memory_warnings += self.data.warnings  # printed with them, before the first step

        # The model is built, split and sharded on the meta device; then each rank allocates
        # and initialises only its own pieces, from values that depend on (seed, parameter name)
        # alone, so initial weights equal the single-process ones whatever the layout.
        self.parallel = parallelize(build_model(cfg.model, "meta"), self.dims, cfg)
        self.model_parts: list[nn.Module] = self.parallel.parts
        # FSDP2's CPU offload (optimizer+params under data parallelism) keeps shards on the host.
        host = torch.device("cpu") if cfg.fsdp_cpu_offload else None
        materialize(self.model_parts, self.device, cfg.job.seed, param_device=host)
        self.initialized_from = apply_init_from(self.model_parts, cfg)  # unless resuming
        self.n_params = cfg.model.num_params()
        # torch AdamW, or AdamW offloaded to the host (offload/: hooks installed here), and
        # the LR schedulers: one per model part, used as one.
        self.optimizers = build_optimizers(self.model_parts, cfg, self.dims)
        # A tied embedding under a pipeline: the last stage's copy, its gradient summed with the
        # embedding's before each step and counted once by the norm, or in a V without data
        # parallelism one shared tensor; checkpoints store one (parallel/tied_embeddings).
        self.tied: TiedEmbeddings | None = None
        if cfg.model.tie_embeddings and self.dims.pp > 1:
            self.tied = TiedEmbeddings.find(self.model_parts, self.dims, self.parallel.collectives)
            self.optimizers.leave_out_of_norm(self.tied.copies)
        self.scaler = DynamicLossScaler(cfg.precision, enabled=cfg.precision.mode == "fp16")
        # Under FSDP2 its MixedPrecisionPolicy casts; autocast only without data parallelism.
        self.autocast_mode = "fp32" if self.dims.reduces_grads else cfg.precision.mode
        self.pp_schedule: Any = None
        self.activation_peak: int | None = None  # under pipelining, set each step
        self._pp_loss = _PipelineLoss(self.scaler, cfg.n_microbatches, self.data.n_valid_vocab)
        self.pp_timeline: PipelineRecorder | None = None
        self.pp_memory: PipelineMemory | None = None
        if self.dims.pp > 1:
            if cfg.metrics.pipeline_timeline:
                sync = None
                if self.device.type == "cuda":
                    device = self.device

                    def sync() -> None:
                        torch.cuda.synchronize(device)

                self.pp_timeline = PipelineRecorder(self.dims.pp_rank, sync)
            if cfg.metrics.activation_memory:  # receive buffers, what split backwards keep
                self.pp_memory = PipelineMemory()
            pp_group = self.dims.pp_group()
            assert pp_group is not None  # pp > 1: build_mesh made the mesh
            self.pp_schedule = build_pipeline_schedule(
                self.model_parts,
                self.parallel.stage_ids,
                self.parallel.n_stages,
                cfg.parallel.pp_schedule,
                cfg.n_microbatches,
                self._pp_loss,
                self.device,
                pp_group,
                timeline=self.pp_timeline,
                memory=self.pp_memory,
            )
        self.step = 0
        self.checkpointer = Checkpointer(
            self.run_dir / cfg.checkpoint.folder,
            cfg.checkpoint.keep_last,
            layout={
                n: getattr(self.dims, n)
                for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "world_size")
            },
            extra=checkpoint_record(cfg),
        )

        seq = cfg.data.seq_len
        self.tokens_per_step = cfg.train.global_batch_size * seq
        self.model_flops_per_token = cfg.model.train_flops_per_token(seq)
        self.hw_flops_per_token = cfg.model.train_flops_per_token(
            seq,
            cfg.model.recompute_fraction(cfg.train.recompute, seq, cfg.train.recompute_every_k),
        )
        # Per device: MFU compares one rank's share of the job's FLOP/s with one device's peak.
        self.peak_flops = M.peak_flops_for_device(self.device, cfg.metrics.peak_tflops)
        self._stop_signal = 0  # the signal number the handlers saw last; 0 = none
        self._stop_time = 0.0  # when (time.monotonic) it came
        self._good_checkpoint: int | None = None  # newest checkpoint step with finite weights

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.job.run_dir)

    # A single model part (no pipeline, or one stage per rank) is `model`; so for the optimizer.
    @property
    def model(self) -> nn.Module:
        """This rank's model, when it holds one part (use `model_parts` under interleaving)."""
        if len(self.model_parts) != 1:
            raise AttributeError("this rank holds several model chunks; use model_parts")
        return self.model_parts[0]

    @property
    def optimizer(self) -> Any:
        """This rank's optimizer, when it holds one model part (else see `optimizers.parts`)."""
        if len(self.optimizers) != 1:
            raise AttributeError("this rank holds several model chunks; use optimizers")
        return self.optimizers[0]

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.optimizers.schedulers[0]

    def parameters(self) -> list[nn.Parameter]:
        """Every trainable parameter this rank holds (DTensor shards under FSDP/TP)."""
        return [p for part in self.model_parts for p in part.parameters() if p.requires_grad]

    # ---- state ----------------------------------------------------------------------------
    def app_state(self) -> dict[str, Any]:
        return {"app": _AppState(self)}

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.app_state())

    def resume(self) -> bool:
        """Load the checkpoint the run folder chose (the newest intact one), if any; True when
        one was loaded."""
        path = self.run_folder.resume_from
        if path is None:
            return False
        self.sha_kept = check_checkpoint_tokenizer(
            path, self.data.tokenizer_sha256, self.cfg.data.dataset
        )
        self.checkpointer.load(path, self.app_state())
        self.sha_kept = True
        self._convert_precision(path)
        return True

    def _convert_precision(self, path: Path) -> None:
        """A checkpoint of another precision mode: its fp32 weights and optimizer state carry
        over as they are (logged); fp16 from a run without loss scaling starts the scale at
        precision.initial_scale, not at the 1.0 that run kept."""
        mode = self.cfg.precision.mode
        stored = read_manifest(path).get("precision")
        if stored is None:  # written before manifests kept it: an fp16 scale is >= min_scale
            unscaled = self.scaler.enabled and self.scaler.scale < self.cfg.precision.min_scale
            stored = "fp32 or bf16" if unscaled else mode
        if stored == mode:
            return
        text = (
            f"precision: checkpoint {path.name} was trained in {stored}, this run trains in "
            f"{mode}: its fp32 weights and optimizer state carry over"
        )
        if self.scaler.enabled and stored != "fp16":
            self.scaler.restart()
            text += f"; the loss scale starts at precision.initial_scale = {self.scaler.scale:g}"
        if self.rank == 0:
            notice(text)

    # ---- one optimizer step ---------------------------------------------------------------
    def forward_backward(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Accumulate gradients of this rank's batch, micro-batch by micro-batch.

        Returns the global batch's mean loss (the same on every rank) and the activation bytes
        saved by one micro-batch's forward on this rank. Each micro-batch's loss is divided by the
        number of micro-batches, so k micro-steps of b sequences leave the same gradient as one
        step of k*b. Under data parallelism the zero stage decides, before each micro-batch,
        whether its gradients are reduced and its parameters resharded after backward
        (`stack.residency`: zero 1 and plain DP reduce on the last micro-step only); under
        pipeline parallelism the micro-batches are the pipeline's.
        """
        if self.pp_schedule is not None:
            return self._forward_backward_pipeline(batch)
        cfg = self.cfg
        micro_batches = batch.split(cfg.train.micro_batch_size)  # type: ignore[no-untyped-call]  # torch: Tensor.split unannotated
        accum = len(micro_batches)
        # What micro-batch 0's forward (and its loss) saves: the activation_bytes metric.
        meter = None
        if cfg.metrics.activation_memory:
            meter = ActivationMeter(self.model_parts, pipelined=False)
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            if self.dims.reduces_grads:
                zero, shard = cfg.parallel.zero_stage, self.dims.fsdp
                once = cfg.optimizer.offload != "none"  # the host optimizer's one gradient
                apply_micro_batch_controls(self.model_parts, zero, shard, i == accum - 1, once)
            # A micro-batch of its own (a copy on CPU too): autograd keeps the token ids until
            # backward, and they should not hold on to the whole batch.
            mb = mb.to(self.device, non_blocking=True, copy=True)
            inputs, targets = mb[:, :-1], mb[:, 1:]
            # Context parallelism: this cp rank's load-balanced share of every sequence.
            inputs, targets = self.dims.cp_shard(inputs), self.dims.cp_shard(targets)
            counting = meter.counting() if meter is not None and i == 0 else None
            with self.loss_context():
                with (
                    counting or contextlib.nullcontext(),
                    autocast(self.autocast_mode, self.device.type),
                ):
                    loss = lm_loss(self.model(inputs), targets, self.data.n_valid_vocab)
                self.scaler.scale_loss(loss / accum).backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward unannotated
            loss_sum += loss.detach()
        act_bytes = meter.saved_bytes if meter is not None else 0
        return self.dims.global_mean_loss(loss_sum / accum), act_bytes

    def _run_pipeline(self, batch: torch.Tensor) -> torch.Tensor:
        """One schedule step over `batch`; the global mean micro-batch loss."""
        batch = batch.to(self.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        inputs, targets = self.dims.cp_shard(inputs), self.dims.cp_shard(targets)
        n = self.cfg.n_microbatches
        self._pp_loss.losses = []
        args = (inputs,) if self.parallel.has_first_stage else ()
        with self.loss_context(), autocast(self.autocast_mode, self.device.type):
            self.pp_schedule.step(*args, target=targets, return_outputs=False)
        # Metadata inference on the first step may have called the loss once more: keep the last n.
        mine = self._pp_loss.losses[-n:]
        local = torch.stack(mine).mean() if mine else torch.zeros((), device=self.device)
        return self.dims.global_mean_loss(local)

    def _forward_backward_pipeline(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        meter = None
        if self.cfg.metrics.activation_memory:
            # Count the first micro-batch's forward of each of this rank's stages, and the most
            # held at once over the schedule (several micro-batches in flight).
            meter = ActivationMeter(self.model_parts, pipelined=True)
        timed = self.pp_timeline.step(self.step + 1) if self.pp_timeline else None
        if self.pp_memory is not None:
            self.pp_memory.begin_step()
        with timed or contextlib.nullcontext(), meter or contextlib.nullcontext():
            loss = self._run_pipeline(batch)
        if self.pp_memory is not None:
            self.pp_memory.end_step()
        self.activation_peak = meter.peak_bytes if meter is not None else None
        return loss, meter.saved_bytes if meter is not None else 0

    def optimizer_step(self) -> dict[str, Any]:
        """Unscale, check for overflow, clip, step (unless skipped), update the loss scale.

        The overflow flag and the gradient norm are reduced over the whole job (DTensor shards,
        replicas and pipeline stages), so every rank skips or clips alike.
        """
        cfg = self.cfg
        opts = self.optimizers
        max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
        if self.tied is not None:
            self.tied.sum_grads_()  # before the norm: both copies hold the one-process gradient
        grad_norm, found_inf = opts.grad_norm(self.scaler.loss_scale)
        out: dict[str, Any] = {"lr": opts.lr}
        if self.step + 1 in cfg.precision.underflow_steps:
            out["underflow"] = [r.to_dict() for r in underflow_report(gradients(self.parameters()))]
        opts.clip_(grad_norm, max_norm)
        out["grad_norm"] = float(grad_norm)
        out.update(opts.grad_memory())  # grad_bytes (host_grad_bytes under FSDP2's CPU offload)
        if not found_inf:
            opts.step()  # and the LR schedule: a skipped step does not advance it (as Megatron)
        self.scaler.update(found_inf)
        opts.zero_grad()
        out["skipped"] = found_inf
        out["loss_scale"] = self.scaler.scale
        return out

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over the next global batch; returns its metrics row.

        Throughput is the job's (global tokens / step time); memory figures are this rank's.
        """
        cfg = self.cfg
        t0 = time.perf_counter()
        self.optimizers.begin_step_traffic()
        self.parallel.collectives.reset()
        batch = self.train_stream.next_batch(cfg.train.global_batch_size)
        loss, act_bytes = self.forward_backward(batch)
        row: dict[str, Any] = self.optimizer_step()
        row.update(self.optimizers.memory())  # param_bytes, optimizer_bytes, device_*, host_*
        row["offload_bytes_moved"] = self.optimizers.offload_bytes_moved()  # both directions
        # FSDP's all-gathers and reduce-scatters of this step, counted (stack.residency)
        row.update(self.parallel.collectives.counts().to_dict())
        row["activation_bytes"] = act_bytes
        if self.activation_peak is not None:  # pipelines: the schedule's micro-batches in flight
            row["activation_peak_bytes"] = self.activation_peak
        if self.pp_memory is not None:  # beside the saved activations (PipelineMemory)
            row["pending_weight_grad_bytes"] = self.pp_memory.pending_peak_bytes
            row["pipeline_buffer_bytes"] = self.pp_memory.buffer_bytes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.step += 1
        dt = time.perf_counter() - t0
        tps = self.tokens_per_step / dt
        row.update(
            kind="train",
            step=self.step,
            loss=loss.item(),
            step_time_s=dt,
            tokens_per_s=tps,
            flops_per_s=tps * self.model_flops_per_token,
            accum_steps=cfg.n_microbatches,  # the metrics key keeps its name
        )
        if self.dims.world_size > 1:
            row["world_size"] = self.dims.world_size
        if self.peak_flops:
            per_device = tps / self.dims.world_size
            row["mfu"] = per_device * self.model_flops_per_token / self.peak_flops
            row["hfu"] = per_device * self.hw_flops_per_token / self.peak_flops
        return row

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the tokens of the fixed evaluation set (`train.eval_sequences`).

        The first eval_sequences windows of the validation files, split over the data-parallel
        replicas and padded to whole groups (`train.evaluation`): micro-batches of
        micro_batch_size, or under pipelining the schedule's n_microbatches of them per call.
        Token losses are summed in float64 over the job and divided once, so the result is the
        single-process one whatever the micro-batch size or layout. None without validation data.
        """
        cfg = self.cfg
        if len(self.val_tokens) <= cfg.data.seq_len or cfg.train.eval_sequences == 0:
            return None
        stream = PackedStream(self.val_tokens, cfg.data.seq_len, seed=0, shuffle=False)
        rows = stream.next_batch(min(cfg.train.eval_sequences, stream.n_windows))
        group = cfg.train.micro_batch_size
        if self.pp_schedule is not None:
            group *= cfg.n_microbatches
        inputs, targets = local_eval_rows(rows, self.dims.dp_rank, self.dims.dp, group)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i in range(0, len(inputs), group):
            x = self.dims.cp_shard(inputs[i : i + group].to(self.device))
            y = self.dims.cp_shard(targets[i : i + group].to(self.device))
            if self.pp_schedule is not None:
                part = self._eval_pipeline(x, y)
            else:
                with self.loss_context():
                    with autocast(self.autocast_mode, self.device.type):
                        logits = self.model(x)
                    part = token_loss_sum(
                        mask_padded_vocab(logits.float(), self.data.n_valid_vocab), y
                    )
            if self.dims.holds_loss():  # one rank per replica: the last stage's first TP rank
                total += part
        reshard_all(self.model_parts)  # zero 1 and 2 forwards leave their units gathered
        self.dims.all_reduce_sum(total)
        return float(total[0] / total[1])

    def _eval_pipeline(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One forward-only schedule call; this rank's [loss sum, tokens] (zeros off the last
        stage)."""
        self._pp_loss.eval_sums = []
        args = (inputs,) if self.parallel.has_first_stage else ()
        try:
            with self.loss_context(), autocast(self.autocast_mode, self.device.type):
                self.pp_schedule.eval(*args, target=targets)
            # Metadata inference may have called the loss once more: keep the last n.
            mine = self._pp_loss.eval_sums[-self.cfg.n_microbatches :]
        finally:
            self._pp_loss.eval_sums = None
        if not mine:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        return torch.stack(mine).sum(0)

    def write_pipeline_timeline(self) -> Path | None:
        """Gather the recorded pipeline ops to rank 0, which writes run_dir/pipeline_timeline.json.

        A collective: every rank calls it. One pipeline is written (data-parallel and TP rank 0;
        the other replicas run the same schedule). None where nothing is written.
        """
        if self.pp_timeline is None:
            return None
        d, p = self.dims, self.cfg.parallel
        per_rank = self.pp_timeline.gather(include=d.dp_rank == 0 and d.tp_rank == 0)
        if per_rank is None:
            return None
        meta = {
            "schedule": p.pp_schedule,
            "pp": p.pp,
            "chunks": self.parallel.n_stages // p.pp,
            "microbatches": self.cfg.n_microbatches,
            "n_stages": self.parallel.n_stages,
            "micro_batch_size": self.cfg.train.micro_batch_size,
            "seq_len": self.cfg.data.seq_len,
        }
        return write_timeline(self.run_dir / TIMELINE_FILE, per_rank, meta)

    # ---- the loop -------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.run_dir / "metrics.jsonl"
        resumed = cfg.checkpoint.resume and self.resume()
        if self.rank == 0:
            if resumed:
                M.truncate_after(metrics_path, self.step, notice)
            elif metrics_path.exists():
                metrics_path.unlink()
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
        # The planner's expectation, next to what the run measures (train/prediction.py); ranks
        # sharing a CPU's cores first measure what that costs, all at once (train/shared_cores).
        shared = None
        if shared_cores.applies(cfg, self.dims, self.device):
            costs, warnings = shared_cores.cached_costs(cfg, self.dims, self.device)
            shared = (costs, warnings) if costs is not None else None
        prediction = (
            write_run_prediction(cfg, self.device, self.run_dir, shared) if self.rank == 0 else None
        )
        tb_dir = self.run_dir / "tensorboard" if cfg.metrics.tensorboard else None
        writer = M.RunWriter(metrics_path, tb_dir, self.rank == 0, self.step if resumed else 0)
        reporter = StepReporter(cfg, enabled=self.rank == 0, prediction=prediction)
        reporter.start(self, resumed)
        result = TrainResult(steps_done=self.step)
        guard = DivergenceGuard(cfg.train.max_bad_steps)
        # The checkpoint resumed from, if any, holds finite weights.
        self._good_checkpoint = self.step if self.step and cfg.checkpoint.enabled else None
        previous = self._install_signal_handlers()
        try:
            while self.step < cfg.train.steps:
                row = self.train_step()
                result.losses.append(row["loss"])
                val = None
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                    val = self.evaluate()
                    if val is not None:
                        row["val_loss"] = val
                writer.write(row)
                reporter.step(row)
                bad = guard.observe(row)  # loss and |g| are the job's: every rank agrees
                if guard.diverged:
                    msg = guard.message(self.step, self._good_checkpoint)
                    raise JobStopped(msg, ExitCode.DIVERGED)
                last = self.step == cfg.train.steps
                # A signal may reach some ranks only: all stop at the same step, or none does.
                result.stop_signal = self._agreed_stop_signal()
                stop = result.stop_signal is not None or self.step == cfg.checkpoint.stop_after
                if cfg.checkpoint.enabled and (
                    last
                    or stop
                    or (cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0)
                ):
                    self._save_checkpoint_if_finite(bad, reporter)
                maybe_inject(self.rank, self.step)  # LLMSCALE_FAULT: the fault tests only
                if stop and not last:
                    result.interrupted = True
                    break
                result.stop_signal = None  # a signal during the last step: the run is done
            self.write_pipeline_timeline()
            if not result.interrupted:
                result.val_loss = self.evaluate()
                if result.val_loss is not None:
                    writer.write({"kind": "eval", "step": self.step, "val_loss": result.val_loss})
            self._write_offload_timelines()
        finally:
            if self._stop_signal and under_launcher():
                # Stopping on a signal under a launcher, the SIGINT handler stays: a Ctrl-C's
                # forwarded copy can still come while this rank tears down (a barrier, the
                # process group), which it knows for a copy, where the default handler would
                # take it for a second Ctrl-C. SIGTERM's goes back to the heartbeat's `_leave`
                # (the launcher stops a survivor with it when a peer died).
                previous.pop(signal.SIGINT, None)
            self._restore_signal_handlers(previous)
            writer.close()
            result.steps_done = self.step
            reporter.finish(result)
            self.run_folder.release()
        if result.stop_signal is not None:
            raise JobStopped(self._signal_message(result), _SIGNAL_EXIT[result.stop_signal])
        return result

    def _write_offload_timelines(self) -> None:
        """RUN_DIR/timeline-rank{r}.json (-chunk{i} per further model chunk): `plot --timeline`."""
        self.optimizers.write_timelines(self.run_dir, self.rank)  # waits for the last uploads

    def _save_checkpoint_if_finite(self, bad_step: bool, reporter: StepReporter) -> None:
        """Save a checkpoint of this step unless its loss or gradient norm was not finite or
        any rank holds a non-finite weight: a diverged step never replaces good weights."""
        weights = (t for part in self.model_parts for t in get_model_state_dict(part).values())
        if bad_step or not all_finite(weights, self.dims, self.device):
            reporter.note(
                f"step {self.step}: checkpoint not written (non-finite loss, gradient norm or "
                "weights); the earlier checkpoints stay"
            )
            return
        self.save_checkpoint()
        self._good_checkpoint = self.step

    def _agreed_stop_signal(self) -> str | None:
        """The stop signal any rank saw ("SIGINT", "SIGTERM"), the same on every rank; None
        when none came. SIGINT wins when ranks saw different ones."""
        seen = self.dims.all_reduce_max(
            torch.tensor(float(_SIGNAL_RANK.get(self._stop_signal, 0)), device=self.device)
        )
        rank = int(seen.item())
        return next((n for s, n in _SIGNAL_NAMES.items() if _SIGNAL_RANK[s] == rank), None)

    def _signal_message(self, result: TrainResult) -> str:
        """The one line a run stopped by a signal ends with: the signal, the step, the
        checkpoint."""
        head = f"stopped by {result.stop_signal} after step {result.steps_done}"
        if not self.cfg.checkpoint.enabled:
            return f"{head}; no checkpoint written (checkpoint.enabled = false)"
        if self._good_checkpoint != result.steps_done:
            return f"{head}; no checkpoint written (non-finite weights)"
        path = self.checkpointer.path_for(result.steps_done)
        return f"{head}; checkpoint written to {path}, resume with --resume"

    def _install_signal_handlers(self) -> dict[int, Any]:
        """SIGTERM/SIGINT finish the current step, write a checkpoint, then stop (exit 143 or
        130: `fit` raises JobStopped). A second SIGINT (Ctrl-C again) stops at once, without
        the checkpoint (KeyboardInterrupt: exit 130). Under a launcher one Ctrl-C can arrive
        twice (sent to every process of the job and forwarded by the launcher): this project's
        launcher counts the copies it forwards; under another, a repeat within a few seconds of
        the first is taken as the same one (`launch.second_ctrl_c`)."""

        again = ctrl_c_again_wait()
        notice = (
            "\nSIGINT: stopping after this step with a checkpoint "
            f"(Ctrl-C again {again}to stop at once, without one)\n"
        ).encode()
        sigints = [0]  # SIGINTs seen, direct or forwarded

        def handler(signum: int, frame: Any) -> None:
            heartbeat.note_signal(signum)  # a collective failing now: the launcher stops us
            now = time.monotonic()
            if signum == signal.SIGINT:
                sigints[0] += 1
            if signum == signal.SIGINT and self._stop_signal == signal.SIGINT:
                if second_ctrl_c(sigints[0], now - self._stop_time):
                    raise KeyboardInterrupt
                return
            self._stop_signal, self._stop_time = signum, now
            if signum == signal.SIGINT and self.rank == 0:
                # os.write: safe inside a signal handler, unlike the console's print.
                os.write(2, notice)

        previous: dict[int, Any] = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. inside a test runner's worker)
            pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Let go of the model, optimizers, pipeline schedule and device mesh; a closed trainer
        cannot train.

        They hold this rank's process groups (pipeline stages and meshes keep theirs) and its
        device memory. Dropped here, they go at once, before `destroy_process_group`, even if
        something still refers to the trainer: a traceback's frames, or a cycle that only the
        garbage collector frees. One such cycle is torch's own: the first meta-device model
        build imports torch._dynamo, whose `torch.fx.wrap` call keeps its frame (a local
        refers to it), and with it every caller's frame up to `__init__` and `self`. Left
        to interpreter exit, a process group is destroyed under a finalising interpreter,
        where gloo can abort the rank ("terminate called without an active exception").
        """
        self.pp_schedule = None
        self.run_folder.release()
        self.optimizers.close()
        self.model_parts.clear()  # the same list as self.parallel.parts
        self.dims.mesh = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The stop signals: their names, the exit code each ends the run with, and their precedence
# when ranks saw different ones (the number agreed over the job with an all-reduce max).
_SIGNAL_NAMES: dict[int, str] = {signal.SIGINT.value: "SIGINT", signal.SIGTERM.value: "SIGTERM"}
_SIGNAL_EXIT = {"SIGINT": ExitCode.SIGINT, "SIGTERM": ExitCode.SIGTERM}
_SIGNAL_RANK: dict[int, int] = {signal.SIGTERM.value: 1, signal.SIGINT.value: 2}


class _PipelineLoss:
    """The pipeline schedule's loss_fn (last stage): mean loss / micro-batches, loss-scaled.

    An object of its own rather than a bound method of the trainer: the schedule keeps its
    loss_fn, and a trainer -> schedule -> trainer cycle would keep the stages, and the process
    groups they hold, alive until the garbage collector ran (possibly only at interpreter exit,
    past `destroy_process_group`, where gloo's threads can abort the process).
    """

    def __init__(
        self, scaler: DynamicLossScaler, n_microbatches: int, n_valid_vocab: int | None = None
    ) -> None:
        self.scaler = scaler
        self.n_microbatches = n_microbatches
        self.n_valid_vocab = n_valid_vocab
        self.losses: list[torch.Tensor] = []  # this step's, detached
        # While evaluating: each micro-batch's [token loss sum, tokens] (`token_loss_sum`).
        self.eval_sums: list[torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.eval_sums is not None:
            sums = token_loss_sum(mask_padded_vocab(logits.float(), self.n_valid_vocab), targets)
            self.eval_sums.append(sums)
            return sums[0]
        loss = lm_loss(logits, targets, self.n_valid_vocab)
        self.losses.append(loss.detach())
        return self.scaler.scale_loss(loss / self.n_microbatches)


def run_training(cfg: JobConfig) -> TrainResult:
    """Build a Trainer for `cfg` and run it to the end (or to an interruption).

    Under torchrun the process group is torn down before the interpreter exits: left to the
    exit handlers, gloo's threads can be destroyed while still joinable and abort the rank.
    """
    started_here = not dist.is_initialized()
    try:
        with Trainer(cfg) as trainer:
            result = trainer.fit()
    except BaseException as e:
        # A collective that timed out or lost a peer: name the ranks that stopped answering.
        lost = heartbeat.peer_lost(e) if started_here else None
        if started_here and dist.is_initialized():
            # A second Ctrl-C: the peers, which may not have had it, leave at once too.
            heartbeat.stop(finished=False, interrupted=isinstance(e, KeyboardInterrupt))
            dist.destroy_process_group()  # no barrier: the other ranks may be gone
        if lost is not None:
            raise lost from None
        raise
    if started_here and dist.is_initialized():
        dist.barrier()
        heartbeat.stop()
        dist.destroy_process_group()
    return result
