"""A model built on meta, split and then materialised holds exactly the full model's values."""

from __future__ import annotations

import pytest
import torch

from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model, param_seed
from llmscale.parallel.materialize import materialize
from llmscale.parallel.pipeline import build_stage_module

CFG = get_preset("tiny")


def test_meta_then_materialize_equals_building_in_place() -> None:
    ref = build_model(CFG, "cpu", seed=7)
    model = build_model(CFG, "meta")
    assert all(p.is_meta for p in model.parameters())
    materialize([model], torch.device("cpu"), seed=7)
    assert not any(p.is_meta for p in model.parameters())
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, r), name
    assert torch.equal(model.rope, ref.rope)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    assert torch.equal(model(tokens), ref(tokens))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_pipeline_stage_holds_the_full_models_values(stage: int) -> None:
    """Each parameter draws from its own (seed, name) generator: what a stage keeps is what the
    whole model has under that name, whatever else is built."""
    ref = dict(build_model(CFG, "cpu", seed=3).named_parameters())
    part = build_stage_module(build_model(CFG, "meta"), stage, 4)
    materialize([part], torch.device("cpu"), seed=3)
    names = [n for n, _ in part.named_parameters()]
    assert names and len(names) < len(ref)
    for name, p in part.named_parameters():
        assert torch.equal(p, ref[name]), name


def test_seeds_differ_by_name_and_run() -> None:
    a, b = (
        param_seed(0, "layers.0.attention.wq.weight"),
        param_seed(0, "layers.0.attention.wk.weight"),
    )
    assert a != b and param_seed(1, "layers.0.attention.wq.weight") != a
    assert 0 <= a < 2**63
    m1, m2 = build_model(CFG, seed=0), build_model(CFG, seed=1)
    assert not torch.equal(m1.layers["0"].attention.wq.weight, m2.layers["0"].attention.wq.weight)
    # Two matrices of one model are not the same draw.
    wq, wk = m1.layers["0"].attention.wq.weight, m1.layers["0"].attention.wk.weight
    assert not torch.equal(wq[: wk.shape[0]], wk)
