"""The facts the runtime and the planner share (model/config.py), checked against the runtime.

The TP table is compared with what `apply_tp` actually shards (DTensor placements of every
parameter, on a one-rank mesh so it runs in this process), the layer split and the recompute
rules with their definitions.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from llmscale.model.config import (
    TP_STYLES,
    VOCAB_TP_STYLES,
    block_recompute,
    get_preset,
    loss_parallel,
    split_layers,
    stage_ids,
    tp_split,
    vocab_parallel,
)
from llmscale.model.transformer import build_model
from llmscale.plan.activations import MEGATRON_2021, RUNTIME, Kernels


def test_vocab_parallel_is_untied_models_under_tp() -> None:
    llama, gpt = get_preset("llama2-7b"), get_preset("gpt2-124m")
    assert vocab_parallel(llama, 8) and not vocab_parallel(llama, 1)
    assert not vocab_parallel(gpt, 8)  # tied: a matrix cannot be row- and column-split at once
    assert not loss_parallel(llama, 8)  # logits gathered before a single-process loss
    # The planner's default kernels and `for_runtime` follow it; Megatron's forces both.
    assert RUNTIME.splits_vocab(llama, 8) and not RUNTIME.splits_logits(llama, 8)
    k = Kernels.for_runtime(llama, 8, "cpu")
    assert k.vocab_parallel is True and k.loss_parallel is False and k.device == "cpu"
    assert MEGATRON_2021.splits_vocab(gpt, 8) and MEGATRON_2021.splits_logits(gpt, 8)


def test_tp_split_names() -> None:
    assert tp_split("layers.3.attention.wq.weight", False) == TP_STYLES["attention.wq"]
    assert tp_split("layers.0.feed_forward.w2.bias", False) == TP_STYLES["feed_forward.w2"]
    assert tp_split("tok_embeddings.weight", True) == VOCAB_TP_STYLES["tok_embeddings"]
    assert tp_split("tok_embeddings.weight", False) is None
    assert tp_split("layers.0.attention_norm.weight", True) is None
    assert TP_STYLES["attention.wo"].sharded_dim("weight") == 1
    assert TP_STYLES["attention.wo"].sharded_dim("bias") is None
    assert TP_STYLES["attention.wq"].sharded_dim("bias") == 0
    assert VOCAB_TP_STYLES["tok_embeddings"].sharded_dim("weight") == 0  # the vocabulary


def test_apply_tp_shards_what_the_table_says(tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from llmscale.parallel.tensor_parallel import apply_tp

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        cfg = get_preset("tiny").with_overrides(bias=True)
        model = build_model(cfg)
        apply_tp(model, init_device_mesh("cpu", (1,)), sequence_parallel=False)
        vocab = vocab_parallel(cfg, 1)
        checked = 0
        for name, p in model.named_parameters():
            split = tp_split(name, vocab)
            dim = None if split is None else split.sharded_dim(name.rsplit(".", 1)[-1])
            if dim is None:
                assert not isinstance(p, DTensor) or all(
                    not pl.is_shard() for pl in p.placements
                ), name
            else:
                assert isinstance(p, DTensor) and p.placements == (Shard(dim),), name
                checked += 1
        assert checked == cfg.n_layers * (7 + 5)  # 7 sharded weights, 5 sharded biases a block
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("layers", "stages"), [(6, 2), (80, 3), (7, 4), (32, 6)])
def test_layer_split_covers_every_layer_once(layers: int, stages: int) -> None:
    parts = split_layers(layers, stages)
    assert [i for r in parts for i in r] == list(range(layers))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [len(r) for r in parts] == sorted((len(r) for r in parts), reverse=True)  # early +1
    assert stage_ids(1, 4, 2) == [1, 5]


def test_recompute_rules() -> None:
    assert [block_recompute("every_k", i, 3) for i in range(6)] == [
        "none", "none", "full", "none", "none", "full",
    ]  # fmt: skip
    assert block_recompute("selective", 4) == "selective"
    m = get_preset("llama2-70b")
    assert m.recompute_fraction("none", 4096) == 0.0
    assert m.recompute_fraction("full", 4096) == 1.0
    assert m.recompute_fraction("every_k", 4096, 4) == 0.25
    # Selective recomputes the attention core (the runtime checkpoints `AttentionCore`).
    core = m.attention_core_flops_per_token(4096)
    assert m.recompute_fraction("selective", 4096) == core / m.block_forward_flops_per_token(4096)
    assert 0 < core / m.block_forward_flops_per_token(4096) < 0.2
