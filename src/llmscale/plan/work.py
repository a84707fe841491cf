"""One micro-batch's work on one pipeline rank: the record the memory and the time model fold.

Both models need the same facts about a rank: which layers it runs and under which recompute
mode, how many tokens each sees, whether it holds the embedding or the head, what each block
saves for backward, and the GEMMs a block runs. `rank_work` derives them once per rank, and

- the memory model (plan/memory.py) folds them over the micro-batches the schedule keeps in
  flight (`RankWork.blocks_saved` x in-flight units, plus the embedding's and head's);
- the time model (plan/time.py) folds them over passes: the GEMMs of `linears` per block, the
  element-wise traffic through `block_saved`, a recompute per block of `modes["full"]`;
- the runtime's expected metrics (plan/predict.py) read `saved` as one micro-batch's bytes.

Parameters, gradients and optimizer states are not work: they are the rank's states
(`plan.memory.rank_states`, `plan.params.rank_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from llmscale.model.config import TP_STYLES, BlockMode, ModelConfig
from llmscale.plan import activations as act
from llmscale.plan.cache import Memo, memoize
from llmscale.plan.plan import Plan

__all__ = [
    "BlockLinear",
    "RankWork",
    "block_linears",
    "cp_share",
    "cp_tokens",
    "plan_kernels",
    "rank_work",
    "slice_args",
]


class BlockLinear(NamedTuple):
    """One of a block's linears on one tensor-parallel rank: its TP region (`TP_STYLES`'
    "attention" or "feed_forward"), whether it is column-parallel, and its GEMM (M, N, K)."""

    region: str
    colwise: bool
    mnk: tuple[int, int, int]


def cp_tokens(plan: Plan) -> int:
    """Tokens of one micro-batch on one context-parallel rank: b x s / cp (each rank holds s / cp
    of every sequence; load-balanced for causal masking, two chunks of s / 2cp)."""
    return plan.micro_batch_size * plan.seq_len // plan.cp


def block_linears(plan: Plan) -> list[BlockLinear]:
    """A block's linears in the order its forward runs them (`ModelConfig.block_matmuls`), each
    split as the runtime's TP plan splits it (`TP_STYLES`: column-parallel outputs, row-parallel
    inputs over tp); under context parallelism a rank's linears see its s / cp tokens."""
    return list(_block_linears(plan.model, cp_tokens(plan), plan.tp))


@memoize
def _block_linears(model: ModelConfig, tokens: int, tp: int) -> tuple[BlockLinear, ...]:
    # (memoized: a search builds thousands of RankWork records of a few shapes)
    out = []
    for name, fan_in, fan_out in model.block_matmuls():
        region = "attention" if name in ("wq", "wk", "wv", "wo") else "feed_forward"
        colwise = TP_STYLES[f"{region}.{name}"].style == "colwise"
        mnk = (tokens, fan_out // tp, fan_in) if colwise else (tokens, fan_out, fan_in // tp)
        out.append(BlockLinear(region, colwise, mnk))
    return tuple(out)


def cp_share(plan: Plan) -> float:
    """The share of each sequence's tokens (and of every per-token tensor) on one cp rank."""
    return 1.0 / plan.cp


def plan_kernels(plan: Plan, kernels: act.Kernels) -> act.Kernels:
    """The kernel facts as they apply to this plan (are its forward weights low precision?)."""
    return act.with_weights(kernels, plan.lowp_weights)


def slice_args(plan: Plan, kernels: act.Kernels) -> act.SliceArgs:
    """The arguments `act.block_tensors` and `act.head_tensors` take for one micro-batch of
    `plan` on one tensor-parallel rank (before a block's recompute mode)."""
    return (
        plan.model,
        plan.micro_batch_size,
        plan.seq_len,
        plan.precision,
        plan.tp,
        plan.sequence_parallel,
        plan_kernels(plan, kernels),
    )


@dataclass(frozen=True)
class RankWork:
    """One micro-batch on pipeline rank `rank` (all its model chunks), on one of its cp ranks.

    - layers, modes: the rank's global layer ids and how many of them run each block mode
      (none | selective | full);
    - tokens: b x s / cp, what each of its linears and element-wise kernels sees;
    - embedding, head: does it hold the embedding (rank 0) and the final norm, output and loss
      (`Plan.head_rank`: the last rank, or rank 0 in a V);
    - block_saved: bytes one block saves for backward under each of `modes` and under "none"
      (what a block's forward leaves behind, whatever is later dropped);
    - embedding_saved, head_saved: the token ids and the head's and loss's saved bytes (0 on a
      rank without them);
    - linears: one block's GEMMs (`block_linears`);
    - offloaded: how many of its blocks keep their saved activations in host memory between
      forward and backward (`Plan.offload_activations`: the model's first blocks; recompute
      none, so each saves `block_saved["none"]`).
    """

    rank: int
    layers: tuple[int, ...]
    modes: Mapping[BlockMode, int]
    tokens: int
    embedding: bool
    head: bool
    block_saved: Mapping[BlockMode, float]
    embedding_saved: float
    head_saved: float
    linears: tuple[BlockLinear, ...]
    offloaded: int = 0

    @property
    def n_blocks(self) -> int:
        return len(self.layers)

    @property
    def n_full(self) -> int:
        """Blocks recomputed whole in backward."""
        return self.modes.get("full", 0)

    @property
    def blocks_saved(self) -> float:
        """Bytes the rank's blocks save for one micro-batch."""
        return sum(n * self.block_saved[m] for m, n in self.modes.items())

    @property
    def host_saved(self) -> float:
        """Bytes of one micro-batch's saved activations its offloaded blocks move to the host
        (and back): off the device between their forward and their backward."""
        return self.offloaded * self.block_saved["none"]

    @property
    def saved(self) -> float:
        """Bytes one micro-batch leaves saved on the rank: blocks, embedding, head."""
        return self.blocks_saved + self.embedding_saved + self.head_saved

    @property
    def gemms(self) -> list[tuple[int, int, int]]:
        """(M, N, K) of one block's forward GEMMs."""
        return [lin.mnk for lin in self.linears]


_WORK: Memo[RankWork] = Memo("work.rank_work")


def rank_work(plan: Plan, rank: int, kernels: act.Kernels) -> RankWork:
    """`plan`'s pipeline `rank`, one micro-batch, under the stack's `kernels`; cached on what it
    reads (`Plan.blocks_key`: no schedule but where it places the layers)."""
    key = (*plan.blocks_key(), id(kernels), rank)
    return _WORK.get(key, lambda: _rank_work(plan, rank, kernels), (plan.model, kernels))


def _rank_work(plan: Plan, rank: int, kernels: act.Kernels) -> RankWork:
    layers = plan.rank_layers(rank)
    modes = plan.block_modes(layers)
    args = slice_args(plan, kernels)
    share = cp_share(plan)  # every per-token tensor: this cp rank's s / cp of each sequence
    kinds: set[BlockMode] = {*modes, "none"}
    saved = {m: share * act.block_bytes(*args, m) for m in kinds}
    embedding = rank == 0
    head = rank == plan.head_rank
    emb = sum(t.nbytes for t in act.embedding_tensors(plan.micro_batch_size, plan.seq_len))
    return RankWork(
        rank=rank,
        layers=tuple(layers),
        modes=dict(modes),
        tokens=cp_tokens(plan),
        embedding=embedding,
        head=head,
        block_saved=saved,
        embedding_saved=share * emb if embedding else 0.0,
        head_saved=share * act.head_bytes(*args) if head else 0.0,
        linears=tuple(block_linears(plan)),
        offloaded=sum(1 for i in layers if i < plan.offload_activations),
    )
