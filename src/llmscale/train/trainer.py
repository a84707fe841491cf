"""The training loop: data, model, mixed precision, accumulation, checkpoints, metrics."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from llmscale.config import JobConfig, to_toml
from llmscale.data.corpus import load_corpus
from llmscale.data.stream import PackedStream, StreamState
from llmscale.errors import ConfigError
from llmscale.model.transformer import build_model, count_params
from llmscale.offload import OffloadedAdamW, build_optimizer, optimizer_memory
from llmscale.train import metrics as M
from llmscale.train.checkpoint import Checkpointer
from llmscale.train.optim import build_scheduler
from llmscale.train.precision import DynamicLossScaler, autocast, gradients, underflow_report
from llmscale.train.progress import StepReporter
from llmscale.train.recompute import (
    SavedActivations,
    apply_recompute,
    model_state_tensors,
    recompute_fraction,
)


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present (the local rank's GPU under torchrun), else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("job.device", "cuda", "auto | cpu (no CUDA device is available)")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass
class TrainResult:
    """What a finished (or stopped) run returns; the same figures are in metrics.jsonl."""

    steps_done: int
    losses: list[float] = field(default_factory=list)  # losses of the steps run in this call
    val_loss: float | None = None
    interrupted: bool = False


class _AppState(Stateful):
    """Everything a resume needs, as one DCP-savable object."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.t.model, self.t.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "trainer": {
                "step": self.t.step,
                "data": self.t.train_stream.state.to_dict(),
                "scaler": self.t.scaler.state_dict(),
                "scheduler": self.t.scheduler.state_dict(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.t.model,
            self.t.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        tr = state["trainer"]
        self.t.step = int(tr["step"])
        self.t.train_stream.state = StreamState.from_dict(tr["data"])
        self.t.scaler.load_state_dict(tr["scaler"])
        self.t.scheduler.load_state_dict(tr["scheduler"])


class Trainer:
    """One process's view of a training run."""

    def __init__(self, cfg: JobConfig) -> None:
        cfg.validate(world_size=1)
        if cfg.parallel.world_size > 1:
            raise ConfigError("parallel", cfg.parallel.world_size, "1 (a single process)")
        self.cfg = cfg
        self.device = resolve_device(cfg.job.device)
        self.run_dir = Path(cfg.job.run_dir)
        self.rank = 0
        torch.manual_seed(cfg.job.seed)

        corpus = load_corpus(
            cfg.data.path, cfg.data.glob, cfg.data.val_fraction, cfg.data.max_files
        )
        self.corpus_summary = (
            f"{corpus.root} ({corpus.n_train_files} train / {corpus.n_val_files} val files, "
            f"{len(corpus.train):,} train tokens)"
        )
        self.train_stream = PackedStream(corpus.train, cfg.data.seq_len, cfg.job.seed)
        self.val_tokens = corpus.val

        self.model = build_model(cfg.model, self.device, seed=cfg.job.seed)
        apply_recompute(self.model, cfg.train.recompute, cfg.train.recompute_every_k)
        self.n_params = count_params(self.model)
        self.optimizer = build_optimizer(self.model, cfg)  # torch AdamW, or offloaded AdamW
        self.scheduler = build_scheduler(self.optimizer, cfg.train.steps, cfg.lr_scheduler)
        self.scaler = DynamicLossScaler(cfg.precision, enabled=cfg.precision.mode == "fp16")
        self.step = 0
        self.checkpointer = Checkpointer(
            self.run_dir / cfg.checkpoint.folder, cfg.checkpoint.keep_last
        )

        seq = cfg.data.seq_len
        self.tokens_per_step = cfg.train.global_batch_size * seq
        self.model_flops_per_token = cfg.model.train_flops_per_token(seq)
        self.hw_flops_per_token = cfg.model.train_flops_per_token(
            seq,
            recompute_fraction(
                cfg.train.recompute, cfg.model.n_layers, cfg.train.recompute_every_k
            ),
        )
        self.peak_flops = M.peak_flops_for_device(self.device, cfg.metrics.peak_tflops)
        self._stop_requested = False

    # ---- state ----------------------------------------------------------------------------
    def app_state(self) -> dict[str, Any]:
        return {"app": _AppState(self)}

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.app_state())

    def resume(self) -> bool:
        """Load the newest complete checkpoint, if any; True when one was loaded."""
        found = self.checkpointer.latest()
        if found is None:
            return False
        self.checkpointer.load(found[1], self.app_state())
        return True

    # ---- one optimizer step ---------------------------------------------------------------
    def forward_backward(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Accumulate gradients of this rank's batch, micro-batch by micro-batch.

        Returns the mean loss and the activation bytes saved by the first micro-batch's forward.
        Each micro-batch's loss is divided by the number of micro-batches, so k micro-steps of b
        sequences leave the same gradient as one step of k*b.
        """
        cfg = self.cfg
        micro_batches = batch.split(cfg.train.micro_batch_size)
        accum = len(micro_batches)
        act_bytes = 0
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            mb = mb.to(self.device, non_blocking=True)
            inputs, targets = mb[:, :-1], mb[:, 1:]
            counter = None
            if cfg.metrics.activation_memory and i == 0:
                counter = SavedActivations(model_state_tensors(self.model))
            with (
                counter or contextlib.nullcontext(),
                autocast(cfg.precision.mode, self.device.type),
            ):
                loss = lm_loss(self.model(inputs), targets)
            if counter is not None:
                act_bytes = counter.bytes
            self.scaler.scale_loss(loss / accum).backward()
            loss_sum += loss.detach()
        return loss_sum / accum, act_bytes

    def optimizer_step(self) -> dict[str, Any]:
        """Unscale, check for overflow, clip, step (unless skipped), update the loss scale."""
        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        offloaded = isinstance(self.optimizer, OffloadedAdamW)  # its gradients are on the host
        if offloaded:
            found_inf = self.optimizer.unscale_and_check(self.scaler)
        else:
            found_inf = self.scaler.unscale_and_check(gradients(params))
        out: dict[str, Any] = {"lr": self.optimizer.param_groups[0]["lr"]}
        if self.step + 1 in cfg.precision.underflow_steps:
            out["underflow"] = [r.to_dict() for r in underflow_report(gradients(params))]
        max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
        if offloaded:
            out["grad_norm"] = float(self.optimizer.clip_grad_norm_(max_norm))
        else:
            out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
        out["grad_bytes"] = M.grad_bytes([self.model])
        if not found_inf:
            self.optimizer.step()
            self.scheduler.step()  # a skipped step does not advance the schedule (as Megatron)
        self.scaler.update(found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        out["skipped"] = found_inf
        out["loss_scale"] = self.scaler.scale
        return out

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over the next global batch; returns its metrics row."""
        cfg = self.cfg
        t0 = time.perf_counter()
        batch = self.train_stream.next_batch(cfg.train.global_batch_size)
        loss, act_bytes = self.forward_backward(batch)
        row: dict[str, Any] = self.optimizer_step()
        row["param_bytes"] = M.param_bytes([self.model])
        row.update(optimizer_memory(self.optimizer))
        row["activation_bytes"] = act_bytes
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
            accum_steps=cfg.accum_steps,
        )
        if self.peak_flops:
            row["mfu"] = tps * self.model_flops_per_token / self.peak_flops
            row["hfu"] = tps * self.hw_flops_per_token / self.peak_flops
        return row

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the first eval_batches batches of the validation files."""
        cfg = self.cfg
        if len(self.val_tokens) <= cfg.data.seq_len or cfg.train.eval_batches == 0:
            return None
        stream = PackedStream(self.val_tokens, cfg.data.seq_len, seed=0, shuffle=False)
        n = min(cfg.train.eval_batches, max(1, stream.n_windows // cfg.train.micro_batch_size))
        total = 0.0
        for _ in range(n):
            mb = stream.next_batch(min(cfg.train.micro_batch_size, stream.n_windows)).to(
                self.device
            )
            with autocast(cfg.precision.mode, self.device.type):
                total += lm_loss(self.model(mb[:, :-1]), mb[:, 1:]).item()
        return total / n

    # ---- the loop -------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.run_dir / "metrics.jsonl"
        resumed = cfg.checkpoint.resume and self.resume()
        if self.rank == 0:
            if resumed:
                M.truncate_after(metrics_path, self.step)
            elif metrics_path.exists():
                metrics_path.unlink()
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
        writer = M.JsonlWriter(metrics_path, enabled=self.rank == 0)
        reporter = StepReporter(cfg, enabled=self.rank == 0)
        reporter.start(self, resumed)
        result = TrainResult(steps_done=self.step)
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
                last = self.step == cfg.train.steps
                stop = self._stop_requested or self.step == cfg.checkpoint.stop_after
                if cfg.checkpoint.enabled and (
                    last
                    or stop
                    or (cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0)
                ):
                    self.save_checkpoint()
                if stop and not last:
                    result.interrupted = True
                    break
            if not result.interrupted:
                result.val_loss = self.evaluate()
                if result.val_loss is not None:
                    writer.write({"kind": "eval", "step": self.step, "val_loss": result.val_loss})
            if isinstance(self.optimizer, OffloadedAdamW):  # uploads done; pipeline timeline
                self.optimizer.write_timeline(self.run_dir / f"timeline-rank{self.rank}.json")
        finally:
            self._restore_signal_handlers(previous)
            writer.close()
            reporter.finish(result)
        result.steps_done = self.step
        return result

    def _install_signal_handlers(self) -> dict[int, Any]:
        """SIGTERM/SIGINT finish the current step, write a checkpoint, then stop."""

        def handler(signum: int, frame: Any) -> None:
            self._stop_requested = True

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


def run_training(cfg: JobConfig) -> TrainResult:
    """Build a Trainer for `cfg` and run it to the end (or to an interruption)."""
    return Trainer(cfg).fit()
