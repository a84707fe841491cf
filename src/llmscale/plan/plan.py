"""The training layout the planner costs: one frozen, keyword-only record of the job's fields.

Each field names the config key it mirrors (`_cfg("train.micro_batch_size")`); that one table
generates `from_job`, `to_job` and `overrides`, so a plan turns into `llmscale train` overrides
and a JobConfig into a plan without a hand-kept mapping. Derived numbers come from where the
runtime gets them: dp, world size and FSDP from `config.MeshDegrees` (as `ParallelSection` and
`ParallelDims`); accumulation steps, FSDP2's CPU offload, the layer split and which blocks
recompute from the functions in `llmscale.config` and `llmscale.model.config`. Validation is the
runtime's own (`JobConfig.validate`), so both sides reject the same input.

The `*_key` methods list what each cached planner result reads (plan/cache.py); they sit here,
next to the fields, so a new field is added to them in the same place
(tests/plan/test_plan.py perturbs every field and checks the keys).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any, Generic, TypeVar, overload

from llmscale.config import (
    V_SCHEDULES,
    Float8Recipe,
    JobConfig,
    MeshDegrees,
    Offload,
    PPSchedule,
    Precision,
    Recompute,
    n_microbatches,
    pipeline_chunks,
    uses_fsdp_cpu_offload,
)
from llmscale.errors import ConfigError
from llmscale.model.config import (
    BlockMode,
    ModelConfig,
    block_recompute,
    model_overrides,
    split_layers,
    stage_ids,
)
from llmscale.plan.cache import memoize_values
from llmscale.plan.schedule import held_grads_order
from llmscale.stack import LLMSCALE, Stack, param_residency

T = TypeVar("T")


class _Kept(Generic[T]):
    """A derived value of a plan computed on its first read and kept in the plan's __dict__,
    where later reads find it without a call (a non-data descriptor); `reads` names the fields
    it is computed from: `Plan.varied` carries it to a plan that changes none of them
    (tests/plan/test_search_speed.py perturbs every other field). For the few values the
    search's inner loop reads most (hundreds of thousands of reads per search)."""

    def __init__(self, reads: tuple[str, ...], fn: Callable[[Any], T]) -> None:
        self.reads = frozenset(reads)
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Kept[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object, owner: type | None = None) -> T | _Kept[T]:
        if obj is None:
            return self
        value: T = self.fn(obj)
        obj.__dict__[self.name] = value
        return value


def _kept(*reads: str) -> Callable[[Callable[[Any], T]], _Kept[T]]:
    return lambda fn: _Kept(reads, fn)


def _cfg(key: str, default: Any = None, frozen: type | None = None) -> Any:
    """A Plan field mirroring config key `key` ("section.name"); no default when None. `frozen`:
    the hashable type a config list becomes in the plan (tuple; back to a list in the job)."""
    meta = {"config": key, "frozen": frozen}
    if default is None:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class Plan(MeshDegrees):
    """Model, batch, recomputation, precision, offload and the parallel layout of one job."""

    model: ModelConfig = _cfg("model")
    seq_len: int = _cfg("data.seq_len")
    micro_batch_size: int = _cfg("train.micro_batch_size")
    global_batch_size: int = _cfg("train.global_batch_size")
    recompute: Recompute = _cfg("train.recompute", "none")
    recompute_every_k: int = _cfg("train.recompute_every_k", 2)
    # The first blocks whose saved activations wait in host memory (`RankWork.offloaded`).
    offload_activations: int = _cfg("train.offload_activations", 0)
    precision: Precision = _cfg("precision.mode", "bf16")
    # fp8: torchao's float8 recipe (plan/time.py `FLOAT8_RECIPES`' costs)
    float8_recipe: Float8Recipe = _cfg("precision.float8_recipe", "tensorwise")
    offload: Offload = _cfg("optimizer.offload", "none")
    # offload lsp: projector rows and non-zeros per column (plan/lsp.py)
    lsp_dim: int = _cfg("optimizer.lsp_dim", 512)
    lsp_nonzeros: int = _cfg("optimizer.lsp_nonzeros", 16)
    dp_replicate: int = _cfg("parallel.dp_replicate", 1)
    dp_shard: int = _cfg("parallel.dp_shard", 1)
    tp: int = _cfg("parallel.tp", 1)
    pp: int = _cfg("parallel.pp", 1)
    pp_schedule: PPSchedule = _cfg("parallel.pp_schedule", "1f1b")
    pp_chunks: int = _cfg("parallel.pp_chunks", 1)
    # Layers of each pipeline stage; () = the automatic split (model.config.stage_layer_counts).
    pp_layers: tuple[int, ...] = _cfg("parallel.pp_layers", (), frozen=tuple)
    # Context parallelism (costed before the runtime has it): each sequence over cp ranks.
    cp: int = _cfg("parallel.cp", 1)
    sequence_parallel: bool = _cfg("parallel.sequence_parallel", False)
    # With dp_shard > 1: 1 and 2 keep params unsharded from forward to backward, 3 reshards.
    zero_stage: int = _cfg("parallel.zero_stage", 3)

    # ---- derived (dp, world_size, fsdp from MeshDegrees; the rest from the runtime's functions)
    @_kept("dp_replicate", "dp_shard")
    def dp(self) -> int:
        """`MeshDegrees.dp`, kept."""
        return super().dp

    @_kept("dp_shard")
    def fsdp(self) -> bool:
        """`MeshDegrees.fsdp`, kept."""
        return super().fsdp

    @_kept("global_batch_size", "micro_batch_size", "dp_replicate", "dp_shard")
    def n_microbatches(self) -> int:
        """Micro-batches each pipeline runs per optimizer step (gradient accumulation steps)."""
        return n_microbatches(self.global_batch_size, self.micro_batch_size, self.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def fsdp_shards(self) -> int:
        """Ranks each FSDP2 parameter is sharded over as the llmscale runtime runs this layout:
        dp_shard, times cp under context parallelism (the dp_shard x cp mesh: cp ranks hold the
        same parameters); `fsdp_shards_for` another stack."""
        return self.fsdp_shards_for(LLMSCALE)

    def fsdp_for(self, stack: Stack) -> bool:
        """FSDP2 holds the states as `stack` runs this layout: dp_shard > 1, or, for a stack
        that shards over the cp ranks too (torchtitan), dp_shard x cp > 1."""
        return self.fsdp or (stack.fsdp_over_cp and self.cp > 1)

    def fsdp_shards_for(self, stack: Stack) -> int:
        """Ranks each FSDP2 parameter is sharded over as `stack` runs this layout (`fsdp_for`;
        1: not sharded)."""
        return self.dp_shard * self.cp if self.fsdp_for(stack) else 1

    @_kept(
        "pp_schedule", "pp", "pp_chunks", "global_batch_size", "micro_batch_size",
        "dp_replicate", "dp_shard",
    )  # fmt: skip
    def held_grads_order(self) -> tuple[str, int] | None:
        """The pipeline order whose walk says when this plan's gradients wait
        (`schedule.held_grads_order`); None without a pipeline."""
        return _held_order(self.pp_schedule, self.pp, self.n_microbatches, self.chunks)

    @property
    def fsdp_holds_grads_across_microbatches(self) -> bool:
        """FSDP2 under a pipeline schedule (torch.distributed.pipelining turns off gradient
        sync and resharding after backward for every micro-batch, then reduce-scatters once at
        the step's end), or zero 1 accumulating without one: each stage keeps its unsharded
        parameters and unsharded fp32 gradients until then (the llmscale stack's
        `param_residency`)."""
        return _holds_grads(self.fsdp, self.zero_stage, self.pp, self.n_microbatches)

    @property
    def fp8_matmuls(self) -> bool:
        """precision fp8: the linears' matmuls in float8 (torchao), everything else as bf16."""
        return self.precision == "fp8"

    @property
    def nvfp4_matmuls(self) -> bool:
        """precision nvfp4: the blocks' linears' three matmuls on NVFP4 operands
        (TransformerEngine's NVFP4BlockScaling), everything else as bf16."""
        return self.precision == "nvfp4"

    @property
    def fsdp_cpu_offload(self) -> bool:
        """optimizer+params under data parallelism: FSDP2's CPUOffloadPolicy holds the params."""
        return uses_fsdp_cpu_offload(self.offload, self.dp)

    @_kept("precision", "dp_replicate", "dp_shard", "cp", "offload")
    def lowp_weights(self) -> bool:
        """The forward runs on bf16/fp16 weights: FSDP2's or replicate's param_dtype (the
        runtime wraps the model whenever gradients are reduced, dp x cp > 1, and autocast runs
        only without) or offloaded working copies."""
        return self.precision != "fp32" and (self.dp * self.cp > 1 or self.offload != "none")

    @_kept("pp_schedule", "pp_chunks")
    def chunks(self) -> int:
        """Model chunks per pipeline rank the schedule runs (`config.pipeline_chunks`)."""
        return pipeline_chunks(self.pp_schedule, self.pp_chunks)

    @_kept("pp", "pp_schedule")
    def v_shape(self) -> bool:
        """Stages placed in a V (zbv, dualpipev): rank r holds stages r and 2 pp - 1 - r."""
        return self.pp > 1 and self.pp_schedule in V_SCHEDULES

    @_kept("pp", "pp_schedule")
    def head_rank(self) -> int:
        """The pipeline rank of the last stage (final norm, output, loss): pp - 1, or in a V
        rank 0, which holds the first and the last stage."""
        return 0 if self.v_shape else self.pp - 1

    def rank_stages(self, rank: int) -> list[range]:
        """Layer ids of each model chunk on pipeline `rank`, as the runtime splits them."""
        return _rank_stages(
            self.model.n_layers, self.pp, self.chunks, rank, self.pp_layers, self.v_shape
        )

    def rank_layers(self, rank: int) -> list[int]:
        """Global layer ids on pipeline `rank` (loop-style chunks for interleaved, a V for
        zbv and dualpipev)."""
        return [i for stage in self.rank_stages(rank) for i in stage]

    def block_modes(self, layer_ids: list[int]) -> Counter[BlockMode]:
        """How many of `layer_ids` run each block mode (none | selective | full)."""
        k = self.recompute_every_k
        if self.recompute != "every_k":  # the same mode for every block (and fast: the search)
            return Counter({block_recompute(self.recompute, 0, k): len(layer_ids)})
        return Counter(block_recompute(self.recompute, i, k) for i in layer_ids)

    def varied(self, **changes: Any) -> Plan:
        """`dataclasses.replace(self, **changes)` at a third of its cost, for the search's inner
        loop (tens of thousands of plans): the fields are copied, not passed through the
        generated __init__, which checks nothing (Plan has no __post_init__;
        tests/plan/test_search_speed.py checks that the two agree), and the kept values
        (`_Kept`) that read none of `changes` are carried over."""
        if not changes.keys() <= _FIELD_NAMES:
            unknown = sorted(changes.keys() - _FIELD_NAMES)
            raise TypeError(f"Plan has no field {', '.join(unknown)}")
        new = object.__new__(Plan)
        state = new.__dict__
        state.update(self.__dict__)
        state.update(changes)
        if not _KEPT_READS.isdisjoint(changes):  # drop the kept values read from a change
            for name, kept in _KEPT.items():
                if name in state and not kept.reads.isdisjoint(changes):
                    del state[name]
        return new

    # ---- cache keys: what each cached result reads (plan/cache.py; the model by id) ---------
    def states_key(self) -> tuple[Hashable, ...]:
        """Parameter, gradient and optimizer bytes of a rank (plan/memory.py)."""
        # (the derived values it names, each read once: a search builds thousands of keys)
        dp, pp, chunks, n_mb = self.dp, self.pp, self.chunks, self.n_microbatches
        return (
            id(self.model), self.tp, pp, chunks, self.dp_shard, self.zero_stage,
            self.offload, self.precision, uses_fsdp_cpu_offload(self.offload, dp),
            self.pp_layers, self.cp, self.v_shape, self.lsp_dim, self.lsp_nonzeros,
            dp * self.cp > 1,  # wrapped: replicate's param_dtype copies, not autocast's
            # zero 1 accumulating: unsharded grads (`fsdp_holds_grads_across_microbatches`)
            _holds_grads(self.fsdp, self.zero_stage, pp, n_mb),
            # under a pipeline, when each chunk's gradients wait (`held_grads_order`)
            _held_order(self.pp_schedule, pp, n_mb, chunks),
            # lsp's host transfer buffers: gradient hooks per step (plan.lsp.hooks_per_step)
            (n_mb, self.dp_replicate) if self.offload == "lsp" else None,
        )  # fmt: skip

    def activations_key(self) -> tuple[Hashable, ...]:
        """Saved activations of a rank at its peak (plan/memory.py)."""
        return (
            id(self.model), self.seq_len, self.micro_batch_size, self.precision, self.tp,
            self.sequence_parallel, self.recompute, self.recompute_every_k, self.pp,
            self.pp_schedule, self.chunks, self.n_microbatches, self.lowp_weights, self.pp_layers,
            self.cp, self.offload_activations,
        )  # fmt: skip

    def blocks_key(self) -> tuple[Hashable, ...]:
        """What the blocks of a rank save for one micro-batch (plan/memory.py; no schedule but
        where it places the layers)."""
        return (
            id(self.model), self.seq_len, self.micro_batch_size, self.precision, self.tp,
            self.sequence_parallel, self.recompute, self.recompute_every_k, self.pp,
            self.chunks, self.v_shape, self.lowp_weights, self.pp_layers, self.cp,
            self.offload_activations,
        )  # fmt: skip

    def pipeline_key(self) -> tuple[Hashable, ...]:
        """What a rank's pipeline stages hold besides saved activations: receive buffers and
        split backwards' pending gradients (plan/memory.py; no recompute: it saves no less)."""
        return (
            id(self.model), self.seq_len, self.micro_batch_size, self.precision, self.tp,
            self.sequence_parallel, self.pp, self.pp_schedule, self.chunks, self.n_microbatches,
            self.lowp_weights, self.pp_layers, self.cp,
        )  # fmt: skip

    def stage_time_key(self) -> tuple[Hashable, ...]:
        """One micro-batch's forward and backward time on a rank (plan/time.py)."""
        return (
            id(self.model), self.seq_len, self.micro_batch_size, self.precision, self.tp, self.pp,
            self.chunks, self.recompute, self.recompute_every_k, self.sequence_parallel,
            self.dp_shard, self.zero_stage, self.lowp_weights, self.pp_layers, self.cp,
            self.v_shape, self.offload_activations, self.float8_recipe,
            # FSDP2 under a pipeline: how often the schedule gathers (stack.pipeline_gathers)
            (self.pp_schedule, self.n_microbatches) if self.fsdp and self.pp > 1 else None,
            # nvfp4: the weights' quantisation is once per step, shared by its micro-batches
            self.n_microbatches if self.nvfp4_matmuls else None,
        )  # fmt: skip

    # ---- conversion (generated from the fields' config keys) -------------------------------
    @classmethod
    def from_job(cls, job: JobConfig) -> Plan:
        values = {f.name: _read(job, _key(f)) for f in fields(cls)}
        for f in fields(cls):
            if f.metadata["frozen"] is not None:
                values[f.name] = f.metadata["frozen"](values[f.name])
        return cls(**values)

    def to_job(self) -> JobConfig:
        """A JobConfig with this plan's fields (defaults elsewhere)."""
        job = JobConfig(model=self.model)
        by_section: dict[str, dict[str, Any]] = {}
        for f in fields(self)[1:]:
            section, name = _key(f).split(".")
            value = getattr(self, f.name)
            by_section.setdefault(section, {})[name] = (
                list(value) if f.metadata["frozen"] else value
            )
        for section, values in by_section.items():
            setattr(job, section, replace(getattr(job, section), **values))
        return job

    def overrides(self) -> list[str]:
        """`llmscale train` overrides that reproduce this plan."""
        out = model_overrides(self.model)
        for f in fields(self)[1:]:
            if f.name == "recompute_every_k" and self.recompute != "every_k":
                continue
            if f.name.startswith("lsp_") and self.offload != "lsp":
                continue  # settings of offload lsp only
            if f.name == "offload_activations" and not self.offload_activations:
                continue
            if f.name == "float8_recipe" and self.float8_recipe == "tensorwise":
                continue  # the default; a setting of fp8 only
            value = getattr(self, f.name)
            if f.metadata["frozen"]:
                if not value:
                    continue
                value = "[" + ",".join(map(str, value)) + "]"  # one shell word
            out.append(f"--{_key(f)} {str(value).lower() if isinstance(value, bool) else value}")
        return out

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        """The runtime's rules (JobConfig.validate), as `llmscale train` applies them."""
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ConfigError("data.seq_len", self.seq_len, "a positive integer")
        self.to_job().validate(world_size=self.world_size)


_FIELD_NAMES = frozenset(f.name for f in fields(Plan))
_KEPT = {n: a for n, a in vars(Plan).items() if isinstance(a, _Kept)}
_KEPT_READS = frozenset().union(*(a.reads for a in _KEPT.values()))


def _held_order(schedule: str, pp: int, n_microbatches: int, chunks: int) -> tuple[str, int] | None:
    """`Plan.held_grads_order` from its fields' values (the states key reads it too)."""
    if pp == 1:
        return None
    return held_grads_order(schedule, pp, n_microbatches, chunks)


def _holds_grads(fsdp: bool, zero_stage: int, pp: int, n_microbatches: int) -> bool:
    """`Plan.fsdp_holds_grads_across_microbatches` from its fields' values."""
    return fsdp and _grads_unsharded(zero_stage, pp, n_microbatches)


@memoize_values
def _grads_unsharded(zero_stage: int, pp: int, n_microbatches: int) -> bool:
    """`Plan.fsdp_holds_grads_across_microbatches` under FSDP (a memo: every plan's
    `states_key` reads it)."""
    res = param_residency(LLMSCALE, zero_stage=zero_stage, pp=pp, n_microbatches=n_microbatches)
    return res.grads_unsharded


@memoize_values
def _rank_stages(
    n_layers: int,
    pp: int,
    chunks: int,
    rank: int,
    pp_layers: tuple[int, ...] = (),
    v_shape: bool = False,
) -> list[range]:
    split = split_layers(n_layers, pp * chunks, pp_layers)
    return [split[s] for s in stage_ids(rank, pp, chunks, v_shape)]


def _key(f: Field[Any]) -> str:
    key: str = f.metadata["config"]
    return key


def _read(job: JobConfig, key: str) -> Any:
    value: Any = job
    for part in key.split("."):
        value = getattr(value, part)
    return value
