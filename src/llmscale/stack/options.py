"""Settings of a stack's own software that change what the planner costs, as its users set them.

Each is a flag of `llmscale plan` and `llmscale train --dry-run --stack NAME` named after the
software's own setting, and a fact a published run may state (validation/runs.py ROW_FACTS):
one definition for both, so a run on the validation page is predicted exactly as the command a
user types for it. A flag given under a stack that has no such setting is refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmscale.errors import ConfigError
from llmscale.stack import EXPANDABLE_SEGMENTS_OVERHEAD, STACKS, Stack


@dataclass(frozen=True)
class StackOption:
    """One setting: its flag (without "--"), the stacks that have it, what the software calls
    it, what it does, and the Stack fields it sets when on and, where the flag can also be
    turned off (`--no-NAME`), when off (a field of the stack's kernels as "kernels.NAME").
    Unset, a stack keeps its own default."""

    name: str
    stacks: tuple[str, ...]
    what: str
    help: str
    when_on: Mapping[str, Any]
    when_off: Mapping[str, Any] | None = None

    @property
    def dest(self) -> str:
        """The argparse destination of its flag."""
        return self.name.replace("-", "_")

    def apply(self, stack: Stack, on: bool) -> Stack:
        """`stack` with this setting on or off (ConfigError if the stack has no such setting,
        or it cannot be turned off)."""
        if stack.name not in self.stacks:
            raise ConfigError(
                f"--{self.name}", f"--stack {stack.name}",
                " | ".join(f"--stack {s}" for s in self.stacks) + f" ({self.what})",
            )  # fmt: skip
        changes = self.when_on if on else self.when_off
        if changes is None:
            raise ConfigError(f"--no-{self.name}", "given", f"--{self.name} or nothing")
        own = {k: v for k, v in changes.items() if not k.startswith(KERNELS)}
        kern = {k[len(KERNELS) :]: v for k, v in changes.items() if k.startswith(KERNELS)}
        if kern:
            own["kernels"] = replace(stack.kernels, **kern)
        return stack.on(**own)

    def is_on(self, stack: Stack) -> bool:
        """Whether `stack`'s fields are those this setting sets when on."""
        return all(_field(stack, k) == v for k, v in self.when_on.items())


KERNELS = "kernels."


def _field(stack: Stack, key: str) -> Any:
    """A Stack field by name, or a field of its kernels as "kernels.NAME"."""
    if key.startswith(KERNELS):
        return getattr(stack.kernels, key[len(KERNELS) :])
    return getattr(stack, key)


STACK_OPTIONS: tuple[StackOption, ...] = (
    StackOption(
        "fp8-param-gather",
        ("megatron-core",),
        "Megatron's --fp8-param-gather",
        "under --precision fp8 the block linears' weights kept in FP8 between steps "
        "(TransformerEngine's fp8_model_init), gathered in FP8, no weight cast per "
        "micro-batch. On by default, as Megatron-Bridge's FP8 recipes set it "
        "(training/mixed_precision.py: current scaling, MXFP8, delayed); --no-fp8-param-gather "
        "for NeMo 1 runs (cfg fp8_params, default False)",
        {"fp8_params": True},
        {"fp8_params": False},
    ),
    StackOption(
        "grad-reduce-in-bf16",
        ("megatron-core",),
        "Megatron's --grad-reduce-in-bf16",
        "gradients accumulated and reduced in bf16, 2 B per parameter instead of fp32 main "
        "gradients. On by default, as NVIDIA's published configurations run (Megatron-Bridge's "
        "performance scripts: grad_reduce_in_fp32 False; NeMo 1's launcher: grad_sync_dtype "
        "bf16); --no-grad-reduce-in-bf16 for the library default (Megatron-LM under --bf16, "
        "Megatron-Bridge's recipes, NeMo 1's base configs: fp32 main gradients)",
        {"main_grad_bytes": 2},
        {"main_grad_bytes": 4},
    ),
    StackOption(
        "async-tp",
        ("torchtitan",),
        "torchtitan's parallelism.enable_async_tensor_parallel",
        "torch's micro-pipelined TP (with --compile and sequence parallelism), each TP "
        "collective overlapped with its GEMM's chunks",
        {"tp_overlap_gemm": True, "tp_overlap_chunks": True},
        {"tp_overlap_gemm": False, "tp_overlap_chunks": False},
    ),
    StackOption(
        "repeat-kv",
        ("torchtitan",),
        "torchtitan's Llama before 2026-01-27 (repeat_kv ahead of SDPA)",
        "K and V copied to every query head before attention, as torchtitan's Llama did "
        "until 'GQA without kv repeats' (ff0829c1, 2026-01-27): the copies' traffic, and under "
        "--cp the ring passing the repeated heads. Off by default (torchtitan today)",
        {"kernels.repeat_kv": True},
        {"kernels.repeat_kv": False},
    ),
    StackOption(
        "compile-loss",
        ("torchtitan",),
        'torchtitan\'s compile.components including "loss"',
        "with --compile, the loss compiled with the blocks: no fp32 copy of the logits kept "
        "(on by default, as torchtitan compiles it today; --no-compile-loss for a torchtitan "
        "of 2024-12, whose loss ran eager: e8977b00 turned its compile off)",
        {"compiles_loss": True},
        {"compiles_loss": False},
    ),
    StackOption(
        "expandable-segments",
        ("megatron-core", "torchtitan"),
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "the launcher sets the allocator's expandable segments (torchtitan's run_train.sh "
        "does): the caching allocator reserves no share over what is allocated",
        {"allocator_overhead": EXPANDABLE_SEGMENTS_OVERHEAD},
    ),
)
OPTIONS_BY_NAME = {o.name: o for o in STACK_OPTIONS}


def with_options(stack: Stack, given: Mapping[str, bool | None]) -> Stack:
    """`stack` with each given setting (option name -> on/off; None: the stack's default)."""
    for name, on in given.items():
        if on is not None:
            stack = OPTIONS_BY_NAME[name].apply(stack, on)
    return stack


def in_effect(stack: Stack) -> dict[str, bool]:
    """Each setting `stack` has, on or off as the stack stands (its defaults, with whatever
    was given applied): on where the stack's fields are those the setting sets."""
    return {o.name: o.is_on(stack) for o in STACK_OPTIONS if stack.name in o.stacks}


def options_text(given: Mapping[str, bool | None]) -> str:
    """The settings as flags ("--fp8-param-gather --no-async-tp"; "" for none); one off that
    has no --no-NAME flag (it cannot be turned off, only left unset) is left out."""
    return " ".join(
        f"--{'' if on else 'no-'}{n}"
        for n, on in given.items()
        if on or (on is False and OPTIONS_BY_NAME[n].when_off is not None)
    )


def validate_options(stack_name: str, given: Mapping[str, bool | None]) -> None:
    """Refuse, in one line, a setting the named stack has not."""
    with_options(STACKS[stack_name], given)
