"""LSP-Offload's compressed weight gradient, taken from a linear layer's backward.

A linear layer y = x Wᵀ (W: m x n, T tokens) has the weight gradient G = dYᵀ X (m x n), which
autograd forms with T m n multiply-adds; LSP-Offload only keeps its compression
    C = P G Qᵀ = (P dYᵀ) (Q Xᵀ)ᵀ    (d x d),
which the right-hand side gives without forming G: two count-sketches of the layer's output
gradient and input (s T (m + n) multiply-adds, `offload.lsp.sketch`) and one d x T x d product.
That is T d (m + n + d) multiply-adds at most against the weight gradient's T m n, whose
compression it also replaces: a quarter at the paper's proportions (d = 512, 4096-wide), 0.75 to
1.25 for the small model's matrices (d = half their smaller side; docs/offload.md measures it).

`install(module, sink)` swaps the forward of an `nn.Linear` for `CompressedGradLinear`, an
autograd function whose forward is `F.linear` and whose backward returns the input's (and the
bias's) gradient as autograd would, and hands (weight, X, dY) to `sink` instead of producing
W's gradient: the offloaded optimizer (`offload.adamw`) compresses, or, on a step that checks
or fits the projectors, forms G itself. It saves what `F.linear` saves (the input and the
weight), so the saved activations are unchanged. While torch.compile traces the layer, the
forward is plain `F.linear` (a compiled graph cannot call back into the optimizer), and the
weight's gradient takes the ordinary path (its post-accumulate-grad hook).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# (weight, input as T x n, output gradient as T x m): what the optimizer takes instead of G
Sink = Callable[[nn.Parameter, torch.Tensor, torch.Tensor], None]


class CompressedGradLinear(torch.autograd.Function):
    """y = x Wᵀ + b; backward: dX and db as autograd's, W's gradient handed to the sink."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None, sink: Sink
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # the Parameter itself for the sink (a saved tensor may come back as another object)
        ctx.param, ctx.sink, ctx.has_bias = weight, sink, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        ctx.sink(ctx.param, x.reshape(-1, x.shape[-1]), dy2)
        return dx, None, db, None


class ForwardSwap:
    """The swapped forward of one module; `remove()` restores the class's."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.module = module
        module.forward = forward

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def install(module: nn.Linear, sink: Sink) -> ForwardSwap:
    """Run `module` through `CompressedGradLinear` with `sink` from now on (`remove()` undoes)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return F.linear(x, module.weight, module.bias)
        out: torch.Tensor = CompressedGradLinear.apply(  # type: ignore[no-untyped-call]  # torch: Function.apply unannotated
            x, module.weight, module.bias, sink
        )
        return out

    return ForwardSwap(module, forward)
