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
sum), the output projection column-wise with its logits left split over the vocabulary (a
DTensor): the loss runs on the shards under torch's `loss_parallel` (`loss_context`), so the
full logits are never gathered. A model with tied embeddings keeps both replicated instead (the
tied matrix cannot be row- and column-split at once) and its logits are whole on every rank.

Sequence parallelism with learned positions or tied embeddings: the embedding's output is then
whole on every rank (all-reduced when vocabulary-parallel, so that the positions are added to
the whole sequence, as Megatron does) and the first block keeps its slice of the sequence; a
tied head all-gathers the final norm's output first (`model.config.sp_embedding_scatter`).

Which module is split how, and what sequence parallelism shards and gathers, is the torch-free
table in `model/config.py` (`TP_STYLES`, `VOCAB_TP_STYLES`, `SP_*`, `vocab_parallel`,
`loss_parallel`), which the planner reads too; this module only maps it to DTensor styles.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

from llmscale.model.config import (
    SP_GATHERED_INPUTS,
    SP_SHARDED_MODULES,
    TP_STYLES,
    VOCAB_TP_STYLES,
    ModelConfig,
    TPSplit,
    loss_parallel,
    sp_embedding_scatter,
    vocab_parallel,
)
from llmscale.model.transformer import FeedForward, Transformer


def _style(split: TPSplit, **kw: Any) -> Any:
    """The DTensor style for one entry of the shared table (model/config.py)."""
    return (ColwiseParallel if split.style == "colwise" else RowwiseParallel)(**kw)


def apply_tp(model: Transformer, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard `model` (a whole model or one pipeline stage of it) over `tp_mesh` in place."""
    sp = sequence_parallel
    tp = tp_mesh.size()
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    # Where the sequence is split under SP: by the embedding's reduce-scatter, or by the first
    # block taking its slice of a whole-sequence input (learned positions, tied embeddings).
    scatter_at_embedding = sp and sp_embedding_scatter(model.cfg, tp)
    root: dict[str, Any] = {}
    if vocab_parallel(model.cfg, tp):
        if model.tok_embeddings is not None:
            root["tok_embeddings"] = _style(
                VOCAB_TP_STYLES["tok_embeddings"],
                input_layouts=Replicate(),
                output_layouts=Shard(1) if scatter_at_embedding else Replicate(),
            )
        if model.output is not None:
            out = VOCAB_TP_STYLES["output"]
            sharded_loss = loss_parallel(model.cfg, tp)
            assert sharded_loss != out.gather_output
            root["output"] = _style(
                out,
                input_layouts=stream,
                output_layouts=Shard(-1) if sharded_loss else Replicate(),
                use_local_output=not sharded_loss,  # loss_parallel takes the DTensor
            )
    if sp and model.tok_embeddings is not None and not scatter_at_embedding and model.layers:
        first = next(iter(model.layers))
        root[f"layers.{first}"] = PrepareModuleInput(
            input_layouts=(Replicate(), None),
            desired_input_layouts=(Shard(1), None),
            use_local_output=True,
        )
    if sp and model.norm is not None:
        assert "norm" in SP_SHARDED_MODULES
        root["norm"] = SequenceParallel()
    if root:
        parallelize_module(model, tp_mesh, root)
    if sp and model.norm is not None and model.cfg.tie_embeddings:
        # A tied head (the embedding, or under a pipeline its copy on the last stage): the final
        # norm's output is gathered for the replicated matrix.
        parallelize_module(
            model.norm,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
            ),
        )

    for block in model.layers.values():
        plan: dict[str, Any] = {}
        for name, split in TP_STYLES.items():
            if name == "feed_forward.w3" and cast(FeedForward, block.feed_forward).w3 is None:
                continue
            # The row-wise output projections return the residual stream's layout.
            plan[name] = (
                _style(split, output_layouts=stream)
                if split.style == "rowwise"
                else (_style(split))
            )
        if sp:
            plan.update({name: SequenceParallel() for name in SP_SHARDED_MODULES if name != "norm"})
            # x from the norm (sequence shards) is gathered; attention's RoPE table passes as is.
            gathered = {
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
            plan.update({name: gathered[name] for name in SP_GATHERED_INPUTS})
        parallelize_module(block, tp_mesh, plan)


def loss_context(model: ModelConfig, tp: int) -> contextlib.AbstractContextManager[Any]:
    """Where the loss and its backward run: under torch's `loss_parallel` when the logits stay
    split over the vocabulary (`model.config.loss_parallel`), else as in one process."""
    return torch_loss_parallel() if loss_parallel(model, tp) else contextlib.nullcontext()
