"""Which kernels a training stack runs, as far as they decide what is saved and moved.

`Kernels` is the part of a stack (`llmscale.stack.Stack`) that the activation model
(`plan/activations.py`) and the element-wise time model read: the attention kernel, dropout,
the residual stream's dtype, how sequence parallelism saves the linears' inputs, the
vocabulary split. The llmscale runtime's facts come from `model.config`, which the runtime
itself calls (`Kernels.for_runtime`).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig, loss_parallel, vocab_parallel

ATTENTION_KERNELS = ("auto", "flash", "efficient", "math", "materialized")
# The cross-entropy kernels a stack may run (`Kernels.loss_kernel`).
LOSS_KERNELS = ("torch", "megatron", "megatron_fused", "te")


@dataclass(frozen=True)
class Kernels:
    """The implementation facts that decide what is saved (not the model's shape)."""

    device: str = "cuda"  # cuda | cpu: RMSNorm fused (input + rstd) or composite (+ normed x)
    attention: str = "auto"  # auto: flash for bf16/fp16 (and on CPU), else efficient or math
    dropout: bool = False
    residual_fp32: bool = True  # autocast keeps the residual stream in the fp32 param dtype
    sp_saves_gathered_input: bool = True  # DTensor SP: linear inputs saved whole, not split
    # Embedding, head and logits split over tp: None = as the llmscale runtime does
    # (`model.config.vocab_parallel`: untied models split them); True / False to force.
    vocab_parallel: bool | None = None
    # The loss's log-softmax split over tp too (Megatron's vocab-parallel cross-entropy); None =
    # as the runtime (`model.config.loss_parallel`: wherever the head is vocabulary-parallel).
    loss_parallel: bool | None = None
    # The forward's weights are already bf16/fp16 (FSDP2's param_dtype, offloaded working
    # copies): the residual stream and an RMSNorm's output are in that dtype, so the linears
    # reading one norm output share one saved input instead of autocast casting it per linear.
    lowp_weights: bool = False
    # The gated MLP's activation as one fused function (Megatron's bias-SwiGLU fusion): it keeps
    # its input (w1's and w3's outputs) and recomputes silu in backward, so silu's output is not
    # kept.
    fused_swiglu: bool = False
    # Under fp8, each linear saves its input as the float8 cast it multiplied
    # (TransformerEngine), 1 byte per element, instead of the bf16 input (torchao's float8
    # linears keep the bf16 input and cast again in backward); where the bf16 tensor is kept
    # anyway (the attention output, for the attention's backward), the cast is kept beside it.
    fp8_saves_casts: bool = False
    # Under fp8, sequence parallelism's forward all-gathers move the float8 cast of the region's
    # input, 1 byte per element (torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput,
    # which torchtitan's apply_tp uses with float8 linears); gradients stay bf16.
    fp8_all_gathers: bool = False
    # The cross-entropy kernel (`LOSS_KERNELS`): "torch" (F.cross_entropy on the fp32 logits;
    # on vocabulary shards torch's `loss_parallel`, a DTensor composite: `splits_logits`);
    # "megatron" (Megatron's vocab_parallel_cross_entropy, unfused: an fp32 copy of the logits
    # turned into the softmax in place by separate kernels, which it saves; its backward scales
    # it in place and autograd casts it to the logits' dtype); "megatron_fused" (the same four
    # steps as torch.compile'd functions, --cross-entropy-loss-fusion with the native
    # implementation); "te" (TransformerEngine's Triton cross-entropy: an online softmax over
    # the logits, whose gradient it writes over them in forward and scales in backward). What
    # each keeps, holds and moves: `plan/activations.py` `loss_facts`.
    loss_kernel: str = "torch"
    # K and V repeated to the query heads before the attention kernel (grouped-query attention
    # without the kernel's own support: torchtitan's Llama repeat_kv before 2025); what a
    # context-parallel all-gather moves.
    repeat_kv: bool = False
    # The loss (the fp32 upcast, log-softmax and NLL) runs as one compiled graph (torchtitan
    # compiles it with the model): it keeps its input, the logits in the activation dtype, and
    # one fp32 log-sum-exp per token instead of the fp32 log-softmax output, and its backward
    # writes the logits' gradient in one fused kernel, with no fp32 (b, s, V) temporaries.
    compiled_loss: bool = False

    @classmethod
    def for_runtime(cls, model: ModelConfig, tp: int, device: str = "cuda") -> Kernels:
        """The llmscale runtime's kernel facts for `model` at tensor-parallel degree `tp` on
        `device` ("cuda" or "cpu"): the one description of the runtime that every caller uses."""
        return cls(
            device="cpu" if device == "cpu" else "cuda",
            vocab_parallel=vocab_parallel(model, tp),
            loss_parallel=loss_parallel(model, tp),
        )

    def splits_vocab(self, model: ModelConfig, tp: int) -> bool:
        """Are the embedding, the output projection and the logits split over `tp` ranks?"""
        if tp == 1:
            return False
        return vocab_parallel(model, tp) if self.vocab_parallel is None else self.vocab_parallel

    def splits_logits(self, model: ModelConfig, tp: int) -> bool:
        """Does the loss run on the logits split over `tp` ranks (not gathered first)?"""
        if tp == 1:
            return False
        return loss_parallel(model, tp) if self.loss_parallel is None else self.loss_parallel

    def attention_kv_dim(self, model: ModelConfig) -> int:
        """Width of K (and of V) as the attention kernel receives them: repeated to the query
        heads under `repeat_kv`, else the model's K/V heads."""
        return model.dim if self.repeat_kv else model.kv_dim

    def attention_kernel(self, model: ModelConfig, precision: str) -> str:
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError("kernels.attention", self.attention, " | ".join(ATTENTION_KERNELS))
        if self.attention != "auto":
            return self.attention
        if self.device == "cpu" or precision != "fp32":
            return "flash"
        # fp32 on CUDA: no flash kernel; the memory-efficient one has no GQA, so GQA -> math.
        return "math" if model.n_kv_heads < model.n_heads else "efficient"

    def loss(self) -> str:
        """`loss_kernel`, checked against `LOSS_KERNELS` (ConfigError naming them)."""
        if self.loss_kernel not in LOSS_KERNELS:
            raise ConfigError("kernels.loss_kernel", self.loss_kernel, " | ".join(LOSS_KERNELS))
        return self.loss_kernel


# The llmscale runtime on CUDA and on the CPU, for any model (vocabulary split as it decides);
# `Kernels.for_runtime(model, tp, device)` gives the same facts resolved for one model.
RUNTIME = Kernels()
RUNTIME_CPU = Kernels(device="cpu")
# Megatron-LM as Korthikanti et al. and Narayanan et al. ran it: fp16 activations throughout,
# dropout after attention probabilities and both residual branches, softmax materialised,
# sequence-parallel inputs re-gathered in backward, vocabulary-parallel embedding and LM head.
MEGATRON_2021 = Kernels(
    attention="materialized",
    dropout=True,
    residual_fp32=False,
    sp_saves_gathered_input=False,
    vocab_parallel=True,
    loss_parallel=True,
    loss_kernel="megatron",
)
