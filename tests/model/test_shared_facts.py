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
    auto_split_ok,
    block_recompute,
    get_preset,
    loss_parallel,
    pp_layers_problem,
    sp_embedding_scatter,
    split_layers,
    stage_ids,
    stage_layer_counts,
    tp_split,
    vocab_parallel,
)
from llmscale.model.transformer import build_model
from llmscale.plan.activations import MEGATRON_2021, RUNTIME, Kernels


def test_vocab_parallel_is_untied_models_under_tp() -> None:
    llama, gpt = get_preset("llama2-7b"), get_preset("gpt2-124m")
    assert vocab_parallel(llama, 8) and not vocab_parallel(llama, 1)
    assert not vocab_parallel(gpt, 8)  # tied: a matrix cannot be row- and column-split at once
    # The loss runs on vocabulary shards (torch's loss_parallel) wherever the head is split.
    assert loss_parallel(llama, 8) and not loss_parallel(gpt, 8) and not loss_parallel(llama, 1)
    # The planner's default kernels and `for_runtime` follow it; Megatron's forces both.
    assert RUNTIME.splits_vocab(llama, 8) and RUNTIME.splits_logits(llama, 8)
    assert not RUNTIME.splits_logits(gpt, 8)
    k = Kernels.for_runtime(llama, 8, "cpu")
    assert k.vocab_parallel is True and k.loss_parallel is True and k.device == "cpu"
    # Sequence parallelism begins at the embedding only for a vocabulary-parallel one without
    # learned positions; otherwise the first block takes its slice of the sequence.
    assert sp_embedding_scatter(llama, 8) and not sp_embedding_scatter(gpt, 8)
    learned = llama.with_overrides(pos_emb="learned")
    assert not sp_embedding_scatter(learned, 8)
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


@pytest.mark.parametrize(("layers", "stages"), [(6, 2), (80, 3), (7, 4), (32, 6), (126, 4)])
def test_layer_split_covers_every_layer_once(layers: int, stages: int) -> None:
    parts = split_layers(layers, stages)
    assert [i for r in parts for i in r] == list(range(layers))
    sizes = [len(r) for r in parts]
    assert max(sizes) - min(sizes) <= 1
    # The first and last stages (embedding, head) are the lighter ones where any are lighter.
    if stages > 2 and max(sizes) != min(sizes) and layers % stages <= stages - 2:
        assert sizes[0] == sizes[-1] == min(sizes)
    assert stage_layer_counts(layers, stages) == sizes
    assert stage_ids(1, 4, 2) == [1, 5]


@pytest.mark.parametrize(
    ("pp_layers", "needle"),
    [
        ([2, 2, 2], "2 entries"),
        ([-1, 5], "layer counts >= 0"),
        ([3, 3], "summing to model.n_layers=4, got 6"),
    ],
)
def test_bad_pp_layers_are_named(pp_layers: list[int], needle: str) -> None:
    assert needle in pp_layers_problem(pp_layers, 4, 2)
    assert pp_layers_problem([1, 3], 4, 2) == ""


def test_only_the_first_and_last_stage_may_hold_no_layer() -> None:
    """The embedding alone on the first stage, the head alone on the last (Megatron's
    account_for_embedding/loss_in_pipeline_split); a middle stage without a layer is refused."""
    assert pp_layers_problem([0, 4], 4, 2) == pp_layers_problem([4, 0], 4, 2) == ""
    assert pp_layers_problem([0, 2, 2, 0], 4, 4) == ""
    assert "every stage but the first and the last" in pp_layers_problem([2, 0, 2], 4, 3)
    assert "at least one layer" in pp_layers_problem([0], 0, 1)
    assert auto_split_ok(4, 4) and auto_split_ok(4, 6) and auto_split_ok(126, 128)
    assert not auto_split_ok(4, 5) and not auto_split_ok(4, 7) and not auto_split_ok(4, 0)


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
