"""FP8 matmuls: `precision.mode = "fp8"` through torchao's float8 training.

torchao's `convert_to_float8_training` swaps each eligible `nn.Linear` for a `Float8Linear`:
its input, weight and output gradient are scaled (per tensor, or per row under
`precision.float8_recipe` rowwise) and cast to float8 for the three matmuls, which run on the
GPU's FP8 tensor cores (`torch._scaled_mm`); everything else runs as under bf16 (`tensors.DTYPES["fp8"]` is bf16: the
autocast and FSDP2 dtype). As torchtitan does, the output projection stays in bf16 (the loss is
sensitive to it) and so does any linear whose dimensions are not multiples of 16 (what
`_scaled_mm` needs). The planner prices the same split (plan/time.py: the linears at the FP8
peak, attention and the head in bf16, the casts as memory-bound work).

It runs where FP8 matmuls exist: a CUDA GPU of compute capability 8.9 or later (Ada, Hopper,
Blackwell) with torchao installed (`pip install -e '.[fp8]'`). Tensor parallelism would need
torchao's float8 TP styles, which this runtime does not wire: fp8 runs with tp = 1 (FSDP2,
pipelines and data parallelism are fine). Elsewhere `fp8_problem` names what is missing and the
trainer refuses with one line.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from llmscale.config import JobConfig

FP8_MIN_CAPABILITY = (8, 9)
_ALIGN = 16  # torch._scaled_mm needs both dimensions of each operand divisible by 16
# Tests only (tests/parallel/test_float8.py sets it with monkeypatch): accept a CPU, where
# torchao's float8 linears run their scaled matmuls emulated, so that the trainer's fp8 path
# executes in `make test`. No option or environment variable reaches it: users on a CPU keep
# the one-line refusal.
_ALLOW_CPU_FOR_TESTS = False


def fp8_problem(cfg: JobConfig, device: torch.device) -> str | None:
    """Why this runtime cannot train `cfg` in fp8 on `device`, or None when it can."""
    need = []
    if device.type == "cpu" and _ALLOW_CPU_FOR_TESTS:
        pass
    elif device.type != "cuda":
        need.append(f"a CUDA GPU with FP8 matmuls (this device: {device.type})")
    elif torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        need.append(f"compute capability >= 8.9 (this GPU: {cap})")
    if importlib.util.find_spec("torchao") is None:
        need.append("torchao installed (pip install -e '.[fp8]')")
    if cfg.parallel.tp > 1:
        need.append(
            f"parallel.tp = 1 (got {cfg.parallel.tp}: float8 tensor parallelism is not wired)"
        )
    return "needs " + " and ".join(need) if need else None


def fp8_eligible(fqn: str, module: nn.Module) -> bool:
    """Does the linear at `fqn` run its matmuls in float8? Not the output projection, nor a
    linear whose dimensions `_scaled_mm` cannot take."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def convert_to_fp8(model: nn.Module, recipe: str = "tensorwise") -> int:
    """Swap `model`'s eligible linears for torchao's Float8Linear in place (before any
    parallelism, on any device, meta included), scaled as torchao's `recipe`
    (`precision.float8_recipe`); the number swapped."""
    from torchao.float8 import (  # type: ignore[import-untyped]  # torchao ships no py.typed
        Float8LinearConfig,
        convert_to_float8_training,
    )

    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda m, fqn: fp8_eligible(fqn, m),
    )
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())
