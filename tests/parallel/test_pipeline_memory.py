"""What torch's split backward keeps besides saved activations, in one process.

torch 2.13's `PipelineStage.backward_one_chunk(full_backward=False)` (B) stores, per
micro-batch until `backward_weight_one_chunk` (W), the gradients at the ops W starts from (each
linear's and each norm weight's output gradient) and the stage's output, and leaves the input
gradient on the received activation until the next step. `parallel.pipeline.
pending_weight_grad_bytes` counts them from the stage's own state (receive buffers apart); this
test builds that state with torch's B and W on real stage modules and checks the count against
the hand formula (per block s b (5h + 2h_kv + 2f) values) and the planner's
(`plan.activations.block_output_grads`, `head_output_grads`, `boundary_bytes`).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.stage import _RecvInfo

from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.parallel.pipeline import (
    PipelineMemory,
    build_stage_module,
    pending_weight_grad_bytes,
    receive_buffers,
)
from llmscale.plan import activations as act

B, S = 2, 32  # sequences per micro-batch, tokens


def _stage_after_b(stage_index: int, n_stages: int = 3, bf16: bool = False) -> tuple[Any, Any]:
    """A stand-in for torch's PipelineStage after one micro-batch's F and B (the fields
    `pending_weight_grad_bytes` reads), built by torch's own B."""
    cfg = replace(get_preset("tiny"), n_layers=n_stages)
    mod = build_stage_module(build_model(cfg, seed=0), stage_index, n_stages)
    first, last = stage_index == 0, stage_index == n_stages - 1
    g = torch.Generator().manual_seed(0)
    if first:
        x = torch.randint(0, cfg.vocab_size, (B, S), generator=g)  # a root input: no buffer
        args: tuple[Any, ...] = ()
    else:
        x = torch.randn(B, S, cfg.dim, generator=g).requires_grad_(True)  # the receive buffer
        args = (_RecvInfo("x", stage_index - 1, x, None),)
    dout = None if last else torch.randn(B, S, cfg.dim, generator=g)  # the gradient buffer
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = mod(x)
        if last:
            targets = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
            out = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), targets.flatten())
    groups = None
    if not first:  # torch's B does nothing on the first stage (its W runs the whole backward)
        _, groups = stage_backward_input(
            [out], None if dout is None else [dout], [x], iter(mod.parameters())
        )
    st = SimpleNamespace(
        submod=mod,
        backward_state={0: ([x], groups, (out,), None if dout is None else [dout])},
        args_recv_info={0: args},
        grad_recv_info={0: () if dout is None else (_RecvInfo("g", stage_index + 1, dout, None),)},
    )
    return st, cfg


@pytest.mark.parametrize("stage_index", [0, 1, 2])  # first, middle, last (head and loss)
def test_b_keeps_the_output_gradients_at_ws_ops_until_w(stage_index: int) -> None:
    st, cfg = _stage_after_b(stage_index)
    first, last = stage_index == 0, stage_index == 2
    h, h_kv, f, v = cfg.dim, cfg.kv_dim, cfg.ffn_dim, cfg.vocab_size
    boundary = 4 * B * S * h  # fp32 residual stream
    per_block = 4 * B * S * (5 * h + 2 * h_kv + 2 * f)  # the hand formula (SwiGLU, RMSNorm)
    args = (cfg, B, S, "fp32", 1, False, act.RUNTIME_CPU)
    assert sum(t.nbytes for t in act.block_output_grads(*args)) == per_block
    assert act.boundary_bytes(*args) == boundary
    if first:
        want_until_w, want_kept = boundary, 0  # only the stage's output
    elif last:
        head = 4 * B * S * (h + v) + 4  # final norm, logits, the 0-d loss
        assert sum(t.nbytes for t in act.head_output_grads(*args)) == head
        want_until_w, want_kept = per_block + head, boundary
    else:
        # The stage output joins; the last w2's output gradient is the received one (a view of
        # the receive buffer): not counted again.
        want_until_w, want_kept = per_block + boundary - boundary, boundary
    assert pending_weight_grad_bytes([st]) == want_until_w + want_kept
    # Receive buffers apart: the activation (not on the first stage), the gradient (not last).
    assert sum(receive_buffers([st]).values()) == boundary * ((not first) + (not last))

    input_values, groups, stage_output, _ = st.backward_state.pop(0)
    if not first:
        stage_backward_weight(iter(st.submod.parameters()), groups)
    del groups, stage_output
    # After W only the input gradient is left, on the received activation, until the step ends.
    assert pending_weight_grad_bytes([st]) == want_kept
    for infos in st.args_recv_info.values():
        for info in infos:
            info.buffer.grad = None  # torch's clear_runtime_states, at the next step
    assert pending_weight_grad_bytes([st]) == 0


def test_the_meter_samples_before_each_op_and_keeps_the_peak() -> None:
    st, _ = _stage_after_b(1)
    kept = st.backward_state.pop(0)
    calls: list[str] = []

    class Stage(SimpleNamespace):
        def forward_one_chunk(self, mb: int) -> None:
            calls.append("F")

        def backward_one_chunk(self, mb: int, **kw: Any) -> None:
            calls.append("B")
            self.backward_state[mb] = kept

        def backward_weight_one_chunk(self, mb: int, **kw: Any) -> None:
            calls.append("W")
            del self.backward_state[mb]

    stage = Stage(**vars(st))
    meter = PipelineMemory()
    meter.watch([stage])
    full = pending_weight_grad_bytes([SimpleNamespace(**{**vars(st), "backward_state": {0: kept}})])
    meter.begin_step()
    stage.forward_one_chunk(0)
    stage.backward_one_chunk(0, full_backward=False)
    stage.backward_weight_one_chunk(0)  # samples before it runs: B's state is there
    assert meter.pending_peak_bytes == full > 0
    meter.end_step()
    assert calls == ["F", "B", "W"]
    assert meter.pending_bytes < full  # after W: the input gradient only
    assert meter.buffer_bytes == sum(receive_buffers([stage]).values()) > 0
    stage.forward_one_chunk(0)  # outside a step: no sampling
    assert meter.pending_peak_bytes == full


@pytest.mark.parametrize("stage_index", [1, 2])
def test_under_bf16_autocast_the_gradients_take_their_ops_dtypes(stage_index: int) -> None:
    """bf16 autocast over fp32 weights: the linears' output gradients are bf16, the norms' and
    the residual stream's fp32; the last w2's bf16 gradient is a cast of the received fp32
    one, not a view of it, so it counts (the planner's `w2_is_received` is false)."""
    st, cfg = _stage_after_b(stage_index, bf16=True)
    h, h_kv, f, v = cfg.dim, cfg.kv_dim, cfg.ffn_dim, cfg.vocab_size
    per_block = B * S * (2 * (3 * h + 2 * h_kv + 2 * f) + 4 * 2 * h)
    boundary = 4 * B * S * h
    args = (cfg, B, S, "bf16", 1, False, act.RUNTIME_CPU)
    assert sum(t.nbytes for t in act.block_output_grads(*args)) == per_block
    if stage_index == 2:
        head = B * S * (4 * h + 2 * v) + 4
        assert sum(t.nbytes for t in act.head_output_grads(*args)) == head
        want = per_block + head + boundary  # + the input gradient
    else:
        want = per_block + boundary + boundary  # + the stage output, the input gradient
    assert pending_weight_grad_bytes([st]) == want
