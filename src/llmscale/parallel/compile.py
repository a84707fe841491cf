"""Regional compilation: each transformer block's forward compiled with `torch.compile`.

As torchtitan's `apply_compile`: the block, not the whole model, is the unit (every block has
the same structure, so one compiled graph serves all of them and the first step compiles once),
applied after tensor parallelism and activation checkpointing (so the compiled graph holds the
recomputation: torch.compile traces `torch.utils.checkpoint` as one region and recomputes inside
its backward) and before FSDP2, whose hooks must stay outside the compiled code (they are
`torch._dynamo.disable`d and would break the graph).

torchtitan wraps each block in an `OptimizedModule` (`torch.compile(block)`), which inserts
`_orig_mod` into every parameter name. llmscale keys initial values, offload units,
checkpoints and the planner's shapes by name, so, as the activation-checkpointing wrapper does,
the block's class is swapped for a generated subclass whose `forward` runs the original one
through one compiled function shared by every block (dynamo takes the module as an input, so
the graph is reused across blocks of one shape). Module hooks (FSDP2's all-gather and
reduce-scatter) run around it, in eager mode.

The compiled function runs with the saved-tensor hooks of the activation instruments active
(`instrument/activations.py`): AOTAutograd's compiled backward saves what the fused graph needs
through those hooks, so `activation_bytes` measures the compiled block's real saved bytes,
which differ from eager (the planner's element-wise model of a compiled block, not its
activation model, changes).

Refused where torch cannot do it (`compile_problem`): with tensor parallelism on a CPU, torch
2.13's compiled backward of a block under DTensor TP fails ("'Tensor' object has no attribute
'_local_tensor'", every backend but eager). On CUDA it is allowed, untested here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmscale.model.transformer import TransformerBlock
from llmscale.parallel.class_swap import prepend_class


class Compiled(nn.Module):
    """Placed before a block's own class: its forward runs compiled (hooks stay eager)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _compiled_forward()(self, *args, **kwargs)


def _eager_forward(module: Compiled, *args: Any, **kwargs: Any) -> Any:
    # The forward of the class after Compiled in the module's order (checkpointed or not).
    return super(Compiled, module).forward(*args, **kwargs)


_COMPILED: list[Any] = []


def _compiled_forward() -> Any:
    """The one compiled function every block runs (built on first use: torch.compile is lazy,
    but building it imports dynamo, which a run without compile never needs)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_eager_forward, fullgraph=True))
    return _COMPILED[0]


def compile_module(module: nn.Module) -> None:
    """Run `module`'s forward compiled from now on (once; parameter names are unchanged)."""
    if isinstance(module, Compiled):
        return
    prepend_class(module, Compiled)


def apply_compile(model: nn.Module) -> list[str]:
    """Compile every transformer block of `model` (a whole model or a pipeline stage); returns
    the names of the compiled blocks. Call after TP and activation checkpointing, before FSDP."""
    names = [n for n, m in model.named_modules() if isinstance(m, TransformerBlock)]
    for name in names:
        compile_module(model.get_submodule(name))
    return names


def compile_problem(tp: int, device: torch.device) -> str | None:
    """Why `train.compile` cannot run with this layout on this device, or None when it can."""
    if tp > 1 and device.type != "cuda":
        return (
            "torch 2.13 fails in the backward of a compiled block under DTensor tensor "
            f"parallelism on {device.type} ('Tensor' object has no attribute '_local_tensor')"
        )
    return None
