"""Tensor parallelism (Megatron-style) and sequence parallelism, with DTensor plans.

Per block: wq, wk, wv and w1, w3 column-wise (each rank computes n_heads / tp heads and
ffn_dim / tp hidden units), wo and w2 row-wise (partial sums, reduced). The model's attention
reshapes with -1 heads, so the local q, k, v just have fewer heads.

Without sequence parallelism the block input is replicated over the TP group, the norms are
plain replicated modules and wo / w2 all-reduce. With it (Korthikanti et al. 2022) the residual
stream between blocks is sharded on the sequence dimension: the norms run on seq / tp tokens
(`SequenceParallel`), the input of attention and of the MLP is all-gathered, and wo / w2
reduce-scatter back to sequence shards.

Embeddings and output are vocabulary-parallel (the vocabulary, padded to a multiple of 8, splits
evenly): the embedding row-wise (each rank looks up its vocabulary range; a reduce gives the
sum), the output projection column-wise with its logits all-gathered before the loss, so the loss
code is the single-process one (no loss_parallel; it would avoid that gather). A model with tied
embeddings keeps both replicated instead (the tied matrix cannot be row- and column-split at
once); sequence parallelism then is not supported, nor with learned positions (the position
table is added to the embedding output, which would be sequence-sharded).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from llmscale.model.transformer import Transformer


def vocab_parallel(model: Transformer) -> bool:
    """Whether the embedding and output matrices are split over TP ranks."""
    return not model.cfg.tie_embeddings


def apply_tp(model: Transformer, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard `model` (a whole model or one pipeline stage of it) over `tp_mesh` in place."""
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    root: dict[str, Any] = {}
    if vocab_parallel(model):
        if model.tok_embeddings is not None:
            root["tok_embeddings"] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=stream
            )
        if model.output is not None:
            root["output"] = ColwiseParallel(
                input_layouts=stream, output_layouts=Replicate(), use_local_output=True
            )
    if sp and model.norm is not None:
        root["norm"] = SequenceParallel()
    if root:
        parallelize_module(model, tp_mesh, root)

    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sp:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    # x from the norm (sequence shards) is gathered; the RoPE table passes as is.
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None),
                        desired_input_layouts=(Replicate(), None),
                    ),
                    "ffn_norm": SequenceParallel(),
                    "feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        parallelize_module(block, tp_mesh, plan)
