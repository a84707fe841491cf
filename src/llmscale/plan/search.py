"""Search parallel layouts and training options for the fastest plan that fits.

Enumerated: tp x pp x dp (dp as replicas x FSDP shards), micro-batch size, recompute mode,
ZeRO stage (when sharded), pipeline schedule and chunks, sequence parallelism, offload, and,
unless the space fixes it, the context-parallel degree (cp GPUs per sequence: gpus = pp x dp x
cp x tp; `context_degrees`, each cp > 1 at the micro-batch sizes it does not divide:
`cp_dominated`); an explicit layer split (`pp_layers`) is fixed by the space. Kept only when:
tp <= GPUs per node and tp divides n_heads, n_kv_heads and ffn_dim; pp x chunks <= n_layers,
or n_layers + 2 with the embedding and the head each on a stage of their own (a pp that does
not divide n_layers splits them unevenly, as the runtime does:
`model.config.stage_layer_counts`); the global batch divides by micro-batch x dp and the
micro-batches meet the schedule's rule, as the runtime's (`config.microbatch_rule`: >= pp, a
multiple of pp for interleaved_1f1b and zero_bubble, >= 2 pp for dualpipev);
seq_len is a multiple of 2 cp; the fullest GPU fits (plan/memory.py, with its allocator overhead
and device reserve), and offloaded states fit the node's host memory. Ranked by predicted step
time (plan/time.py), closed-form bubble in the loop; the best `resimulate` are re-timed with the
pipeline simulator before the final ranking.

Speed (`python -m llmscale.bench.plan_speed`: llama2-70b on 64 H200 within 1 s, llama3-70b on
4096 H100 within 0.5 s; docs/planner.md, "Search speed"): memory is checked before time, rank
0 first, stopping at the first rank over the budget (`mem.worst_total`'s limit; a split
schedule's op order is walked only where the rest fits); states alone prune a layout before
any activation is counted; larger micro-batches are tried only while smaller ones fit (memory
grows with micro-batch size); only
the first and last pipeline ranks are costed in the loop (they hold the embedding and the head,
and rank 0 the most micro-batches in flight), plus, split unevenly, the first rank with the most
layers (every rank for an explicit `pp_layers`); a recompute mode that keeps no less than a
faster one is not costed (`_useful_recomputes`); shown plans with more than `SIMULATE_MAX_OPS`
pipeline ops keep the closed form; per-tensor counts, collectives and per-block activations are
cached. In the inner loop a layout's plans differ only in recompute, ZeRO stage and offload:
`_Floors` finds each costed rank's floor (`worst_total`'s first test) from its states, looked up
once per (ZeRO stage, offload), and its activity, once per (recompute, low-precision weights),
and builds a plan (`Plan.varied`) only for those it does not rule out; a plan that fits is
timed in full only while its step-time floor (`tm.step_time_floor`) can beat the
`max(top, resimulate)` fastest so far (`PRUNE_BY_TIME_FLOOR`), and the rest of a knob loop is
left uncosted once the floor of its fastest setting left cannot (`_slower_than`); GPipe is tried
only where 1F1B cannot run (`DOMINATED_BY`); the simulator re-times the shown plans without a
timeline, from the graphs it keeps (plan/schedule.py `simulate`). `evaluated` counts the plans
whose memory was costed, `feasible` those of them that fit.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from llmscale.config import (
    FLOAT8_RECIPES,
    LOOP_MULTI_CHUNK_SCHEDULES,
    OFFLOAD_MODES,
    PRECISIONS,
    V_SCHEDULES,
    Float8Recipe,
    Offload,
    PPSchedule,
    Precision,
    Recompute,
    float8_recipe_needs_fp8,
    microbatch_rule,
    offload_layout_problem,
)
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GiB
from llmscale.model.config import ModelConfig, auto_split_ok, stage_ids, stage_layer_counts
from llmscale.plan import memory as mem
from llmscale.plan import time as tm
from llmscale.plan.cache import memoize
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.stack import (
    LLMSCALE,
    Residency,
    Stack,
    activation_offload_problem,
    param_residency,
    tied_pipeline_problem,
)

MULTI_CHUNK = LOOP_MULTI_CHUNK_SCHEDULES + V_SCHEDULES  # schedules that need pp > 1

# Least recompute time first (the search skips a mode once a faster one fits). selective_op
# and every_k (k = 2) are not ordered: op-level SAC recomputes half the matmuls and the
# element-wise ops of every block, every_k half the blocks whole, and under tensor parallelism
# op-level SAC also runs every block's all-gathers (or, without sequence parallelism, its
# all-reduces) again. Llama 2 70B, t8 p4 dp_shard 2 on H100, mbs 2, seq 4096: with sequence
# parallelism 5.66 s against 5.77 s, without it 6.69 s against 6.45 s (`RECOMPUTE_LEVEL`: a fit
# of one does not skip the other).
RECOMPUTE_ORDER: tuple[Recompute, ...] = (
    "none",
    "selective",
    "selective_op",
    "every_k",
    "full",
)


# A fit of a mode skips the modes of a higher level only.
RECOMPUTE_LEVEL: dict[str, int] = {
    "none": 0, "selective": 1, "selective_op": 2, "every_k": 2, "full": 3,
}  # fmt: skip


@dataclass(frozen=True)
class SearchSpace:
    """The options tried; each tuple lists the values the search may pick."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    recompute: tuple[Recompute, ...] = RECOMPUTE_ORDER
    recompute_every_k: int = 2
    schedules: tuple[PPSchedule, ...] = (
        "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev", "gpipe",
    )  # fmt: skip
    chunks: tuple[int, ...] = (2, 4)  # of the loop-style multi-chunk schedules; V ones run 2
    # Stages whose gathers and reduces are the same under the stack and pipeline are tried once
    # (`_zero_stages`): under a pipeline the llmscale stack's 1 and 2 are one layout.
    zero_stages: tuple[int, ...] = (3, 2, 1)
    # not "lsp": it changes the arithmetic (an approximation: the search would trade accuracy
    # for speed, which nothing else it tries does); it serves one process and dp, not tp/pp/cp
    offload: tuple[Offload, ...] = tuple(o for o in OFFLOAD_MODES if o != "lsp")
    sequence_parallel: tuple[bool, ...] = (False, True)
    data_parallel: tuple[str, ...] = ("shard", "replicate", "hybrid")  # hybrid: shard in-node
    # Fixed degrees (None: searched). A fixed dp_shard or dp_replicate sets the split directly.
    tp: int | None = None
    pp: int | None = None
    dp_shard: int | None = None
    dp_replicate: int | None = None
    # The context-parallel degree: None searches 1 and every power of two that divides the
    # GPUs and keeps at least `CP_MIN_TOKENS` tokens of each sequence per rank
    # (`context_degrees`). Fixed, never searched: an explicit layer split (pp x chunks entries;
    # () = the automatic split).
    cp: int | None = None
    pp_layers: tuple[int, ...] = ()
    # Blocks whose activations wait in host memory (pp 1, recompute none only:
    # `report.search_report` narrows the space to them when it is set); 0 with
    # `search_offload_activations`: the fewest that make a plan fit where it does not
    # (`_fewest_offloaded`), 0 without: none.
    offload_activations: int = 0
    search_offload_activations: bool = True

    def fixed_degrees(self) -> dict[str, int]:
        """The degrees this space fixes, by name."""
        names = ("tp", "pp", "dp_shard", "dp_replicate")
        out = {n: v for n in names if (v := getattr(self, n)) is not None}
        return out | ({"cp": self.cp} if self.cp is not None and self.cp > 1 else {})


DEFAULT_SPACE = SearchSpace()


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    memory: mem.MemoryEstimate
    time: tm.StepTime
    fits: bool = True
    why: str | None = None  # why it does not fit (None when it fits)
    # It fits, but not with the caching allocator's usual share over the allocated peak
    # (`mem.MemoryEstimate.tight`): the allocator will flush its cache to stay within memory.
    tight: bool = False


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Candidate, ...]  # best first
    evaluated: int  # plans whose memory was computed
    feasible: int  # of which fit
    seconds: float  # wall time of the search
    cluster: Cluster
    gpus: int
    space: SearchSpace = field(default=DEFAULT_SPACE)
    # When nothing fits: the plans closest to fitting (least memory first), each with its `why`.
    unfit: tuple[Candidate, ...] = ()
    # Why layouts were dropped before any memory was counted (divisibility, schedule rules).
    rejected: tuple[str, ...] = ()
    stack: Stack = LLMSCALE  # whose software the plans were costed as

    @property
    def shown(self) -> tuple[Candidate, ...]:
        """What to show: the plans that fit, or else the closest that do not (flagged)."""
        return self.candidates or self.unfit

    def why_none(self) -> str | None:
        """Why no plan fits, in one line (None when some plan fits)."""
        if self.candidates:
            return None
        if self.unfit:
            return (
                f"no plan fits in memory: the closest {self.unfit[0].why}; try more GPUs, "
                "a smaller global batch or a shorter sequence"
            )
        if not self.rejected:
            return f"no layout of {self.gpus} GPUs to try"
        shown = "; ".join(self.rejected[:4])
        more = f" (and {len(self.rejected) - 4} more)" if len(self.rejected) > 4 else ""
        return f"no valid layout of {self.gpus} GPUs: {shown}{more}"


# The fewest tokens of a sequence a context-parallel rank keeps in the search (a --cp given is
# never bounded): every published context-parallel run keeps at least 4,096 (NeMo 24.07's
# Llama 3 8B and 70B and Megatron-Bridge's Llama 3.1 405B run cp 2 at 8,192; Llama 3's 405B
# cp 16 at 131,072 keeps 8,192; NeMo's long-context Llama 2 7B cp 32 at 1M keeps 32,768:
# validation/data/runs.toml). Below it the ring's blocks are small and its transfers many
# for the work they carry.
CP_MIN_TOKENS = 4096


def context_degrees(gpus: int, seq_len: int) -> tuple[int, ...]:
    """The context-parallel degrees the search tries when --cp is not given: 1 and each power
    of two that divides the GPUs, splits the sequence into 2 cp equal chunks (the
    load-balanced ring's rule) and keeps at least `CP_MIN_TOKENS` tokens per rank."""
    out = [1]
    cp = 2
    while gpus % cp == 0 and seq_len % (2 * cp) == 0 and seq_len // cp >= CP_MIN_TOKENS:
        out.append(cp)
        cp *= 2
    return tuple(out)


def cp_dominated(cp: int, mbs: int, cps: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """Whether cp `cp` at micro-batch size `mbs` is dominated by a setting the search also
    tries: with g = gcd(cp, mbs) > 1, cp / g at micro-batch size mbs / g (dp x g) runs the
    same tokens per rank in each micro-batch (mbs x seq / cp), the same micro-batches, the same
    GEMMs and the same attention work per rank (mbs x s^2 / 2cp), with g-fold fewer ring
    steps to pass keys and values over; no faster, no lighter (tests/plan/test_search.py). So
    a searched cp > 1 runs the micro-batch sizes prime to it: 1 for the powers of two
    (`context_degrees`), as every published context-parallel run does."""
    g = math.gcd(cp, mbs)
    return g > 1 and cp // g in cps and mbs // g in sizes


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _dp_splits(
    dp: int, tp: int, cp: int, cluster: Cluster, space: SearchSpace
) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) pairs to try."""
    rep, shard = space.dp_replicate, space.dp_shard
    if rep is not None or shard is not None:
        if rep is None:
            rep = dp // shard if shard and dp % shard == 0 else 0
        if shard is None:
            shard = dp // rep if rep and dp % rep == 0 else 0
        return [(rep, shard)] if rep * shard == dp else []
    out: list[tuple[int, int]] = []
    if "shard" in space.data_parallel and dp > 1:
        out.append((1, dp))
    if "replicate" in space.data_parallel or dp == 1:
        out.append((dp, 1))
    in_node = cluster.gpus_per_node // (tp * cp)  # the mesh: dp_shard x cp x tp in-node
    if "hybrid" in space.data_parallel and 1 < in_node < dp and dp % in_node == 0:
        out.append((dp // in_node, in_node))
    return out


def _layouts(
    model: ModelConfig,
    gpus: int,
    cp: int,
    cluster: Cluster,
    space: SearchSpace,
    rejected: dict[str, None],
    stack: Stack = LLMSCALE,
) -> Iterator[tuple[int, int, int]]:
    """(tp, pp, dp) layouts of `gpus` (cp x tp x pp x dp = gpus); why others were dropped goes
    into `rejected` (in order). A pp that does not divide n_layers splits them unevenly."""
    gpn = cluster.gpus_per_node
    if gpus % cp:
        rejected[f"cp {cp} does not divide {gpus} GPUs"] = None
        return
    rest = gpus // cp  # the GPUs of one context-parallel rank's layouts
    tps = [space.tp] if space.tp is not None else _divisors(min(rest, gpn))
    for tp in tps:
        why = _tp_rule(model, rest, gpn, tp, stack)
        if why:
            rejected[why + (f" (after cp {cp})" if cp > 1 else "")] = None
            continue
        if space.pp is not None:
            pps = [space.pp]
        else:  # any degree dividing the GPUs left, up to one layer per stage
            pps = _divisors(rest // tp)  # those above n_layers are rejected below
        for pp in pps:
            if (rest // tp) % pp:
                rejected[f"tp x pp = {tp} x {pp} does not divide {rest} GPUs"
                         + (f" (after cp {cp})" if cp > 1 else "")] = None  # fmt: skip
            elif not (space.pp_layers or auto_split_ok(model.n_layers, pp)):
                rejected[f"pp {pp} > n_layers {model.n_layers}"] = None
            elif space.pp_layers and len(space.pp_layers) % pp:
                rejected[f"pp {pp} does not divide the {len(space.pp_layers)} pp_layers"] = None
            elif space.pp_layers and pp == 1 and len(space.pp_layers) > 1:
                why = f"not the {len(space.pp_layers)} of pp_layers"
                rejected[f"pp 1 runs one stage (chunks need pp > 1), {why}"] = None
            elif tied := tied_pipeline_problem(stack, model.tie_embeddings, pp):
                rejected[f"pp {pp}: {tied} ({model.name})"] = None
            elif pp == 1 and len(space.schedules) == 1 and space.schedules[0] in MULTI_CHUNK:
                rejected[f"{space.schedules[0]} needs pp > 1"] = None
            else:
                yield tp, pp, rest // (tp * pp)


def _tp_rule(
    model: ModelConfig, gpus: int, gpus_per_node: int, tp: int, stack: Stack = LLMSCALE
) -> str | None:
    """Why tensor-parallel degree `tp` cannot run (None when it can). A stack that always
    splits the vocabulary pads it to a multiple of tp (Megatron's make-vocab-size-divisible-by);
    the runtime splits it only untied, and then tp must divide it."""
    if gpus % tp:
        return f"tp {tp} does not divide {gpus} GPUs"
    if tp > gpus_per_node:
        return f"tp {tp} > {gpus_per_node} GPUs per node"
    split = not model.tie_embeddings and stack.kernels.vocab_parallel is None
    names = ("n_heads", "n_kv_heads", "ffn_dim") + (("vocab_size",) if split else ())
    for name in names:  # the vocabulary is split too unless tied (the runtime's rule)
        if getattr(model, name) % tp:
            return f"tp {tp} does not divide {name} {getattr(model, name)}"
    return None


# Schedules never faster nor lighter than another that runs the same micro-batches: tried only
# where that one cannot run or is not searched. GPipe takes 1F1B's time with the same knobs (the
# closed form's bubble is the same; the simulator agrees to rounding) and holds all m
# micro-batches' activations and logits where 1F1B holds at most pp - rank <= m (1F1B needs
# m >= pp); their states, buffers and transients are the same (tests/plan/test_search_speed.py).
DOMINATED_BY: dict[str, str] = {"gpipe": "1f1b"}


def _schedules(
    model: ModelConfig, pp: int, microbatches: int, space: SearchSpace
) -> Iterator[tuple[PPSchedule, int]]:
    if pp == 1:
        # One stage runs every schedule alike: keep a fixed schedule's name, else 1f1b.
        yield (space.schedules[0] if len(space.schedules) == 1 else "1f1b"), 1
        return
    runs = [s for s in space.schedules if microbatch_rule(s, pp, microbatches) is None]
    for s in runs:  # (`microbatch_rule`: config's rule, the runtime's)
        if DOMINATED_BY.get(s) in runs:
            continue
        if s in LOOP_MULTI_CHUNK_SCHEDULES:
            # Chunk counts that split the layers evenly when there are any (an uneven chunk
            # paces every rank's pass, and costing one means costing every rank); else the
            # uneven ones (126 layers over pp 16: no even split, so 4s and 3s).
            ok = [v for v in space.chunks if _stages_ok(model, pp * v, space)]
            even = [v for v in ok if space.pp_layers or model.n_layers % (pp * v) == 0]
            yield from ((s, v) for v in (even or ok))
        elif s in V_SCHEDULES:
            if _stages_ok(model, 2 * pp, space):
                yield s, 2
        elif _stages_ok(model, pp, space):
            yield s, 1


def _stages_ok(model: ModelConfig, stages: int, space: SearchSpace) -> bool:
    """Can the layers split into `stages` (an explicit split must have that many entries)?
    Layers that do not divide split unevenly (`model.config.stage_layer_counts`), for every
    schedule: 126 layers over pp 16 x 2 chunks are 30 stages of 4 and 2 of 3."""
    if space.pp_layers:
        return len(space.pp_layers) == stages
    return auto_split_ok(model.n_layers, stages)


@memoize
def _costed_ranks(
    model: ModelConfig, pp: int, space: SearchSpace, chunks: int = 1, v_shape: bool = False
) -> tuple[int, ...]:
    """The pipeline ranks the search costs: the first and last (embedding, head; rank 0 holds
    the most micro-batches in flight) and, split unevenly, the first rank with the most layers
    (the pace of the pipeline), and the second rank with uneven chunks; every rank for an
    explicit split."""
    if pp == 1:
        return (0,)
    if space.pp_layers:
        return tuple(range(pp))
    if model.n_layers % (pp * chunks) == 0:
        return (0, pp - 1)
    counts = stage_layer_counts(model.n_layers, pp * chunks)
    per_rank = [sum(counts[g] for g in stage_ids(r, pp, chunks, v_shape)) for r in range(pp)]
    # Uneven chunks: the second rank too (the most in flight after the first); the shown plans
    # are checked on every rank (`search`).
    second = (1,) if chunks > 1 else ()
    return tuple(sorted({0, *second, per_rank.index(max(per_rank)), pp - 1}))


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
    float8_recipe: Float8Recipe = "tensorwise",
) -> SearchResult:
    """The `top` fastest plans that fit, best first. When none fits, `candidates` is empty and
    `unfit` holds the `top` closest to fitting (each with why not), `rejected` why layouts were
    dropped before their memory was counted. `float8_recipe`: the stack's, under fp8."""
    _check_inputs(model, gpus, seq_len, global_batch_size, precision, top)
    if float8_recipe not in FLOAT8_RECIPES:
        raise ConfigError("float8_recipe", float8_recipe, " | ".join(FLOAT8_RECIPES))
    needs = float8_recipe_needs_fp8(precision, float8_recipe, "precision")
    if needs:
        raise ConfigError("float8_recipe", float8_recipe, needs)
    tm.check_matmul_precision(precision, cluster, float8_recipe)
    start = time.perf_counter()
    # Totals (allocated x `over`) within `room`, the usable memory, fit with the caching
    # allocator's share; within `budget` the allocated peak fits, which is what fits
    # (`mem.MemoryEstimate.fits`): past `room` a plan fits tightly, ranked after every plan
    # that fits with room and not among those that prune the search (`kept`), nor does it
    # stop the search trying the slower, more frugal settings of its layout.
    over = 1.0 + memory_options.allocator_overhead
    room = mem.usable_bytes(cluster.gpu, memory_options)
    budget = room * over
    host_per_gpu = cluster.node.host_memory_bytes / cluster.gpus_per_node
    found: list[tuple[bool, float, float, Plan]] = []  # (tight, seconds, total, plan)
    evaluated = 0
    # The least `keep` step times found so far, negated (a heap whose top is the largest), and
    # the fitting plans not timed because their floor is past them (`PRUNE_BY_TIME_FLOOR`).
    keep = max(top, resimulate)
    kept: list[float] = []
    untimed = 0
    rejected: dict[str, None] = {}
    # Each memory-checked layout, once, with the offloads it can run.
    settings: list[tuple[Plan, tuple[int, ...], list[Offload]]] = []
    recs = [r for r in RECOMPUTE_ORDER if r in space.recompute]
    if "every_k" in recs and space.recompute_every_k > model.n_layers:
        recs.remove("every_k")
        rejected[f"every_k {space.recompute_every_k} > n_layers {model.n_layers}"] = None
    levels = [RECOMPUTE_LEVEL[r] for r in recs]
    offloads = [o for o in OFFLOAD_MODES if o in space.offload]
    stack = time_params.stack
    if space.cp is not None:
        cps: tuple[int, ...] = (space.cp,)
    elif stack.context_parallel:
        cps = context_degrees(gpus, seq_len)
    else:
        cps = (1,)

    def layouts() -> Iterator[tuple[int, list[Offload], int, int, int]]:
        """Each context-parallel degree, the offloads it can run, and its (tp, pp, dp)
        layouts; a degree that cannot run says why in `rejected`."""
        for cp in cps:
            if cp > 1 and seq_len % (2 * cp):  # load-balanced ring attention's rule
                rejected[f"seq_len {seq_len} is not a multiple of 2 x cp = {2 * cp}"] = None
                continue
            problems = {o: offload_layout_problem(o, cp, 1, False) for o in offloads}
            for why in dict.fromkeys(p for p in problems.values() if p):
                rejected[f"offload with cp {cp}: {why}"] = None
            ok = [o for o in offloads if not problems[o]]
            for tp, pp, dp in _layouts(model, gpus, cp, cluster, space, rejected, stack):
                yield cp, ok, tp, pp, dp

    def slower_than_kept(plan: Plan, ends: tuple[int, ...]) -> bool:
        """Whether `plan`'s step-time floor is past the `keep` fastest plans found so far."""
        return (
            len(kept) == keep and PRUNE_BY_TIME_FLOOR
            and tm.step_time_floor(plan, cluster, time_params, ends, past=-kept[0]) > -kept[0]
        )  # fmt: skip

    # Plans that fit only tightly, timed at the end, and only where fewer than `keep` plans fit
    # with room (they rank after every one of those): (total, plan, costed ranks).
    tight_plans: list[tuple[float, Plan, tuple[int, ...]]] = []

    def cost(plan: Plan, total: float, ends: tuple[int, ...]) -> bool:
        """Time a plan that fits and keep it; False (left untimed) when it cannot be among the
        `keep` fastest."""
        if total > room:
            tight_plans.append((total, plan, ends))
            return True
        if slower_than_kept(plan, ends):
            return False
        t = tm.estimate_step_time(plan, cluster, time_params, ranks=ends, validate=False)
        found.append((False, t.seconds, total, plan))
        if len(kept) < keep:
            heapq.heappush(kept, -t.seconds)
        elif t.seconds < -kept[0]:
            heapq.heapreplace(kept, -t.seconds)
        return True

    # Activation offload (train.offload_activations), searched where no count is fixed: a plan
    # without a pipeline or recomputation that does not fit is tried with the fewest first
    # blocks whose activations wait in host memory that make it fit (`_fewest_offloaded`).
    offload_acts = (
        space.offload_activations == 0
        and space.search_offload_activations
        and "none" in recs
        and model.n_layers > 1
        and activation_offload_problem(time_params.stack, 1) is None
    )
    for cp, cp_offloads, tp, pp, dp in layouts():
        # Each rank's activity by (sp, mbs, schedule, chunks), then (recompute, lowp weights,
        # rank), for every dp split of this layout (`_Floors`).
        layout_activity: dict[tuple[bool, int, str, int], dict[tuple[int, bool, int], mem.Activity]] = {}  # fmt: skip
        ends = _costed_ranks(model, pp, space)
        try_offload = offload_acts and pp == 1  # activation offload: no pipeline
        # The runtime's offload rule per layout (a tied model's last-stage copy under pp).
        pp_offloads = []
        for o in cp_offloads:
            if refusal := offload_layout_problem(o, cp, pp, model.tie_embeddings):
                rejected[f"offload {o} with pp {pp}: {refusal}"] = None
            else:
                pp_offloads.append(o)
        splits = _dp_splits(dp, tp, cp, cluster, space)
        if not splits:
            fixed = ", ".join(f"{k} {v}" for k, v in space.fixed_degrees().items() if "dp" in k)
            rejected[f"dp {dp} (tp {tp}, pp {pp}) is not {fixed or 'split'}"] = None
        for dp_rep, dp_shard in splits:
            # Each rank's states by (mbs, schedule, chunks), then (ZeRO stage, offload, rank),
            # for both sequence-parallel settings (`_Floors`).
            split_states: dict[tuple[int, str, int], dict[tuple[int, int, int], mem.RankPieces]] = {}  # fmt: skip
            zeros = _zero_stages(dp_shard, space, pp, time_params.stack)
            if not zeros:
                rejected[f"zero_stage 0 with dp_shard {dp_shard} > 1"] = None
                continue
            base = Plan(
                model=model, seq_len=seq_len, micro_batch_size=1,
                global_batch_size=global_batch_size, precision=precision,
                float8_recipe=float8_recipe, dp_replicate=dp_rep, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp,
                pp_layers=space.pp_layers, recompute_every_k=space.recompute_every_k,
                offload_activations=space.offload_activations,
            )  # fmt: skip
            # Whether each offload runs the forward on low-precision weights (`_Floors`).
            lowp = [base.varied(offload=o).lowp_weights for o in pp_offloads]
            # Knob settings whose states alone fit, each as (zero index, offload index), per
            # placement of the layers (chunks, and a V or not: which layers a rank holds, and
            # whether the head shares rank 0 with the embedding).
            placed: dict[tuple[int, bool], list[tuple[int, int]]] = {}
            sps = [sp for sp in space.sequence_parallel if tp > 1 or not sp]
            if not sps:
                rejected["sequence parallelism needs tp > 1"] = None
            for sp in sps:
                divides = False
                for mbs in space.micro_batch_sizes:
                    if global_batch_size % (mbs * dp):
                        continue
                    divides = True
                    if cp_dominated(cp, mbs, cps, space.micro_batch_sizes):
                        continue
                    micro = global_batch_size // (mbs * dp)
                    scheds = list(_schedules(model, pp, micro, space))
                    if not scheds:
                        rejected[_schedule_rule(model, pp, micro, space)] = None
                        continue
                    if not found and recs and pp_offloads:  # for `unfit`, while nothing fits
                        frugal = replace(base, micro_batch_size=mbs, recompute=recs[-1],
                                         zero_stage=zeros[-1], sequence_parallel=sp)  # fmt: skip
                        for sched, v in scheds:
                            ends = _costed_ranks(model, pp, space, v, sched in V_SCHEDULES)
                            settings.append(
                                (replace(frugal, pp_schedule=sched, pp_chunks=v), ends, pp_offloads)
                            )
                    fit_any = False
                    useful = _useful_recomputes(
                        recs, base.varied(micro_batch_size=mbs, sequence_parallel=sp),
                        memory_options,
                    )  # fmt: skip
                    for sched, v in scheds:
                        where = (v, sched in V_SCHEDULES)
                        ends = _costed_ranks(model, pp, space, v, where[1])
                        if where not in placed:
                            placed[where] = _fitting_states(
                                base.varied(pp_schedule=sched, pp_chunks=v), zeros, pp_offloads,
                                ends, memory_options, budget / over, host_per_gpu,
                            )  # fmt: skip
                        # The knobs below vary this plan's recompute, ZeRO stage and offload.
                        knobs = base.varied(
                            micro_batch_size=mbs, pp_schedule=sched, pp_chunks=v,
                            sequence_parallel=sp,
                        )  # fmt: skip
                        floors = _Floors(
                            knobs, recs, zeros, pp_offloads, ends, memory_options, budget,
                            split_states.setdefault((mbs, sched, v), {}),
                            layout_activity.setdefault((sp, mbs, sched, v), {}), lowp,
                        )  # fmt: skip
                        # Time grows with each knob (recompute level, ZeRO stage, offload level)
                        # and memory shrinks: skip a setting once one at least as fast fits; and
                        # skip the rest, uncosted, once the floor of the fastest left is past
                        # the plans kept (`_slower_than`, tested at the first setting whose
                        # memory floor fits: counted as maybe fitting, so larger micro-batches
                        # are still tried).
                        fits: list[tuple[int, int, int]] = []  # with room
                        tight = False  # some setting fits only tightly
                        # recompute none, over `room` (with its total): `offload_acts`
                        offloaded: list[tuple[Plan, float]] = []
                        checked = False
                        for ri, rec in enumerate(recs):
                            if rec not in useful:
                                continue
                            for zi, oi in placed[where]:
                                if fits and any(
                                    (f[0] == ri or levels[f[0]] < levels[ri])
                                    and f[1] <= zi and f[2] <= oi
                                    for f in fits
                                ):  # fmt: skip
                                    continue
                                evaluated += 1
                                floor = floors.pieces(ri, zi, oi)
                                if floor is None:  # as worst_total would find, without the plan
                                    if try_offload and rec == "none":
                                        offloaded.append((floors.plan(ri, zi, oi), math.inf))
                                    continue
                                if not checked and len(kept) == keep and PRUNE_BY_TIME_FLOOR:
                                    checked = True
                                    if _slower_than(
                                        -kept[0], floors, ri, levels, useful, placed[where],
                                        cluster, time_params,
                                    ):  # fmt: skip
                                        fit_any = True
                                        break
                                plan = floors.plan(ri, zi, oi)
                                total = mem.worst_total(
                                    plan, memory_options, ends, budget, known=floor
                                )
                                if total > room and try_offload and rec == "none":
                                    offloaded.append((plan, total))
                                if total <= budget:
                                    if total <= room:
                                        fits.append((ri, zi, oi))
                                    tight = tight or total > room
                                    untimed += not cost(plan, total, ends)
                            else:
                                continue
                            break  # the rest of this knob loop is slower than those kept
                        fit_any = fit_any or bool(fits) or tight
                        for plan, total in offloaded:
                            # Offloading adds copies to the plan's time: its floor bounds it.
                            if slower_than_kept(plan, ends):
                                continue
                            # The fewest blocks offloaded that fit with room, else (the plan
                            # not fitting at all without) that fit tightly.
                            hit = _fewest_offloaded(plan, ends, memory_options, room, host_per_gpu)
                            if hit is None and total > budget:
                                hit = _fewest_offloaded(
                                    plan, ends, memory_options, budget, host_per_gpu
                                )  # fmt: skip
                            if hit is not None:
                                fit_any = True
                                untimed += not cost(*hit, ends)
                    if not fit_any:
                        break  # a bigger micro-batch needs more memory still
                if not divides:
                    mbs_text = ", ".join(map(str, space.micro_batch_sizes))
                    rejected[f"global batch {global_batch_size} is not a multiple of dp {dp} "
                             f"x micro-batch ({mbs_text})"] = None  # fmt: skip
    if len(found) < keep or not PRUNE_BY_TIME_FLOOR:
        for total, plan, ends in tight_plans:
            t = tm.estimate_step_time(plan, cluster, time_params, ranks=ends, validate=False)
            found.append((True, t.seconds, total, plan))
    else:
        untimed += len(tight_plans)
    feasible = len(found) + untimed
    found.sort(key=lambda x: x[:3])
    finals: list[Candidate] = []
    for _, _, _, plan in found[:keep]:
        full_mem = mem.estimate_memory(plan, memory_options, validate=False)
        if full_mem.total > budget:  # a rank the search did not cost is fuller
            feasible -= 1
            continue
        t = tm.estimate_step_time(
            plan, cluster, time_params, simulate=simulated(plan), validate=False
        )
        finals.append(Candidate(plan, full_mem, t, tight=full_mem.tight(cluster.gpu)))
    finals.sort(key=lambda c: (c.tight, c.time.seconds, c.memory.total))
    unfit: tuple[Candidate, ...] = ()
    if not finals and settings:
        unfit = _closest(settings, top, cluster, memory_options, time_params)
    return SearchResult(
        candidates=tuple(finals[:top]),
        evaluated=evaluated,
        feasible=feasible,
        seconds=time.perf_counter() - start,
        cluster=cluster,
        gpus=gpus,
        space=space,
        unfit=unfit,
        rejected=tuple(rejected),
        stack=time_params.stack,
    )


# Fitting plans whose step-time floor (`tm.step_time_floor`: the stage times alone) is past the
# `max(top, resimulate)` fastest found so far are counted, not timed in full: a plan slower than
# those is never shown nor re-timed (tests/plan/test_search_speed.py searches with it off).
PRUNE_BY_TIME_FLOOR = True

# Pipeline ops (stages x micro-batches) up to which a shown plan's step is re-timed with the
# simulator; above it the closed form (exact for equal stage costs) keeps a search of thousands
# of GPUs under a second (pp 32 x 256 micro-batches x 2 chunks takes ~0.6 s to simulate).
SIMULATE_MAX_OPS = 4096


def simulated(plan: Plan) -> bool:
    """Is `plan`'s step re-timed with the pipeline simulator (pp > 1, not too many ops)?"""
    return plan.pp > 1 and plan.pp * plan.chunks * plan.n_microbatches <= SIMULATE_MAX_OPS


# A recompute mode whose block keeps within this share of what a faster mode's keeps is not
# costed (selective under flash attention: the attention core it recomputes was never saved).
USELESS_RECOMPUTE_SAVING = 0.01


def _useful_recomputes(recs: list[Recompute], plan: Plan, opt: mem.MemoryOptions) -> set[str]:
    """The recompute modes of `recs` (fastest first) worth costing for `plan`'s micro-batch:
    those whose block saves more than `USELESS_RECOMPUTE_SAVING` less than every faster mode's
    (every_k, which mixes blocks, always)."""
    out: set[str] = set()
    least: float | None = None
    for rec in recs:
        if rec == "every_k":
            out.add(rec)
            continue
        kept = mem.block_bytes(plan, rec, opt.kernels)  # reads the micro-batch, not the mode
        if least is None or kept < (1 - USELESS_RECOMPUTE_SAVING) * least:
            out.add(rec)
            least = kept
    return out


def _zero_stages(dp_shard: int, space: SearchSpace, pp: int, stack: Stack) -> list[int]:
    """ZeRO stages to try, fewest gathers (1) first; stage 0 only without FSDP shards; of the
    stages `stack` runs alike at this pipeline depth (`param_residency`, accumulating), the
    lowest only."""
    if dp_shard > 1:
        out: dict[Residency, int] = {}
        for z in sorted(z for z in space.zero_stages if z != 0):
            out.setdefault(param_residency(stack, zero_stage=z, pp=pp, n_microbatches=2), z)
        return list(out.values())
    # Without shards the stage changes nothing: keep a fixed one's name, else 3.
    return [space.zero_stages[0]] if len(space.zero_stages) == 1 else [3]


def _schedule_rule(model: ModelConfig, pp: int, micro: int, space: SearchSpace) -> str:
    """Why no schedule in `space` runs `micro` micro-batches on `pp` stages."""
    reasons = []
    for s in space.schedules:
        rule = microbatch_rule(s, pp, micro)
        if rule is not None:
            reasons.append(f"{s}: {micro} micro-batches, needs {rule.split(' for ')[0]}")
        else:
            per_rank = (
                "2" if s in V_SCHEDULES
                else "/".join(map(str, space.chunks)) if s in LOOP_MULTI_CHUNK_SCHEDULES
                else "1"
            )  # fmt: skip
            reasons.append(f"{s}: pp x {per_rank} stages do not split n_layers {model.n_layers}")
    return f"pp {pp}: " + "; ".join(reasons)


def fit_reason(
    est: mem.MemoryEstimate, cluster: Cluster, opt: mem.MemoryOptions = mem.DEFAULT_OPTIONS
) -> str | None:
    """Why a plan's memory does not fit `cluster` (None when it fits)."""
    usable = mem.usable_bytes(cluster.gpu, opt)
    host = cluster.node.host_memory_bytes / cluster.gpus_per_node
    w = est.worst
    reasons = []
    if w.allocated > usable:
        reasons.append(
            f"needs {w.allocated / GiB:.1f} GiB allocated on pipeline rank {w.pp_rank}, "
            f"{usable / GiB:.1f} GiB usable ({cluster.gpu.name} less "
            f"{opt.device_reserve_GiB:g} GiB reserve)"
        )
    h = max(est.per_rank, key=lambda s: s.host)
    if h.host > host:
        reasons.append(
            f"needs {h.host / GiB:.1f} GiB of host memory per GPU on pipeline rank {h.pp_rank}, "
            f"{host / GiB:.1f} GiB available ({cluster.node.name})"
        )
    return "; ".join(reasons) or None


def tight_note(est: mem.MemoryEstimate, cluster: Cluster) -> str | None:
    """What a plan that fits only without the caching allocator's share means (None when it
    fits with it, or does not fit)."""
    if not est.tight(cluster.gpu):
        return None
    opt, w = est.options, est.worst
    usable = mem.usable_bytes(cluster.gpu, opt)
    return (
        f"tight: {w.allocated / GiB:.1f} GiB allocated on pipeline rank {w.pp_rank} of "
        f"{usable / GiB:.1f} usable, {w.total / GiB:.1f} with the caching allocator's usual "
        f"{100 * opt.allocator_overhead:g}%: it will free its cache and retry when short (a "
        "device synchronisation each, counted by torch.cuda.memory_stats()['num_alloc_retries']); "
        "fragments it cannot free may still run it out (PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True avoids most)"
    )


def _closest(
    settings: list[tuple[Plan, tuple[int, ...], list[Offload]]],
    top: int,
    cluster: Cluster,
    opt: mem.MemoryOptions,
    time_params: tm.TimeParams,
) -> tuple[Candidate, ...]:
    """The `top` plans nearest to fitting: each layout with its most frugal knobs (the most
    recompute and the highest ZeRO stage searched), the offload that leaves the least memory
    over, least over first."""
    gpu_budget = mem.usable_bytes(cluster.gpu, opt)
    host_budget = cluster.node.host_memory_bytes / cluster.gpus_per_node
    scored: list[tuple[float, Plan]] = []
    for frugal, ends, offloads in settings:
        best: tuple[float, Plan] | None = None
        for off in offloads:
            plan = replace(frugal, offload=off)
            allocated = mem.worst_total(plan, opt, ends) / (1 + opt.allocator_overhead)
            excess = max(0.0, allocated - gpu_budget)
            host = max(mem.rank_states(plan, r, opt).host for r in ends)
            excess += max(0.0, host - host_budget)
            if best is None or excess < best[0]:
                best = (excess, plan)
        if best is not None:
            scored.append(best)
    scored.sort(key=lambda x: x[0])
    out: list[Candidate] = []
    for _, plan in scored[:top]:
        est = mem.estimate_memory(plan, opt, validate=False)
        t = tm.estimate_step_time(
            plan, cluster, time_params, simulate=simulated(plan), validate=False
        )
        why = fit_reason(est, cluster, opt)
        out.append(Candidate(plan, est, t, fits=why is None, why=why))
    return tuple(out)


def _slower_than(
    bar: float,
    floors: _Floors,
    ri: int,
    levels: list[int],
    useful: set[str],
    placed: list[tuple[int, int]],
    cluster: Cluster,
    time_params: tm.TimeParams,
) -> bool:
    """Is every setting of `floors`' knob loop from recompute `ri` on slower than `bar`? The
    fastest left run `ri`'s recompute level (each mode of it from `ri` on, among `useful`) at
    the fewest ZeRO gathers `placed` holds; their step-time floors (`tm.step_time_floor`; one
    per low-precision-weights setting of `placed`'s offloads, the one field of offload the
    stage times read) past `bar` put every later setting's past it, time growing with each
    knob."""
    zi = min(z for z, _ in placed)
    by_lowp = {floors.lowp[oi]: oi for _, oi in placed}
    return all(
        tm.step_time_floor(
            floors.plan(rj, zi, oi), cluster, time_params, floors.ranks, past=bar
        ) > bar
        for rj, rec in enumerate(floors.recs)
        if rj >= ri and rec in useful and levels[rj] == levels[ri]
        for oi in by_lowp.values()
    )  # fmt: skip


class _Floors:
    """Whether some costed rank's memory without the split backwards' pending gradients
    (`mem.floor_pieces`, a lower bound: `mem.worst_total`'s first test) puts a plan of one
    layout over `limit`, the plan varied in recompute, ZeRO stage and offload (indices into
    `recs`, `zeros`, `offloads`). Its states are looked up once per (ZeRO stage, offload) and
    rank, its activity once per (recompute, low-precision weights) and rank, from the memos
    `worst_total` reads (`Plan.states_key` names no recompute, `Plan.activations_key` no ZeRO
    stage or offload but through `lowp_weights`); a plan is built only to look up a piece not
    seen yet. The search's inner loop: most plans it costs are over on the first rank.

    `states` and `activity` may be shared with the layout's other plans whose pieces are the
    same: the search shares states between the two sequence-parallel settings of a dp split
    (`Plan.states_key` names no `sequence_parallel`) and activity between the dp splits of a
    layout (`Plan.activations_key` names dp only as the micro-batch count and `lowp_weights`);
    tests/plan/test_search_speed.py checks both keys for that."""

    def __init__(
        self,
        knobs: Plan,
        recs: list[Recompute],
        zeros: list[int],
        offloads: list[Offload],
        ranks: tuple[int, ...],
        opt: mem.MemoryOptions,
        limit: float,
        states: dict[tuple[int, int, int], mem.RankPieces] | None = None,
        activity: dict[tuple[int, bool, int], mem.Activity] | None = None,
        lowp: list[bool] | None = None,
    ) -> None:
        self.knobs, self.recs, self.zeros, self.offloads = knobs, recs, zeros, offloads
        self.ranks, self.opt, self.limit = ranks, opt, limit
        self.over = 1 + opt.allocator_overhead
        # per offload, `lowp_weights` (the caller's, where it has them: they read the precision
        # and the dp and cp degrees, not the schedule or micro-batch)
        self.lowp = (
            [knobs.varied(offload=o).lowp_weights for o in offloads] if lowp is None else lowp
        )
        self.states = {} if states is None else states
        self.activity = {} if activity is None else activity

    def plan(self, ri: int, zi: int, oi: int) -> Plan:
        return self.knobs.varied(
            recompute=self.recs[ri], zero_stage=self.zeros[zi], offload=self.offloads[oi]
        )

    def pieces(self, ri: int, zi: int, oi: int) -> list[mem.RankPieces] | None:
        """Each rank's floor (`mem.floor_pieces`), or None when one is over the limit."""
        plan: Plan | None = None
        parts = []
        states, activities, lowp = self.states, self.activity, self.lowp[oi]
        over, limit, allocated = self.over, self.limit, mem.floor_allocated
        for r in self.ranks:
            st = states.get((zi, oi, r))
            if st is None:
                plan = plan or self.plan(ri, zi, oi)
                st = states[zi, oi, r] = mem.rank_states(plan, r, self.opt)
            key = (ri, lowp, r)
            activity = activities.get(key)
            if activity is None:
                plan = plan or self.plan(ri, zi, oi)
                activity = activities[key] = mem.rank_activity(plan, r, self.opt)
            if over * allocated(st, activity) > limit:
                return None
            parts.append((st, activity))
        return [mem.floor_pieces(st, activity) for st, activity in parts]


def _fitting_states(
    base: Plan,
    zeros: list[int],
    offloads: list[Offload],
    ends: tuple[int, ...],
    opt: mem.MemoryOptions,
    budget: float,
    host: float,
) -> list[tuple[int, int]]:
    """(zero index, offload index) of the settings whose states alone fit `base`'s layout."""
    return [
        (zi, oi)
        for zi, zero in enumerate(zeros)
        for oi, off in enumerate(offloads)
        if not _states_exceed(base.varied(zero_stage=zero, offload=off), ends, opt, budget, host)
    ]


def _fewest_offloaded(
    plan: Plan, ends: tuple[int, ...], opt: mem.MemoryOptions, budget: float, host: float
) -> tuple[Plan, float] | None:
    """`plan` (no pipeline, no recomputation, over `budget`) with the fewest first blocks whose
    saved activations wait in host memory (train.offload_activations; Megatron-Core's
    --cpu-offloading-num-layers) that fit the GPU and the node's host memory, and its memory;
    None when no count below the model's layers does. The GPU's memory falls and the copies
    grow with the count, so the fewest that fits is the fastest (found by bisection)."""

    def total(n: int) -> float:
        return mem.worst_total(plan.varied(offload_activations=n), opt, ends, budget)

    lo, hi = 1, plan.model.n_layers - 1
    hi_total = total(hi)  # the memory at `hi`, the fewest known to fit
    if hi_total > budget:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        mid_total = total(mid)
        if mid_total <= budget:
            hi, hi_total = mid, mid_total
        else:
            lo = mid + 1
    best = plan.varied(offload_activations=hi)
    if max(mem.rank_pieces(best, r, opt).host for r in ends) > host:
        return None  # more blocks offloaded need more host memory still
    return best, hi_total


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
        raise ConfigError("seq_len", seq_len, model.seq_len_allowed())
    if precision not in PRECISIONS:
        raise ConfigError("precision", precision, " | ".join(PRECISIONS))
