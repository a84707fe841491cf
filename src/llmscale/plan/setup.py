"""The training layout the planner costs: one flat, frozen record of the job's relevant fields.

Field names are the runtime's (`[train] micro_batch_size`, `[parallel] tp`, ...), so a plan turns
into `llmscale train` overrides and a JobConfig turns into a plan. Validation is the runtime's own
(`JobConfig.validate`), plus the planner's extra shape rules, so both sides reject the same input.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmscale.config import (
    DataSection,
    JobConfig,
    OptimizerSection,
    ParallelSection,
    PrecisionSection,
    TrainSection,
)
from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig


@dataclass(frozen=True)
class Plan:
    """Model, batch, recomputation, precision, offload and the parallel layout of one job."""

    model: ModelConfig
    seq_len: int
    micro_batch_size: int
    global_batch_size: int
    recompute: str = "none"  # none | selective | every_k | full
    recompute_every_k: int = 2
    precision: str = "bf16"  # fp32 | bf16 | fp16
    offload: str = "none"  # none | optimizer | optimizer+params
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    pp_chunks: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 3  # with dp_shard > 1: 1 and 2 keep params unsharded forward to backward

    # ---- derived ------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def microbatches(self) -> int:
        """Micro-batches each pipeline runs per optimizer step (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def sharded(self) -> bool:
        """FSDP2 (fully_shard) holds the states: dp_shard > 1."""
        return self.dp_shard > 1

    @property
    def fsdp_cpu_offload(self) -> bool:
        """optimizer+params under data parallelism: FSDP2's CPUOffloadPolicy holds the params."""
        return self.offload == "optimizer+params" and self.dp > 1

    @property
    def lowp_weights(self) -> bool:
        """The forward runs on bf16/fp16 weights: FSDP2's param_dtype or offloaded working copies."""
        return self.precision != "fp32" and (self.sharded or self.offload != "none")

    @property
    def chunks(self) -> int:
        return self.pp_chunks if self.pp_schedule == "interleaved_1f1b" else 1

    def layers_per_stage(self) -> int:
        """Transformer blocks per pipeline rank (the planner splits layers evenly)."""
        return self.model.n_layers // self.pp

    # ---- conversion ---------------------------------------------------------------------
    @classmethod
    def from_job(cls, job: JobConfig) -> Plan:
        t, p = job.train, job.parallel
        return cls(
            model=job.model,
            seq_len=job.data.seq_len,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
            recompute=t.recompute,
            recompute_every_k=t.recompute_every_k,
            precision=job.precision.mode,
            offload=job.optimizer.offload,
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            tp=p.tp,
            pp=p.pp,
            pp_schedule=p.pp_schedule,
            pp_chunks=p.pp_chunks,
            sequence_parallel=p.sequence_parallel,
            zero_stage=p.zero_stage,
        )

    def to_job(self) -> JobConfig:
        """A JobConfig with this plan's fields (defaults elsewhere)."""
        return JobConfig(
            model=self.model,
            data=DataSection(seq_len=self.seq_len),
            train=TrainSection(
                micro_batch_size=self.micro_batch_size,
                global_batch_size=self.global_batch_size,
                recompute=self.recompute,
                recompute_every_k=self.recompute_every_k,
            ),
            precision=PrecisionSection(mode=self.precision),
            optimizer=OptimizerSection(offload=self.offload),
            parallel=ParallelSection(
                dp_replicate=self.dp_replicate,
                dp_shard=self.dp_shard,
                tp=self.tp,
                pp=self.pp,
                pp_schedule=self.pp_schedule,
                pp_chunks=self.pp_chunks,
                sequence_parallel=self.sequence_parallel,
                zero_stage=self.zero_stage,
            ),
        )

    def overrides(self) -> list[str]:
        """`llmscale train` overrides that reproduce this plan."""
        pairs = [
            ("model.name", self.model.name),
            ("data.seq_len", self.seq_len),
            ("train.micro_batch_size", self.micro_batch_size),
            ("train.global_batch_size", self.global_batch_size),
            ("train.recompute", self.recompute),
            ("precision.mode", self.precision),
            ("optimizer.offload", self.offload),
            ("parallel.dp_replicate", self.dp_replicate),
            ("parallel.dp_shard", self.dp_shard),
            ("parallel.tp", self.tp),
            ("parallel.pp", self.pp),
            ("parallel.pp_schedule", self.pp_schedule),
            ("parallel.pp_chunks", self.pp_chunks),
            ("parallel.sequence_parallel", str(self.sequence_parallel).lower()),
            ("parallel.zero_stage", self.zero_stage),
        ]
        if self.recompute == "every_k":
            pairs.insert(5, ("train.recompute_every_k", self.recompute_every_k))
        return [f"--{k} {v}" for k, v in pairs]

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        """The runtime's rules (JobConfig.validate), then the planner's even-split rules."""
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ConfigError("data.seq_len", self.seq_len, "a positive integer")
        self.to_job().validate(world_size=self.world_size)
        m = self.model
        if m.n_layers % (self.pp * self.chunks):
            raise ConfigError(
                "parallel.pp",
                self.pp,
                f"pp x pp_chunks dividing model.n_layers={m.n_layers} (the planner splits evenly)",
            )
        if m.ffn_dim % self.tp:
            raise ConfigError("parallel.tp", self.tp, f"a divisor of model.ffn_dim={m.ffn_dim}")
        if self.pp_schedule == "interleaved_1f1b" and self.microbatches % self.pp:
            raise ConfigError(
                "train.global_batch_size",
                self.global_batch_size,
                f"micro-batches per step a multiple of pp={self.pp} for interleaved_1f1b",
            )
