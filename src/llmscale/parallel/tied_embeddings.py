"""Tied embeddings under pipeline parallelism: the last stage's copy of the embedding.

One process (or pp = 1) ties the output projection to the token embedding: the head reads
`tok_embeddings.weight` and autograd sums both uses into one gradient. Under a pipeline the
first and the last stage are different modules, usually on different ranks, so the last stage
keeps a copy of the embedding as its own `output.weight` (Megatron's embedding group,
DeepSpeed's `TiedLayerSpec`):

- initialised from the embedding: `Transformer.initial_value` gives the copy the embedding's
  value (`model.config.value_name`), so both are bit-identical at init, under any layout;
- before each optimizer step, before the gradient norm, the two gradients are summed: one
  all-reduce of the local gradients (FSDP shards, whole tensors under TP, whose tied matrices
  are replicated) over the embedding group (`ParallelDims.embedding_group`: pp ranks 0 and
  pp - 1 at the same data, context and tensor coordinates). Both copies then hold the
  one-process gradient, take the same AdamW update from the same state, and stay
  bit-identical after every step;
- the gradient norm counts the tied weight once, as one process does: the copy's gradient is
  unscaled and clipped like every other, but left out of the norm (`copies`);
- checkpoints store one tensor: the copy's entries (weights and optimizer state) are saved and
  loaded under the embedding's names (`store_once`, `give_copies`), so a checkpoint of a tied
  pipelined run is the single-process one, and loads under any layout.

Under V placement (zbv, dualpipev) pp rank 0 holds the first and the last stage. There is then
one tensor and no communication (`model.config.tied_copy`): the last stage's `output.weight` is
the tied weight, and the first stage's embedding is a `SharedEmbedding` that reads it without
registering it (`share_tied_head`). It is registered on the last stage, not the first, because
a split backward's input and weight halves (zbv) look for the weights of a stage among its own
module's parameters, and the first stage's weight half is a whole backward that reaches every
leaf it read. Autograd sums both uses into its one gradient; the optimizer steps it once, the
norm counts it once, and the checkpoint stores it under the embedding's name (`store_once`).
Under FSDP2 or replicate the tensor belongs to the last stage's root unit alone (a parameter
cannot be in two units): the embedding gathers that unit before its lookup (`unshard`, a no-op
when gathered), the lookups' gradients accumulate into the unit's unsharded gradient with the
head's, and the last stage's gradient reduction is moved after the first stage's backward
(`pipeline.reduce_shared_tied_weight_last`), so the one reduce-scatter carries both uses.

Offloaded optimizers (gradients on the host) are refused with a tied pipeline (config.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from llmscale.model.config import EMBEDDING_WEIGHT, TIED_HEAD_WEIGHT
from llmscale.parallel.data_parallel import CollectiveCounter
from llmscale.parallel.dims import ParallelDims
from llmscale.parallel.grads import match_grad_placements_
from llmscale.tensors import local_tensor


class SharedEmbedding(nn.Module):
    """The first stage's token embedding in a V: a lookup in the last stage's head weight
    (`head.weight`, read at each call, so it follows the parameter through materialization,
    loads and FSDP2's swaps between sharded and gathered), which this module does not register.
    Where FSDP2 or replicate holds the last stage (`last`), its root unit is gathered first."""

    def __init__(self, head: nn.Linear, last: nn.Module) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not submodules: the weight is the last stage's
        self.__dict__["last"] = last

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__["head"].weight  # type: ignore[no-any-return]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        last = self.__dict__["last"]
        if isinstance(last, FSDPModule):
            last.unshard()  # the root unit only (not recursive); a no-op when gathered
        return F.embedding(tokens, self.weight)


def share_tied_head(parts: Sequence[nn.Module], ids: Sequence[int], n_stages: int) -> None:
    """Make the first stage's embedding read the last stage's head weight (both stages among
    `parts`, stage indices `ids`): one tensor for both."""
    first = parts[list(ids).index(0)]
    last = parts[list(ids).index(n_stages - 1)]
    assert first.tok_embeddings is not None and last.output is not None
    first.tok_embeddings = SharedEmbedding(cast(nn.Linear, last.output), last)


class TiedEmbeddings:
    """This rank's share of a tied embedding under a pipeline: the embedding (first stage), its
    copy (last stage), neither (a middle rank: nothing to do), or the one shared tensor (a V:
    `shared`, nothing to do either)."""

    def __init__(
        self,
        embedding: nn.Parameter | None,
        copy: nn.Parameter | None,
        group: dist.ProcessGroup | None,
        shared: bool = False,
        counter: CollectiveCounter | None = None,
    ) -> None:
        self.embedding = embedding
        self.copy = copy
        self.group = group
        self.shared = shared
        self.counter = counter  # counts the all-reduce (the metrics rows' grad_allreduces)

    @classmethod
    def find(
        cls,
        parts: Sequence[nn.Module],
        dims: ParallelDims,
        counter: CollectiveCounter | None = None,
    ) -> TiedEmbeddings:
        """The tied weights among this rank's model parts. A collective (the embedding group
        is made on first use): every rank calls it."""
        group = dims.embedding_group()
        embedding = copy = None
        shared = False
        for part in parts:
            named = dict(part.named_parameters())
            embedding = named.get(EMBEDDING_WEIGHT, embedding)
            copy = named.get(TIED_HEAD_WEIGHT, copy)
            shared = shared or isinstance(getattr(part, "tok_embeddings", None), SharedEmbedding)
        return cls(embedding, copy, group, shared, counter)

    @property
    def copies(self) -> list[nn.Parameter]:
        """Parameters whose gradient the norm leaves out (it counts the embedding's)."""
        return [self.copy] if self.copy is not None and not self.shared else []

    @torch.no_grad()
    def sum_grads_(self) -> None:
        """Both copies' gradients := their sum (before unscaling, norm and clipping)."""
        held = [p for p in (self.embedding, self.copy) if p is not None]
        if not held or self.shared:  # one tensor: autograd summed both uses
            return
        (param,) = held  # (both stages on one rank: a V, which shares one tensor)
        match_grad_placements_(held)
        if param.grad is None:  # (a stage that saw no micro-batch: nothing to add)
            param.grad = torch.zeros_like(param)
        grad = local_tensor(param.grad)
        if self.group is not None:
            # a + b on both ranks: the same bits on both (addition commutes exactly).
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
            if self.counter is not None:
                self.counter.all_reduced(grad)


def _embedding_key(key: str) -> str | None:
    """`key` (a model or flattened optimizer state-dict key) under the embedding's name when it
    belongs to the tied copy; else None."""
    if key == TIED_HEAD_WEIGHT:
        return EMBEDDING_WEIGHT
    for section in ("state.", "param_groups."):
        if key.startswith(section + TIED_HEAD_WEIGHT + "."):
            return section + EMBEDDING_WEIGHT + key[len(section + TIED_HEAD_WEIGHT) :]
    return None


def store_once(sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict (model, or flattened optimizer) with the tied copy's entries under the
    embedding's names, or dropped where this rank also holds the embedding (a V): what a
    checkpoint stores and what a load asks for (DCP then writes or reads one tensor)."""
    out: dict[str, Any] = {}
    for key, value in sd.items():
        renamed = _embedding_key(key)
        if renamed is None:
            out[key] = value
        elif renamed not in sd:
            out[renamed] = value
    return out


def give_copies(sd: dict[str, Any]) -> dict[str, Any]:
    """`sd` with the tied copy's entries added, valued as the embedding's (after a load: each
    model part then takes its own names)."""
    out = dict(sd)
    for key, value in sd.items():
        if key == EMBEDDING_WEIGHT:
            out[TIED_HEAD_WEIGHT] = value
        for section in ("state.", "param_groups."):
            prefix = section + EMBEDDING_WEIGHT + "."
            if key.startswith(prefix):
                out[section + TIED_HEAD_WEIGHT + "." + key[len(prefix) :]] = value
    return out
