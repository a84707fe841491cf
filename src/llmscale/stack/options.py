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

# A setting's value: on or off, or one of a valued setting's choices.
Value = bool | str


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
    # A setting with values (`--NAME VALUE`) instead of on/off: each value's Stack fields.
    choices: Mapping[str, Mapping[str, Any]] | None = None

    @property
    def dest(self) -> str:
        """The argparse destination of its flag."""
        return self.name.replace("-", "_")

    def apply(self, stack: Stack, on: Value) -> Stack:
        """`stack` with this setting on or off, or at a value (ConfigError if the stack has no
        such setting, it cannot be turned off, or the value is not one of its choices)."""
        if stack.name not in self.stacks:
            raise ConfigError(
                f"--{self.name}", f"--stack {stack.name}",
                " | ".join(f"--stack {s}" for s in self.stacks) + f" ({self.what})",
            )  # fmt: skip
        if self.choices is not None:
            if not isinstance(on, str) or on not in self.choices:
                raise ConfigError(f"--{self.name}", on, " | ".join(self.choices))
            changes: Mapping[str, Any] | None = self.choices[on]
        else:
            changes = self.when_on if on else self.when_off
        if changes is None:
            raise ConfigError(f"--no-{self.name}", "given", f"--{self.name} or nothing")
        own = {k: v for k, v in changes.items() if not k.startswith(KERNELS)}
        kern = {k[len(KERNELS) :]: v for k, v in changes.items() if k.startswith(KERNELS)}
        if kern:
            own["kernels"] = replace(stack.kernels, **kern)
        return stack.on(**own)

    def state(self, stack: Stack) -> Value | None:
        """This setting as `stack` stands: on (its fields are those it sets when on) or off; a
        valued one's value (None where the stack's fields match none of them)."""
        if self.choices is None:
            return _matches(stack, self.when_on)
        return next((v for v, ch in self.choices.items() if _matches(stack, ch)), None)


def _matches(stack: Stack, changes: Mapping[str, Any]) -> bool:
    return all(_field(stack, k) == v for k, v in changes.items())


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
        "tp-comm-overlap",
        ("megatron-core",),
        "Megatron's --tp-comm-overlap (NeMo's ub_tp_comm_overlap)",
        "TransformerEngine's userbuffers run each tensor-parallel collective beside the GEMM it "
        "feeds or drains. On by default, as NVIDIA's performance configurations set it "
        "(off under NVFP4, as Megatron-Bridge's); --no-tp-comm-overlap for a run without it",
        {"tp_overlap_gemm": True},
        {"tp_overlap_gemm": False},
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
        "cross-entropy-fusion",
        ("megatron-core",),
        "Megatron's --cross-entropy-loss-fusion and --cross-entropy-fusion-impl",
        "the loss kernel: te (TransformerEngine's fused cross-entropy, the default: Megatron-"
        "Bridge's performance scripts set cross_entropy_fusion_impl te), native (Megatron's "
        "fused vocab-parallel cross-entropy, its steps compiled), none (unfused, an fp32 copy of "
        "the logits saved as the softmax: Megatron-LM's and Megatron-Core 0.8's default)",
        {},
        choices={
            "te": {"kernels.loss_kernel": "te"},
            "native": {"kernels.loss_kernel": "megatron_fused"},
            "none": {"kernels.loss_kernel": "megatron"},
        },
    ),
    StackOption(
        "pipeline-outputs-kept",
        ("torchtitan",),
        "torch.distributed.pipelining's stage outputs kept to the step's end",
        "which pipeline stages keep every micro-batch's output: none (torchtitan since its "
        "#1922, 2025-10: step with return_outputs=False, the default), last (torch's default "
        "return_outputs: the last stage's logits), all (torch before pytorch#153383, 2025-05: "
        "every stage's)",
        {},
        choices={k: {"pipeline_outputs_kept": k} for k in ("none", "last", "all")},
    ),
    StackOption(
        "expandable-segments",
        ("megatron-core",),
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "the launcher sets the allocator's expandable segments (Megatron-Bridge's performance "
        "scripts do for Llama 3.1 405B on GB200): the caching allocator reserves no share over "
        "what is allocated. torchtitan's launcher always sets them (run_train.sh, since "
        "a5e57e4a): its stack's reserve is measured under them",
        {"allocator_overhead": EXPANDABLE_SEGMENTS_OVERHEAD},
    ),
)
OPTIONS_BY_NAME = {o.name: o for o in STACK_OPTIONS}


def with_options(stack: Stack, given: Mapping[str, Value | None]) -> Stack:
    """`stack` with each given setting (option name -> on/off; None: the stack's default)."""
    for name, on in given.items():
        if on is not None:
            stack = OPTIONS_BY_NAME[name].apply(stack, on)
    return stack


def in_effect(stack: Stack) -> dict[str, Value]:
    """Each setting `stack` has as the stack stands (its defaults, with whatever was given
    applied): on or off, or a valued one's value."""
    states = {o.name: o.state(stack) for o in STACK_OPTIONS if stack.name in o.stacks}
    return {k: v for k, v in states.items() if v is not None}


def options_text(given: Mapping[str, Value | None]) -> str:
    """The settings as flags ("--fp8-param-gather --no-async-tp --cross-entropy-fusion te";
    "" for none); one off that has no --no-NAME flag (it cannot be turned off, only left unset)
    is left out."""
    out = []
    for n, on in given.items():
        if isinstance(on, str):
            out.append(f"--{n} {on}")
        elif on or (on is False and OPTIONS_BY_NAME[n].when_off is not None):
            out.append(f"--{'' if on else 'no-'}{n}")
    return " ".join(out)


def validate_options(stack_name: str, given: Mapping[str, Value | None]) -> None:
    """Refuse, in one line, a setting the named stack has not."""
    with_options(STACKS[stack_name], given)
