"""Recomputation changes memory, not numbers."""

import gc
import weakref

import pytest
import torch

from llmscale.instrument.activations import LiveActivations, SavedActivations, model_state_tensors
from llmscale.model.config import get_preset
from llmscale.model.transformer import TransformerBlock, build_model
from llmscale.parallel.activation_checkpoint import apply_recompute
from llmscale.train.trainer import lm_loss

MODES = [("none", 2), ("selective", 2), ("selective_op", 2), ("every_k", 2), ("full", 2)]


def _run(mode: str, k: int, tokens: torch.Tensor):
    model = build_model(get_preset("tiny"), seed=0)
    wrapped = apply_recompute(model, mode, k)
    with SavedActivations(model_state_tensors(model)) as counter:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, counter.bytes, wrapped


@pytest.fixture(scope="module")
def results():
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    return {mode: _run(mode, k, tokens) for mode, k in MODES}


def test_loss_and_gradients_identical_to_no_recompute(results) -> None:
    loss0, grads0, _, _ = results["none"]
    for mode in ("selective", "selective_op", "every_k", "full"):
        loss, grads, _, _ = results[mode]
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=0)
        for g, g0 in zip(grads, grads0, strict=True):
            torch.testing.assert_close(g, g0, rtol=1e-6, atol=1e-9)


def test_saved_activation_bytes_strictly_ordered(results) -> None:
    b = {mode: r[2] for mode, r in results.items()}
    assert b["none"] > b["selective"] > b["every_k"] > b["full"] > 0, b


def test_selective_op_keeps_less_than_every_other_block_more_than_full(results) -> None:
    b = {mode: r[2] for mode, r in results.items()}
    assert b["every_k"] > b["selective_op"] > b["full"], b


def test_wrapped_modules(results) -> None:
    assert results["none"][3] == []
    assert results["selective"][3] == [f"layers.{i}.attention.core" for i in range(4)]
    assert results["selective_op"][3] == [f"layers.{i}" for i in range(4)]
    assert results["every_k"][3] == ["layers.1", "layers.3"]
    assert results["full"][3] == [f"layers.{i}" for i in range(4)]


def test_parameter_names_do_not_change() -> None:
    plain = build_model(get_preset("tiny"))
    full = build_model(get_preset("tiny"))
    apply_recompute(full, "full")
    assert list(plain.state_dict()) == list(full.state_dict())
    op = build_model(get_preset("tiny"))
    apply_recompute(op, "selective_op")
    assert type(op.layers["0"]).__name__ == "OpCheckpointedTransformerBlock"
    assert list(plain.state_dict()) == list(op.state_dict())


def test_full_recompute_keeps_only_block_inputs_per_layer() -> None:
    """With every block checkpointed, a block holds exactly its input (b*s*d fp32)."""
    cfg = get_preset("tiny")
    tokens = torch.randint(0, 256, (2, 33))
    counts = {}
    for layers in (2, 4):
        model = build_model(cfg.with_overrides(n_layers=layers))
        apply_recompute(model, "full")
        with SavedActivations(model_state_tensors(model)) as c:
            model(tokens[:, :-1])
        counts[layers] = c.bytes
    per_layer = (counts[4] - counts[2]) / 2
    assert per_layer == 2 * 32 * cfg.dim * 4


@pytest.mark.parametrize("mode", ["none", "full", "selective_op"])
def test_live_activations_peak_at_the_forwards_in_flight(mode: str) -> None:
    """Two forwards before their backwards hold twice one forward's saved bytes; each backward
    frees its own (a pipeline's micro-batches in flight, in one process)."""
    model = build_model(get_preset("tiny"), seed=0)
    apply_recompute(model, mode)
    tokens = torch.randint(0, 256, (3, 2, 33), generator=torch.Generator().manual_seed(1))
    c = tokens[2].clone()
    with SavedActivations(model_state_tensors(model)) as one:
        lm_loss(model(c[:, :-1]), c[:, 1:])
    state = model_state_tensors(model)
    with LiveActivations(state) as live:
        # Own storage per micro-batch (slices of one tensor would share it).
        a, b = (tokens[i].clone() for i in range(2))
        la = lm_loss(model(a[:, :-1]), a[:, 1:])
        lb = lm_loss(model(b[:, :-1]), b[:, 1:])
        assert live.bytes == 2 * one.bytes
        la.backward()
        assert live.bytes == one.bytes  # the first micro-batch's graph is gone
        lb.backward()
    assert live.peak_bytes == 2 * one.bytes
    del la, lb
    assert live.bytes == 0


def test_a_checkpointed_model_is_freed_without_the_garbage_collector() -> None:
    """The class swap leaves no reference cycle: dropping the model frees it at once."""
    gc.disable()
    try:
        model = build_model(get_preset("tiny"), seed=0)
        apply_recompute(model, "full")
        apply_recompute(model, "full")  # a second application changes nothing
        assert type(model.layers["0"]).__name__ == "CheckpointedTransformerBlock"
        assert isinstance(model.layers["0"], TransformerBlock)
        tokens = torch.randint(0, 256, (2, 17))
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        gone = weakref.ref(model.layers["0"])
        del model
        assert gone() is None
    finally:
        gc.enable()


def test_instruments_nest_and_share_the_checkpoint_inputs() -> None:
    """A counter inside a live watcher: both see every saved tensor and the checkpoints' inputs
    (the pipeline meter's arrangement), with no hand-off between them."""
    model = build_model(get_preset("tiny"), seed=0)
    apply_recompute(model, "full")
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(2))
    state = model_state_tensors(model)
    with SavedActivations(state) as alone:
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    with LiveActivations(state) as live, SavedActivations(state) as inner:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        assert inner.bytes == alone.bytes > 0
        assert live.bytes == alone.bytes
        loss.backward()
    assert live.peak_bytes == alone.bytes
