"""Serving throughput of a decoder LLM: prefill, decode, the KV cache and tensor parallelism.

A torch-free model of offline (throughput) serving, in the planner's terms: the catalog's GPU,
its calibration and its node's scale-up link. One replica holds the model over `tp` GPUs of one
node (Megatron-style tensor parallelism: column- then row-parallel linears, two all-reduces per
block); `gpus / tp` replicas serve independent requests. Each replica runs batches of `batch`
sequences of `input_len` prompt tokens and `output_len` generated tokens:

- prefill: one forward over the batch's `batch x input_len` prompt tokens, which also yields
  each sequence's first output token. Its matmuls run at the GPU's calibrated GEMM efficiency
  (`Calibration.gemm_efficiency_at`, FP8 GEMMs at `fp8_gemm_efficiency_at`), the causal
  attention core (half of QK^T and AV) at `attention_efficiency` of the bf16 peak. Time =
  max(compute, HBM traffic) + the tensor-parallel all-reduces.
- decode: `output_len - 1` steps of one token per sequence. Each step reads every weight of the
  GPU's shard once and each sequence's KV cache at its current context (the mean over the
  output, `input_len + output_len / 2`, is taken for every step), at the calibrated streaming
  bandwidth (`hbm_efficiency` x the datasheet HBM bandwidth). Time = max(HBM traffic, compute)
  + the all-reduces.
- the batch is bounded by memory: what is left of HBM after the weights and a reserve
  (`reserve`, a fraction of HBM held back for activations, the CUDA context and the allocator)
  holds `batch` KV caches of `input_len + output_len` tokens each. Grouped-query attention is
  counted through the model's `n_kv_heads`: one token's cache is 2 x n_layers x n_kv_heads x
  head_dim values, and tensor parallelism splits the KV heads (replicates them when tp exceeds
  n_kv_heads).
- all-reduce: `plan.collectives.collective` on the node's scale-up link (the catalog's
  alpha-beta figures), of `tokens x dim` activations in bf16, twice per block; not overlapped
  with compute.
- the roofline regime of each phase is its arithmetic intensity (FLOPs per byte of HBM traffic)
  against the GPU's ridge point (`GPU.ridge_point`, as in plan/roofline.py): compute-bound at or
  above it, memory-bound below.

Tokens per second counts generated tokens for all replicas: `gpus/tp x batch x output_len /
(prefill + (output_len - 1) x decode step)`. Static batches are assumed (a batch's sequences
start and end together); an in-flight (continuous) batching server overlaps the phases of
different requests, which this model does not. Weights are `num_params x` 2 bytes (bf16) or 1
byte (fp8), the KV cache is stored in the same precision, and every weight (embedding and output
projection included, vocabulary-parallel) is split evenly over the tp GPUs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GPU, Catalog, Node, default_catalog
from llmscale.model.config import ModelConfig
from llmscale.plan.collectives import Fabric, collective

InferPrecision = Literal["bf16", "fp8"]
INFER_PRECISIONS: tuple[InferPrecision, ...] = get_args(InferPrecision)
# Bytes per weight and per KV-cache value in each serving precision (fp8: an FP8 KV cache too).
VALUE_BYTES: dict[str, int] = {"bf16": 2, "fp8": 1}
# Activations all-reduced between tensor-parallel GPUs stay in bf16 under FP8 weights.
ACTIVATION_BYTES = 2
# vLLM's default gpu_memory_utilization is 0.9 (docs.vllm.ai, engine arguments): 10% held back.
DEFAULT_RESERVE = 0.10
RESERVE_SOURCE = (
    "vLLM's default gpu_memory_utilization = 0.9 (docs.vllm.ai, engine arguments): 10% of HBM "
    "held back for activations, the CUDA context, graphs and the allocator"
)
ASSUMPTIONS = (
    "static batches: the batch's sequences are prefilled together, then decoded together "
    "(no in-flight batching overlap)",
    "prefill yields the first output token; decode runs output_len - 1 steps, each at the mean "
    "context input_len + output_len / 2",
    "weights and KV cache in the serving precision (bf16: 2 B, fp8: 1 B); tensor-parallel "
    "all-reduces of bf16 activations, not overlapped with compute",
    "every weight split evenly over tp GPUs of one node; KV heads split over tp (replicated "
    "when tp > n_kv_heads); replicas = gpus / tp serve independent requests",
    f"memory held back: the reserve fraction of HBM ({RESERVE_SOURCE})",
    "achieved rates from the GPU's calibration in the catalog: GEMMs at gemm_efficiency_at "
    "(fp8_gemm_efficiency_at), attention at attention_efficiency, HBM at hbm_efficiency",
)


@dataclass(frozen=True)
class Phase:
    """One phase's work on one GPU, its time and its roofline regime."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    ridge: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.flops / self.bytes

    @property
    def bound(self) -> str:
        """Roofline regime: compute-bound at or above the ridge point, else memory-bound."""
        return "compute-bound" if self.intensity >= self.ridge else "memory-bound"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(seconds=self.seconds, intensity=self.intensity, bound=self.bound)
        return d


@dataclass(frozen=True, kw_only=True)
class ServingPrediction:
    """What one serving layout does: batch, memory, each phase, throughput."""

    model: str
    gpu: str
    gpus: int
    tp: int
    input_len: int
    output_len: int
    precision: str
    reserve: float
    batch: int
    max_batch: int
    weight_bytes_per_gpu: float
    kv_cache_bytes_per_sequence: int
    kv_cache_bytes_per_sequence_per_gpu: int
    kv_budget_bytes_per_gpu: float
    prefill: Phase
    decode: Phase

    @property
    def replicas(self) -> int:
        return self.gpus // self.tp

    @property
    def prefill_s(self) -> float:
        return self.prefill.seconds

    @property
    def decode_s_per_token(self) -> float:
        return self.decode.seconds

    @property
    def batch_seconds(self) -> float:
        """One batch from its first prefill FLOP to its last token."""
        return self.prefill_s + (self.output_len - 1) * self.decode_s_per_token

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of all replicas together."""
        return self.replicas * self.batch * self.output_len / self.batch_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": self.gpu,
            "gpus": self.gpus,
            "tp": self.tp,
            "replicas": self.replicas,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "precision": self.precision,
            "reserve": self.reserve,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s / self.gpus,
            "batch": self.batch,
            "max_batch": self.max_batch,
            "weight_bytes_per_gpu": self.weight_bytes_per_gpu,
            "kv_cache_bytes_per_sequence": self.kv_cache_bytes_per_sequence,
            "kv_cache_bytes_per_sequence_per_gpu": self.kv_cache_bytes_per_sequence_per_gpu,
            "kv_budget_bytes_per_gpu": self.kv_budget_bytes_per_gpu,
            "prefill_s": self.prefill_s,
            "decode_s_per_token": self.decode_s_per_token,
            "batch_s": self.batch_seconds,
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "assumptions": list(ASSUMPTIONS),
        }


# ---- the arithmetic ---------------------------------------------------------------------------


def kv_heads_per_gpu(model: ModelConfig, tp: int) -> int:
    """KV heads one GPU holds: n_kv_heads / tp, or one (replicated) when tp > n_kv_heads."""
    return max(1, model.n_kv_heads // tp)


def kv_bytes_per_token(model: ModelConfig, precision: str, tp: int = 1) -> int:
    """KV-cache bytes of one token on one of `tp` GPUs: K and V, every layer, its KV heads."""
    heads = kv_heads_per_gpu(model, tp)
    return 2 * model.n_layers * heads * model.head_dim * VALUE_BYTES[precision]


def weight_bytes_per_gpu(model: ModelConfig, precision: str, tp: int) -> float:
    return model.num_params() * VALUE_BYTES[precision] / tp


def kv_budget_bytes(gpu: GPU, model: ModelConfig, precision: str, tp: int, reserve: float) -> float:
    """HBM of one GPU left for the KV cache: capacity x (1 - reserve) - its weight shard."""
    return gpu.memory_bytes * (1.0 - reserve) - weight_bytes_per_gpu(model, precision, tp)


def max_batch(
    gpu: GPU, model: ModelConfig, precision: str, tp: int, seq: int, reserve: float
) -> int:
    """Sequences of `seq` tokens whose KV caches fit next to the weights (0: none fit)."""
    budget = kv_budget_bytes(gpu, model, precision, tp, reserve)
    per_seq = kv_bytes_per_token(model, precision, tp) * seq
    return max(0, math.floor(budget / per_seq))


def _matmul_weights(model: ModelConfig) -> int:
    """Weights every token multiplies: the blocks' linears (the head is counted apart)."""
    return model.n_layers * (model.attention_weights() + model.mlp_weights())


def _gemm_rate(gpu: GPU, precision: str, m: float, n: float, k: float) -> float:
    cal = gpu.calibration
    if precision == "fp8":
        return gpu.peak_flops("fp8") * cal.fp8_gemm_efficiency_at(m, n, k)
    return gpu.peak_flops("bf16") * cal.gemm_efficiency_at(m, n, k)


def _all_reduces(model: ModelConfig, tokens: float, tp: int, fabric: Fabric) -> float:
    """Two all-reduces per block of `tokens x dim` bf16 activations over the tp GPUs."""
    if tp == 1:
        return 0.0
    nbytes = tokens * model.dim * ACTIVATION_BYTES
    return 2 * model.n_layers * collective("all_reduce", nbytes, tp, tp, fabric).seconds


def _phase(
    gpu: GPU,
    model: ModelConfig,
    precision: str,
    tp: int,
    fabric: Fabric,
    *,
    tokens: float,
    linear_flops: float,
    attention_flops: float,
    hbm_bytes: float,
) -> Phase:
    """`tokens` rows through the model on one of tp GPUs (FLOPs and bytes already per GPU)."""
    rate = _gemm_rate(gpu, precision, tokens, model.ffn_dim / tp, model.dim)
    attn_rate = gpu.peak_flops("bf16") * gpu.calibration.attention_efficiency.value
    compute = linear_flops / rate + attention_flops / attn_rate
    memory = hbm_bytes / (gpu.hbm_bandwidth * gpu.calibration.hbm_efficiency.value)
    return Phase(
        flops=linear_flops + attention_flops,
        bytes=hbm_bytes,
        compute_s=compute,
        memory_s=memory,
        comm_s=_all_reduces(model, tokens, tp, fabric),
        ridge=gpu.ridge_point(precision),
    )


def prefill_phase(
    gpu: GPU, model: ModelConfig, precision: str, tp: int, fabric: Fabric, batch: int, inp: int
) -> Phase:
    """One forward over `batch x inp` prompt tokens; logits for each sequence's last token."""
    tokens = batch * inp
    linear = 2.0 * _matmul_weights(model) * tokens + 2.0 * model.vocab_size * model.dim * batch
    # Causal QK^T and AV: 2 x (2 x inp^2 x dim) per layer and sequence, half of it masked.
    attention = 2.0 * model.n_layers * inp * inp * model.dim * batch
    hbm = weight_bytes_per_gpu(model, precision, tp)
    hbm += tokens * kv_bytes_per_token(model, precision, tp)  # the KV cache written
    return _phase(
        gpu, model, precision, tp, fabric,
        tokens=tokens, linear_flops=linear / tp, attention_flops=attention / tp, hbm_bytes=hbm,
    )  # fmt: skip


def decode_phase(
    gpu: GPU, model: ModelConfig, precision: str, tp: int, fabric: Fabric, batch: int, ctx: float
) -> Phase:
    """One decode step: one new token for each of `batch` sequences with `ctx` cached tokens."""
    linear = 2.0 * (_matmul_weights(model) + model.vocab_size * model.dim) * batch
    attention = 4.0 * model.n_layers * ctx * model.dim * batch  # QK^T and AV over the cache
    hbm = weight_bytes_per_gpu(model, precision, tp)
    hbm += batch * ctx * kv_bytes_per_token(model, precision, tp)  # the KV cache read
    return _phase(
        gpu, model, precision, tp, fabric,
        tokens=batch, linear_flops=linear / tp, attention_flops=attention / tp, hbm_bytes=hbm,
    )  # fmt: skip


# ---- checks and the layout --------------------------------------------------------------------


def _positive(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "a positive integer")
    return value


def tp_problem(model: ModelConfig, tp: int, node: Node) -> str:
    """Why `tp` cannot shard `model` on `node` ('' when it can)."""
    if tp > node.gpus_per_node:
        return f"<= {node.gpus_per_node} GPUs per node ({node.name}): tp runs inside one node"
    if model.n_heads % tp:
        return f"a divisor of n_heads={model.n_heads}"
    if model.n_kv_heads % tp and tp % model.n_kv_heads:
        return f"a divisor or a multiple of n_kv_heads={model.n_kv_heads}"
    return ""


def predict(
    model: ModelConfig,
    gpu: str,
    gpus: int,
    input_len: int,
    output_len: int,
    precision: str = "bf16",
    *,
    tp: int | None = None,
    batch: int | None = None,
    reserve: float = DEFAULT_RESERVE,
    model_name: str = "",
    catalog: Catalog | None = None,
) -> ServingPrediction:
    """The serving prediction; without `tp`, the tensor-parallel degree with the most tokens/s;
    without `batch`, the largest batch whose KV caches fit."""
    cat = catalog or default_catalog()
    g = cat.gpu(gpu)
    node = cat.node_for_gpu(gpu)
    _positive("gpus", gpus)
    _positive("input_len", input_len)
    _positive("output_len", output_len)
    if precision not in INFER_PRECISIONS:
        raise ConfigError("precision", precision, " | ".join(INFER_PRECISIONS))
    if precision == "fp8" and "fp8" not in g.dense_TFLOPS:
        raise ConfigError("precision", precision, f"bf16 ({g.name} has no FP8 peak)")
    if isinstance(reserve, bool) or not isinstance(reserve, float | int) or not 0 <= reserve < 1:
        raise ConfigError("reserve", reserve, "a fraction in [0, 1)")
    seq = input_len + output_len
    if seq > model.max_seq_len:
        raise ConfigError(
            "input_len + output_len", seq, f"<= the model's max_seq_len={model.max_seq_len}"
        )
    if batch is not None:
        _positive("batch", batch)
    if tp is not None:
        _positive("tp", tp)
        if gpus % tp:
            raise ConfigError("tp", tp, f"a divisor of gpus={gpus}")
        why = tp_problem(model, tp, node)
        if why:
            raise ConfigError("tp", tp, why)
        candidates = [tp]
    else:
        candidates = [
            t for t in range(1, gpus + 1) if not gpus % t and not tp_problem(model, t, node)
        ]
    fabric = Fabric.of(node, cat.link(node.scale_up), cat.link(node.nic))
    best: ServingPrediction | None = None
    too_small: list[str] = []
    for t in candidates:
        bound = max_batch(g, model, precision, t, seq, reserve)
        if bound < 1:
            too_small.append(str(t))
            continue
        if batch is not None and batch > bound:
            if tp is not None:
                raise ConfigError("batch", batch, f"<= {bound} (KV caches that fit at tp={t})")
            continue
        b = bound if batch is None else batch
        pred = ServingPrediction(
            model=model_name or f"{model.n_layers}-layer model",
            gpu=g.name,
            gpus=gpus,
            tp=t,
            input_len=input_len,
            output_len=output_len,
            precision=precision,
            reserve=float(reserve),
            batch=b,
            max_batch=bound,
            weight_bytes_per_gpu=weight_bytes_per_gpu(model, precision, t),
            kv_cache_bytes_per_sequence=kv_bytes_per_token(model, precision) * seq,
            kv_cache_bytes_per_sequence_per_gpu=kv_bytes_per_token(model, precision, t) * seq,
            kv_budget_bytes_per_gpu=kv_budget_bytes(g, model, precision, t, reserve),
            prefill=prefill_phase(g, model, precision, t, fabric, b, input_len),
            decode=decode_phase(g, model, precision, t, fabric, b, input_len + output_len / 2),
        )
        if best is None or pred.tokens_per_s > best.tokens_per_s:
            best = pred
    if best is None:
        if batch is not None and len(too_small) < len(candidates):
            raise ConfigError("batch", batch, "a batch whose KV caches fit at some tp")
        raise ConfigError(
            "gpus",
            gpus,
            f"enough {g.name} memory for the {precision} weights plus one sequence's KV cache "
            f"(tp tried: {', '.join(too_small) or 'none valid'})",
        )
    return best
