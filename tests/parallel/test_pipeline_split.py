"""The pipeline split and the gradient norm, checked in one process (no process group)."""

from __future__ import annotations

import pytest
import torch

from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.parallel.dims import ParallelDims
from llmscale.parallel.grads import clip_grad_norm_
from llmscale.parallel.pipeline import build_stage_module, split_layers, stage_ids


@pytest.mark.parametrize(
    ("layers", "stages", "sizes"),
    [
        (4, 2, [2, 2]),
        (4, 4, [1, 1, 1, 1]),
        (5, 2, [3, 2]),
        # Issue 12: the extra layers go to the middle stages first, then the first, then the
        # last: the stages with the embedding and the head are the lighter ones.
        (7, 3, [2, 3, 2]),
        (32, 6, [5, 6, 6, 5, 5, 5]),
        (126, 4, [31, 32, 32, 31]),  # Llama 3 405B over 4 stages
        (80, 3, [27, 27, 26]),
    ],
)
def test_split_is_contiguous_and_balanced(layers, stages, sizes) -> None:
    parts = split_layers(layers, stages)
    assert [len(r) for r in parts] == sizes
    assert [i for r in parts for i in r] == list(range(layers))


def test_split_needs_a_layer_per_stage_or_the_ends_alone() -> None:
    """At most one stage per layer, or exactly two more: the embedding and the head each alone
    (Megatron's account_for_embedding/loss_in_pipeline_split with one slot per stage)."""
    for stages in (5, 7):
        with pytest.raises(ValueError, match="cannot split 4 layers"):
            split_layers(4, stages)
    assert [len(r) for r in split_layers(4, 6)] == [0, 1, 1, 1, 1, 0]
    sizes = [len(r) for r in split_layers(126, 128)]  # Llama 3.1 405B over pp 16 x 8 chunks
    assert sizes == [0, *[1] * 126, 0]


def test_explicit_layers_per_stage() -> None:
    assert split_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    assert split_layers(7, 3, (3, 3, 1)) == [range(0, 3), range(3, 6), range(6, 7)]
    assert split_layers(4, 2, [0, 4]) == [range(0, 0), range(0, 4)]  # the embedding alone
    assert split_layers(4, 3, [2, 2, 0]) == [range(0, 2), range(2, 4), range(4, 4)]
    for bad in ([2, 3], [4], [-1, 5], [1, 1, 2]):
        with pytest.raises(ValueError, match="parallel.pp_layers"):
            split_layers(4, 2, bad)
    with pytest.raises(ValueError, match="every stage but the first and the last"):
        split_layers(4, 3, [2, 0, 2])


def test_stage_module_holds_its_explicit_layers() -> None:
    model = build_model(get_preset("tiny"), "meta")
    first = build_stage_module(model, 0, 2, [3, 1])
    last = build_stage_module(model, 1, 2, [3, 1])
    assert list(first.layers) == ["0", "1", "2"] and list(last.layers) == ["3"]
    alone = build_stage_module(model, 0, 2, [0, 4])  # the embedding alone
    assert list(alone.layers) == [] and alone.tok_embeddings is not None and alone.output is None
    head = build_stage_module(model, 1, 2, [4, 0])  # the final norm and the head alone
    assert list(head.layers) == [] and head.tok_embeddings is None and head.output is not None


def test_interleaved_stages_are_assigned_loop_style() -> None:
    assert [stage_ids(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert stage_ids(1, 2, 1) == [1]


@pytest.mark.parametrize("n_stages", [2, 4, 6])  # 6: the embedding and the head alone
def test_stages_in_sequence_are_the_model(n_stages) -> None:
    model = build_model(get_preset("tiny"), seed=3)
    stages = [build_stage_module(model, s, n_stages) for s in range(n_stages)]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # disjoint, complete
    assert stages[0].tok_embeddings is not None and stages[0].output is None
    assert stages[-1].tok_embeddings is None and stages[-1].norm is not None
    tokens = torch.randint(0, 264, (2, 16))
    h = tokens
    for s in stages:
        h = s(h)
    assert torch.equal(h, model(tokens))


def test_clip_in_one_process_equals_torch() -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p) * 4
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 1.0, ParallelDims())
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
