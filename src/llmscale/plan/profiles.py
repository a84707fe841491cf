"""Training stacks the planner can model (`--profile`): whose kernels and memory behaviour.

A profile is the facts about one training stack that change what a plan costs, not the GPU's
efficiencies (those are the catalog's `Calibration`, one per GPU):

- llmscale (default): this project's runtime, from its own declarations
  (`Kernels.for_runtime`: fused RMSNorm, flash SDPA, fp32 residual under autocast, the
  vocabulary split `model.config.vocab_parallel` decides, DTensor SP saving the gathered linear
  input, selective = checkpoint the attention core; fp32 master parameters, 16 B of states per
  parameter plus the 2 B autocast copy of each weight; gradients reduced once per step).
- megatron: Megatron-LM as Narayanan et al. 2021 and Korthikanti et al. 2022 ran it: fp16
  activations throughout (no fp32 residual), dropout, a materialised s x s softmax,
  vocabulary-parallel embedding, head and cross-entropy, SP inputs re-gathered in backward,
  selective = recompute the attention core (Korthikanti's policy: softmax, dropout, QK^T/AV),
  pipeline sends scattered over the tensor-parallel ranks, the data-parallel all-reduce after
  the flush (not overlapped); states 18 B per parameter (fp16 weight, fp32 main gradient,
  fp32 master, two Adam moments: Korthikanti et al. Fig. 1 is 18 B x parameters / (t p)).
- torchtitan: PyTorch's torchtitan (FSDP2 with bf16 param_dtype, SDPA flash attention,
  loss_parallel under TP), selective = torchtitan's op-level SAC (`_save_list` in
  torchtitan/models/llama/parallelize_llama.py: save every other matmul's output and the SDPA
  outputs, recompute the rest; see `op_sac_block_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmscale.config import Precision
from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig
from llmscale.plan import activations as act
from llmscale.plan.time import DEFAULT_TIME, TimeParams

PROFILE_NAMES = ("llmscale", "megatron", "torchtitan")


@dataclass(frozen=True)
class Profile:
    """One training stack's facts (see the module docstring)."""

    name: str
    kernels: act.Kernels
    time: TimeParams
    selective: str  # attention_core | op
    state_bytes_per_param: float  # params + grads + optimizer (+ kept weight casts), unsharded


PROFILES: dict[str, Profile] = {
    "llmscale": Profile("llmscale", act.RUNTIME, DEFAULT_TIME, "attention_core", 18.0),
    "megatron": Profile(
        "megatron",
        act.MEGATRON_2021,
        replace(
            DEFAULT_TIME,
            kernels=act.MEGATRON_2021,
            p2p_scatter_gather=True,
            dp_overlap=0.0,
            # Megatron's fp16 optimizer per parameter: unscale and inf-check the fp32 main
            # gradient (read 4, write 4), its norm (read 4), Adam (read p g m v, write p m v:
            # 28), copy the fp32 master into the fp16 weight (read 4, write 2).
            optimizer_bytes_per_param=46.0,
            elementwise="saved",  # fused kernels: bias-GeLU, masked softmax, bias-dropout-add
        ),
        "attention_core",
        18.0,
    ),
    "torchtitan": Profile(
        "torchtitan",
        act.Kernels(residual_fp32=False, vocab_parallel=True, loss_parallel=True),
        replace(
            DEFAULT_TIME,
            kernels=act.Kernels(residual_fp32=False, vocab_parallel=True, loss_parallel=True),
            grad_sync_once=False,
            selective_policy="op",
            elementwise="torchtitan",
        ),
        "op",
        16.0,
    ),
}


def get_profile(name: str) -> Profile:
    """The profile called `name`, or a ConfigError listing them."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError("profile", name, " | ".join(PROFILE_NAMES)) from None


def kernels_for(name: str, model: ModelConfig, tp: int, device: str = "cuda") -> act.Kernels:
    """The kernel facts of profile `name` for `model` at `tp` (llmscale: the runtime's own)."""
    if name == "llmscale":
        return act.Kernels.for_runtime(model, tp, device)
    return get_profile(name).kernels


def op_sac_block_bytes(
    model: ModelConfig, micro_batch_size: int, seq_len: int, precision: Precision, tp: int = 1
) -> float:
    """Bytes one block keeps under torchtitan's op-level SAC: its input (the checkpoint's), the
    saved matmul outputs and SDPA's output and log-sum-exp (flash); everything else is
    recomputed. `act.block_bytes` in mode selective_op with torchtitan's kernels (bf16 residual
    under FSDP2's param_dtype), no sequence parallelism."""
    kernels = PROFILES["torchtitan"].kernels
    return act.block_bytes(
        model, micro_batch_size, seq_len, precision, tp, False, kernels, "selective_op"
    )


def time_params(name: str) -> TimeParams:
    """The time model's parameters for profile `name` (`estimate_step_time(..., params)`)."""
    return get_profile(name).time
