"""The activation meter under a split backward (zero_bubble, zbv, dualpipev), in one process.

torch's split schedules run a stage's backward as B, `stage_backward_input` (input gradients,
with retain_graph=True), and later W, `stage_backward_weight` (weight gradients, from the
intermediates B kept). What a micro-batch saved must count from its F until its W, then be gone:
nodes W does not rerun (those above the intermediates: attention, activations, norms) once
stayed counted forever, because the meter's pack hook kept each saved *output* with its grad_fn,
a node -> saved slot -> tensor -> node cycle that only running the node without retain_graph
breaks. The pipeline suite read it as 0.73-0.89 predicted/measured on stage 0.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from llmscale.instrument.activations import LiveActivations, SavedActivations, model_state_tensors
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.parallel.pipeline import build_stage_module


@pytest.mark.parametrize("stage_index", [1, 2])  # a middle stage, and the last (head, loss)
def test_a_micro_batch_counts_from_f_until_w_then_is_gone(stage_index: int) -> None:
    cfg = replace(get_preset("tiny"), n_layers=3)
    stage = build_stage_module(build_model(cfg, seed=0), stage_index, 3)
    state = model_state_tensors(stage)
    x = torch.randn(2, 32, cfg.dim, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    targets = torch.randint(0, cfg.vocab_size, (2, 32))
    dout = torch.randn(2, 32, cfg.dim, generator=torch.Generator().manual_seed(1))

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
        out = stage(x)
        return (out, dout) if stage.output is None else (loss(out), None)

    with SavedActivations(state) as one:
        forward()
    with SavedActivations(state) as loss_only:  # what the loss saves: B frees it (detaches it)
        if stage.output is not None:
            loss(torch.zeros(2, 32, cfg.vocab_size, requires_grad=True))
    gc.disable()  # what the meter holds must go when W has run, not when a collection runs
    try:
        with LiveActivations(state) as live:
            out, grad = forward()
            assert live.bytes == one.bytes > 0
            _, groups = stage_backward_input(
                [out], None if grad is None else [grad], [x], iter(stage.parameters())
            )
            # B frees nothing of the stage: torch retains its graph for W.
            assert live.bytes == one.bytes - loss_only.bytes
            stage_backward_weight(iter(stage.parameters()), groups)
            del groups, out
            assert live.bytes == 0  # was > 0: SDPA's and the norms' saved outputs stayed
        assert live.peak_bytes == one.bytes
    finally:
        gc.enable()
    # The detached saved tensors unpack as before: the gradients are a plain backward's.
    split = [p.grad.clone() for p in stage.parameters()]
    x_grad = x.grad.clone()
    stage.zero_grad(set_to_none=True)
    x.grad = None
    out, grad = forward()
    out.backward(grad)
    for p, g in zip(stage.parameters(), split, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x_grad, x.grad, rtol=1e-6, atol=1e-7)
