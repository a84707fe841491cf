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
        (7, 3, [3, 2, 2]),
        (32, 6, [6] * 2 + [5] * 4),
    ],
)
def test_split_is_contiguous_and_balanced(layers, stages, sizes) -> None:
    parts = split_layers(layers, stages)
    assert [len(r) for r in parts] == sizes
    assert [i for r in parts for i in r] == list(range(layers))


def test_split_needs_a_layer_per_stage() -> None:
    with pytest.raises(ValueError):
        split_layers(4, 5)


def test_interleaved_stages_are_assigned_loop_style() -> None:
    assert [stage_ids(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert stage_ids(1, 2, 1) == [1]


@pytest.mark.parametrize("n_stages", [2, 4])
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
