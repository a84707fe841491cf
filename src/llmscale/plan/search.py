"""Search parallel layouts and training options for the fastest plan that fits.

Enumerated: tp x pp x dp (dp as replicas x FSDP shards), micro-batch size, recompute mode,
ZeRO stage (when sharded), pipeline schedule and chunks, sequence parallelism, offload. Kept only
when: tp <= GPUs per node and tp divides n_heads, n_kv_heads and ffn_dim; pp x chunks divides
n_layers; the global batch divides by micro-batch x dp (and gives >= pp micro-batches, a multiple
of pp for interleaved); the fullest GPU fits (plan/memory.py, with its allocator overhead and
device reserve), and offloaded states fit the node's host memory. Ranked by predicted step time (plan/time.py), closed-form bubble in the loop;
the best `resimulate` are re-timed with the pipeline simulator before the final ranking.

Speed (a 70B model over 4096 GPUs in well under a second, bench/plan_speed.py): memory is
checked before time; states alone prune a layout before any activation is counted; larger
micro-batches are tried only while smaller ones fit (memory grows with micro-batch size); only
the first and last pipeline ranks are costed in the loop (they hold the embedding and the head,
and rank 0 the most micro-batches in flight); per-tensor counts, collectives and per-block
activations are cached.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from llmscale.config import OFFLOAD_MODES, PRECISIONS, Offload, PPSchedule, Precision, Recompute
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GiB
from llmscale.model.config import ModelConfig
from llmscale.plan import memory as mem
from llmscale.plan import time as tm
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan

RECOMPUTE_ORDER: tuple[Recompute, ...] = (
    "none",
    "selective",
    "every_k",
    "full",
)  # most memory first


@dataclass(frozen=True)
class SearchSpace:
    """The options tried; each tuple lists the values the search may pick."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    recompute: tuple[Recompute, ...] = RECOMPUTE_ORDER
    recompute_every_k: int = 2
    schedules: tuple[PPSchedule, ...] = ("1f1b", "interleaved_1f1b", "gpipe")
    chunks: tuple[int, ...] = (2, 4)
    zero_stages: tuple[int, ...] = (3, 1)  # 2 lays memory out as 1 in FSDP2: not tried twice
    offload: tuple[Offload, ...] = OFFLOAD_MODES
    sequence_parallel: tuple[bool, ...] = (False, True)
    data_parallel: tuple[str, ...] = ("shard", "replicate", "hybrid")  # hybrid: shard in-node


DEFAULT_SPACE = SearchSpace()


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    memory: mem.MemoryEstimate
    time: tm.StepTime


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Candidate, ...]  # best first
    evaluated: int  # plans whose memory was computed
    feasible: int  # of which fit
    seconds: float  # wall time of the search
    cluster: Cluster
    gpus: int
    space: SearchSpace = field(default=DEFAULT_SPACE)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dp_splits(dp: int, tp: int, cluster: Cluster, space: SearchSpace) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) pairs to try."""
    out: list[tuple[int, int]] = []
    if "shard" in space.data_parallel and dp > 1:
        out.append((1, dp))
    if "replicate" in space.data_parallel or dp == 1:
        out.append((dp, 1))
    in_node = cluster.gpus_per_node // tp
    if "hybrid" in space.data_parallel and 1 < in_node < dp and dp % in_node == 0:
        out.append((dp // in_node, in_node))
    return out


def _layouts(model: ModelConfig, gpus: int, cluster: Cluster) -> Iterator[tuple[int, int, int]]:
    # Even layer splits only: the runtime runs uneven ones too (and the planner costs them), but
    # a stage with an extra layer sets the pace and an even split of the same degree is faster.
    for tp in _divisors(min(gpus, cluster.gpus_per_node)):
        if gpus % tp or model.n_heads % tp or model.n_kv_heads % tp or model.ffn_dim % tp:
            continue
        for pp in _divisors(gpus // tp):
            if model.n_layers % pp or (pp > 1 and model.tie_embeddings):
                continue
            yield tp, pp, gpus // (tp * pp)


def _schedules(
    model: ModelConfig, pp: int, microbatches: int, space: SearchSpace
) -> Iterator[tuple[PPSchedule, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    if microbatches < pp:
        if "gpipe" in space.schedules:
            yield "gpipe", 1
        return
    for s in space.schedules:
        if s == "interleaved_1f1b":
            for v in space.chunks:
                if model.n_layers % (pp * v) == 0 and microbatches % pp == 0:
                    yield s, v
        else:
            yield s, 1


def search(
    model: ModelConfig,
    gpus: int,
    cluster: Cluster,
    seq_len: int,
    global_batch_size: int,
    precision: Precision = "bf16",
    top: int = 10,
    space: SearchSpace = DEFAULT_SPACE,
    memory_options: mem.MemoryOptions = mem.DEFAULT_OPTIONS,
    time_params: tm.TimeParams = tm.DEFAULT_TIME,
    resimulate: int = 10,
) -> SearchResult:
    """The `top` fastest plans that fit, best first (an empty result when none fits)."""
    _check_inputs(model, gpus, seq_len, global_batch_size, precision, top)
    start = time.perf_counter()
    budget = cluster.gpu.memory_bytes - memory_options.device_reserve_GiB * GiB
    over = 1.0 + memory_options.allocator_overhead
    host_per_gpu = cluster.node.host_memory_bytes / cluster.gpus_per_node
    found: list[tuple[float, float, Plan]] = []
    evaluated = 0
    recs = [r for r in RECOMPUTE_ORDER if r in space.recompute]
    offloads = [o for o in OFFLOAD_MODES if o in space.offload]
    for tp, pp, dp in _layouts(model, gpus, cluster):
        ends = (0, pp - 1) if pp > 1 else (0,)
        for dp_rep, dp_shard in _dp_splits(dp, tp, cluster, space):
            zeros = sorted(space.zero_stages) if dp_shard > 1 else [3]  # 1 (fewer gathers) first
            base = Plan(
                model=model, seq_len=seq_len, micro_batch_size=1,
                global_batch_size=global_batch_size, precision=precision,
                dp_replicate=dp_rep, dp_shard=dp_shard, tp=tp, pp=pp,
                recompute_every_k=space.recompute_every_k,
            )  # fmt: skip
            # Knob settings whose states alone fit, each as (zero index, offload index).
            states_ok = [
                (zi, oi)
                for zi, zero in enumerate(zeros)
                for oi, off in enumerate(offloads)
                if not _states_exceed(replace(base, zero_stage=zero, offload=off), ends,
                                      memory_options, budget / over, host_per_gpu)
            ]  # fmt: skip
            if not states_ok:
                continue
            for sp in space.sequence_parallel if tp > 1 else (False,):
                for mbs in space.micro_batch_sizes:
                    if global_batch_size % (mbs * dp):
                        continue
                    micro = global_batch_size // (mbs * dp)
                    fit_any = False
                    for sched, v in _schedules(model, pp, micro, space):
                        # Time grows with each knob (recompute level, ZeRO stage, offload level)
                        # and memory shrinks: skip a setting once one at least as fast fits.
                        fits: list[tuple[int, int, int]] = []
                        for ri, rec in enumerate(recs):
                            if rec == "every_k" and space.recompute_every_k > model.n_layers:
                                continue
                            for zi, oi in states_ok:
                                if any(f[0] <= ri and f[1] <= zi and f[2] <= oi for f in fits):
                                    continue
                                plan = Plan(
                                    model=model, seq_len=seq_len, micro_batch_size=mbs,
                                    global_batch_size=global_batch_size, recompute=rec,
                                    recompute_every_k=space.recompute_every_k,
                                    precision=precision, offload=offloads[oi],
                                    dp_replicate=dp_rep, dp_shard=dp_shard, tp=tp, pp=pp,
                                    pp_schedule=sched, pp_chunks=v, sequence_parallel=sp,
                                    zero_stage=zeros[zi],
                                )  # fmt: skip
                                total = mem.worst_total(plan, memory_options, ends)
                                evaluated += 1
                                if total <= budget:
                                    fits.append((ri, zi, oi))
                                    t = tm.estimate_step_time(
                                        plan, cluster, time_params, ranks=ends, validate=False
                                    )
                                    found.append((t.seconds, total, plan))
                        fit_any = fit_any or bool(fits)
                    if not fit_any:
                        break  # a bigger micro-batch needs more memory still
    feasible = len(found)
    found.sort(key=lambda x: (x[0], x[1]))
    finals: list[Candidate] = []
    for _, _, plan in found[: max(top, resimulate)]:
        full_mem = mem.estimate_memory(plan, memory_options, validate=False)
        t = tm.estimate_step_time(plan, cluster, time_params, simulate=plan.pp > 1, validate=False)
        finals.append(Candidate(plan, full_mem, t))
    finals.sort(key=lambda c: (c.time.seconds, c.memory.total))
    return SearchResult(
        candidates=tuple(finals[:top]),
        evaluated=evaluated,
        feasible=feasible,
        seconds=time.perf_counter() - start,
        cluster=cluster,
        gpus=gpus,
        space=space,
    )


def _states_exceed(
    base: Plan, ends: tuple[int, ...], opt: mem.MemoryOptions, budget: float, host: float
) -> bool:
    """True when the states alone overflow some stage's GPU, or its node's host memory."""
    for rank in ends:
        st = mem.rank_states(base, rank, opt)
        if st.params + st.grads + st.optimizer + st.working_params > budget or st.host > host:
            return True
    return False


def _check_inputs(
    model: ModelConfig, gpus: int, seq_len: int, global_batch_size: int, precision: str, top: int
) -> None:
    for name, value in (("gpus", gpus), ("seq_len", seq_len), ("global_batch_size", global_batch_size), ("top", top)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "a positive integer")
    if seq_len > model.max_seq_len:
        raise ConfigError("seq_len", seq_len, f"<= model.max_seq_len={model.max_seq_len}")
    if precision not in PRECISIONS:
        raise ConfigError("precision", precision, " | ".join(PRECISIONS))
