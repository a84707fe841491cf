"""Roofline: arithmetic intensity of a training step and of decoding, against a GPU's ridge point.

Ridge point = dense peak FLOP/s / HBM bytes/s: a kernel (or a whole step) doing more FLOPs per
byte of HBM traffic than that is compute-bound, fewer is memory-bound (Williams, Waterman &
Patterson, "Roofline", CACM 2009).

Training step (one GPU's view of `batch` sequences of `seq` tokens; parallelism divides FLOPs
and bytes alike, so the ratio is the model's):
  FLOPs = ModelConfig.train_flops_per_token(seq) x batch x seq
  bytes = weights read in forward and twice in backward in the working dtype (3 x 2 B, bf16),
          + AdamW's 28 B per parameter once per step (fp32 read p, g, m, v; write p, m, v),
          + (fwd_passes + bwd_passes) x the activations the blocks save (plan/activations.py),
          + the head's traffic as the time model counts it (`activations.head_traffic`: the
            cross-entropy by its kernels' bytes)
  against the peak the linears run at (`time.matmul_peak_dtype`: the FP8 peak under fp8, the
  FP4 peak under nvfp4)
Decode step (one new token for each of `batch` sequences with `seq` tokens of context):
  FLOPs = 2 x (matmul weights) x batch + 4 x n_layers x seq x dim x batch (QK^T and AV)
  bytes = every weight once (2 B) + the KV cache, 2 x n_layers x seq x kv_dim x 2 B per sequence
  against the bf16 peak (fp16's, fp32's for those precisions)
"""

from __future__ import annotations

from dataclasses import dataclass

from llmscale.config import DTYPE_BYTES, Precision
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GPU
from llmscale.model.config import ModelConfig
from llmscale.plan import activations as act
from llmscale.plan.time import DEFAULT_TIME, TimeParams, matmul_peak_dtype, work_peak_dtype


@dataclass(frozen=True)
class Roofline:
    """One workload against one GPU."""

    workload: str
    flops: float
    bytes: float
    peak_flops: float
    hbm_bandwidth: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.flops / self.bytes

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.hbm_bandwidth

    @property
    def bound(self) -> str:
        return "compute-bound" if self.intensity >= self.ridge else "memory-bound"

    @property
    def attainable_flops(self) -> float:
        """min(peak, intensity x bandwidth): the roof over this intensity."""
        return min(self.peak_flops, self.intensity * self.hbm_bandwidth)


def _check(batch: int, seq: int, model: ModelConfig) -> None:
    for name, v in (("batch", batch), ("seq", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(name, v, "a positive integer")
    if seq > model.max_seq_len:
        raise ConfigError("seq", seq, model.seq_len_allowed())


def training(
    model: ModelConfig,
    gpu: GPU,
    batch: int = 1,
    seq: int | None = None,
    precision: Precision = "bf16",
    params: TimeParams = DEFAULT_TIME,
) -> Roofline:
    seq = model.max_seq_len if seq is None else seq
    _check(batch, seq, model)
    tokens = batch * seq
    flops = model.train_flops_per_token(seq) * tokens
    psi = model.num_params()
    wbytes = DTYPE_BYTES[precision]
    saved = model.n_layers * act.block_bytes(model, batch, seq, precision)
    traffic = 3 * wbytes * psi + params.optimizer_bytes_per_param * psi
    traffic += (params.fwd_passes + params.bwd_passes) * saved
    # the head as the time model moves it: its loss by its kernels' traffic
    traffic += sum(
        act.head_traffic(model, batch, seq, precision, 1, False, params.kernels,
                         params.fwd_passes, params.bwd_passes)
    )  # fmt: skip
    peak = gpu.peak_flops(matmul_peak_dtype(precision, params.fp32_matmul))
    return Roofline(
        f"training step, batch {batch} x seq {seq}", flops, traffic, peak, gpu.hbm_bandwidth
    )


def decode(
    model: ModelConfig, gpu: GPU, batch: int = 1, seq: int | None = None, precision: str = "bf16"
) -> Roofline:
    seq = model.max_seq_len if seq is None else seq
    _check(batch, seq, model)
    matmul_weights = model.n_layers * (model.attention_weights() + model.mlp_weights())
    matmul_weights += model.vocab_size * model.dim
    flops = batch * (2.0 * matmul_weights + 4.0 * model.n_layers * seq * model.dim)
    kv_cache = 2.0 * model.n_layers * seq * model.kv_dim * 2 * batch
    traffic = 2.0 * model.num_params() + kv_cache
    # bf16 weights and cache (2 B each, above): a low-precision training recipe decodes in bf16
    peak = gpu.peak_flops(work_peak_dtype(precision))
    return Roofline(
        f"decode, batch {batch}, context {seq}", flops, traffic, peak, gpu.hbm_bandwidth
    )


def decode_batch_at_ridge(model: ModelConfig, gpu: GPU, seq: int, precision: str = "bf16") -> float:
    """Decode batch above which decoding turns compute-bound (inf if the KV cache forbids it)."""
    one = decode(model, gpu, 1, seq, precision)
    # intensity(B) = B f / (W + B c): solve B f = ridge (W + B c) for B.
    w = 2.0 * model.num_params()
    c = one.bytes - w
    denom = one.flops - one.ridge * c
    return float("inf") if denom <= 0 else one.ridge * w / denom
