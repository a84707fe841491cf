"""Parameter elements one GPU holds: tensor-parallel slices, pipeline stages, FSDP shards.

Tensor parallelism is the runtime's plan, read from `model.config.TP_STYLES` (torchtitan's for
the Llama block): wq, wk, wv, w1, w3 column-wise (dim 0 of the [out, in] weight, and their
biases), wo and w2 row-wise (dim 1; their biases stay whole); norms are replicated. The
embedding and the output projection are replicated across tp unless `vocab_parallel` (then
split along the vocabulary, dim 0: `VOCAB_TP_STYLES`). Pipeline ranks hold the layers
`model.config.split_layers` gives them (uneven splits, automatic or `parallel.pp_layers`); a
tied model's last stage (pp > 1) also holds its copy of the embedding as the output projection,
except in a V, whose one tied tensor is counted with the embedding (`model.config.tied_copy`).
FSDP2 (`fully_shard`) shards every tensor along dim 0 and pads dim 0 up to a multiple of the
shard count, so a rank holds ceil(dim0 / n) rows; rank 0 always holds the full ceil, which is
what is reported (the largest rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmscale.model.config import (
    TIED_HEAD_WEIGHT,
    ModelConfig,
    split_layers,
    stage_ids,
    tied_copy,
    tp_split,
)
from llmscale.plan.cache import memoize


def tp_local_shape(
    name: str, shape: tuple[int, ...], tp: int, vocab_parallel: bool
) -> tuple[int, ...]:
    """The slice of one tensor that a tensor-parallel rank holds."""
    if tp == 1:
        return shape
    split = tp_split(name, vocab_parallel)
    dim = None if split is None else split.sharded_dim(name.rsplit(".", 1)[-1])
    if dim is None:
        return shape
    return tuple(n // tp if i == dim else n for i, n in enumerate(shape))


def shard_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of rank 0's FSDP shard (padded storage): ceil(dim0 / n) rows."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


@dataclass(frozen=True)
class Group:
    """A set of parameter tensors (one block, or the embedding, or the head) on one TP rank."""

    tensors: int
    numel: int  # TP-local, unsharded
    shard_numel: int  # rank 0's FSDP shard (padded)
    autocast_numel: int  # of which linear weights and biases: what autocast casts to bf16
    saved_cast_numel: int = 0  # of which weights: the casts autograd keeps (biases it does not)

    @staticmethod
    def of(
        shapes: list[tuple[str, tuple[int, ...]]], tp: int, dp_shard: int, vocab_parallel: bool
    ) -> Group:
        local = [(n, tp_local_shape(n, s, tp, vocab_parallel)) for n, s in shapes]
        linear = [
            (n, s)
            for n, s in local
            if ".attention." in n or ".feed_forward." in n or n == "output.weight"
        ]
        return Group(
            tensors=len(local),
            numel=sum(math.prod(s) for _, s in local),
            shard_numel=sum(shard_numel(s, dp_shard) for _, s in local),
            autocast_numel=sum(math.prod(s) for _, s in linear),
            saved_cast_numel=sum(math.prod(s) for n, s in linear if n.endswith(".weight")),
        )


@dataclass(frozen=True)
class RankParams:
    """What one pipeline rank owns: `blocks` identical blocks, and embedding / head if any.

    Totals are filled in by `make` (they are read in the search's inner loop).
    """

    blocks: int
    block: Group
    embedding: Group | None
    head: Group | None
    numel: int = 0
    shard_numel: int = 0
    tensors: int = 0
    autocast_numel: int = 0
    root_numel: int = 0

    @staticmethod
    def make(blocks: int, block: Group, embedding: Group | None, head: Group | None) -> RankParams:
        root = [g for g in (embedding, head) if g is not None]
        return RankParams(
            blocks,
            block,
            embedding,
            head,
            numel=blocks * block.numel + sum(g.numel for g in root),
            shard_numel=blocks * block.shard_numel + sum(g.shard_numel for g in root),
            tensors=blocks * block.tensors + sum(g.tensors for g in root),
            autocast_numel=blocks * block.autocast_numel + sum(g.autocast_numel for g in root),
            root_numel=sum(g.numel for g in root),
        )

    @property
    def root(self) -> tuple[Group, ...]:
        """Groups outside the blocks (FSDP2's root module: embedding, final norm, head)."""
        return tuple(g for g in (self.embedding, self.head) if g is not None)


@memoize
def rank_params(
    model: ModelConfig,
    tp: int,
    pp: int,
    rank: int,
    dp_shard: int = 1,
    vocab_parallel: bool = False,
    chunks: int = 1,
    pp_layers: tuple[int, ...] = (),
    v_shape: bool = False,
) -> RankParams:
    """Parameters of pipeline rank `rank` (embedding on rank 0, final norm and head on the last,
    or on rank 0 too when `v_shape` places the stages in a V), whose blocks are those of its
    `chunks` stages in the runtime's split (`pp_layers` per stage, or automatic); `dp_shard` is
    the FSDP shard count. `autocast_numel` is what autocast casts where it runs (unwrapped
    bf16/fp16: `Plan.lowp_weights` false); under FSDP2 or replicate param_dtype casts instead
    and the planner reads the whole `numel` (plan/memory.py)."""
    head_rank = 0 if v_shape else pp - 1
    emb = _group(model, "embedding", tp, dp_shard, vocab_parallel) if rank == 0 else None
    copy = tied_copy(model, pp, v_shape=v_shape)
    head = None
    if rank == head_rank and copy:
        # The last stage's copy of the tied embedding, its output projection: a tensor of its
        # own, with its own gradient and optimizer state (parallel/tied_embeddings.py).
        head_shapes = model.parameter_shapes()["head"]
        head_shapes = [*head_shapes, (TIED_HEAD_WEIGHT, (model.vocab_size, model.dim))]
        head = Group.of(head_shapes, tp, dp_shard, vocab_parallel)
    elif rank == head_rank:
        head = _group(model, "head", tp, dp_shard, vocab_parallel)
    if model.tie_embeddings and not copy and emb is not None:
        # pp = 1, or a V's rank 0: the tied head has no tensor of its own, but where autocast
        # runs it casts the shared weight for the head (the embedding's lookup reads it uncast).
        assert emb is not None and head is not None
        v, d = model.vocab_size, model.dim
        emb_cast = v * d // (tp if vocab_parallel else 1)
        emb = Group(
            emb.tensors,
            emb.numel,
            emb.shard_numel,
            emb.autocast_numel + emb_cast,
            emb.saved_cast_numel + emb_cast,
        )
    block = _group(model, "block", tp, dp_shard, vocab_parallel)
    split = split_layers(model.n_layers, pp * chunks, pp_layers)
    blocks = sum(len(split[s]) for s in stage_ids(rank, pp, chunks, v_shape))
    return RankParams.make(blocks, block, emb, head)


@memoize
def _group(model: ModelConfig, part: str, tp: int, dp_shard: int, vocab_parallel: bool) -> Group:
    """`Group.of` one part of `model.parameter_shapes()` (embedding, block, head), kept: the
    search asks `rank_params` for every pipeline rank and layout of the same groups."""
    return Group.of(model.parameter_shapes()[part], tp, dp_shard, vocab_parallel)
