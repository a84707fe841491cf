"""LSP-Offload (`optimizer.offload = "lsp"`): which matrices go through projectors, their sizes,
and the bytes they hold and move. Torch-free; the runtime (`offload.adamw`) reads the same rules.

Model (exact for the runtime, `offload/lsp.py`, `offload/host_adam.py`):

- Every 2-D weight of a transformer block (`is_lsp_matrix`) of shape m x n gets projectors of
  d = min(lsp_dim, min(m, n) // 2) rows (at least 1) with s = min(lsp_nonzeros, d) non-zeros per
  column (`matrix_dims`). Everything else (embeddings, the head, norms, biases) takes the
  ZeRO-Offload path ("optimizer").
- Device, per LSP matrix: the projectors' rows (int32) and values (fp32), (m + n) s x 8 B; the
  same non-zeros regrouped by the projectors' rows for the sparse products (columns int32 and
  values fp32, (m + n) s x 8 B, and 2 d row offsets int32; under FSDP2 P's for the rank's rows
  only); and the d x d fp32 buffer the update lands in. The weight itself stays in the working
  dtype; there is no fp32 master anywhere (the device weight is the only copy). Transients (the
  compressed gradient, the transposed layer input and output gradient of the factored
  compression, the dense projectors while fitting) are not held.
- Host, per LSP matrix: moments 2 x 4 d² (+ the 4 B step counter), the fp32 gradient 4 d², the
  update buffer 4 d², and with accumulation a 4 d² transfer buffer (compressed gradients are
  fp32); the rest as "optimizer".
- Traffic per step (`lsp_bytes_per_step`): 4 d² down per micro-step and 4 d² up per LSP matrix;
  the ZeRO path's gradients down per micro-step and weights up, in the working dtype. A check
  step adds 4 B down per matrix (its error), a fit 4 B (the error after it), a refit with moments
  to move 2 x 4 d² (the change of basis).
- Under data parallelism (dp_shard and/or dp_replicate > 1; `offload/lsp_shard.py`) the numbers
  are per rank. FSDP2 and replicate run the gradient hooks once per step (on the last
  micro-step's reduced gradient), so everything "per micro-step" above happens once. The ZeRO
  path holds and moves the rank's FSDP2 shard (rank 0's: ceil(rows / dp_shard) rows, as
  `plan.params.shard_numel`); each LSP matrix's state is whole on every rank (the projectors,
  the d x d moments, gradient and update: the compressed gradient is all-reduced over the shard
  group on the device before it goes down), so its device and host bytes and its d x d traffic
  are the one-process ones; the weights are the rank's shard.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from llmscale.config import DTYPE_BYTES, Precision
from llmscale.model.config import ModelConfig

_BLOCK = re.compile(r"^(.*\.)?layers\.\d+\.")


def is_lsp_matrix(name: str, shape: Sequence[int]) -> bool:
    """Whether parameter `name` of `shape` goes through LSP projectors: a block's 2-D weight."""
    return len(shape) == 2 and _BLOCK.match(name) is not None and min(shape) >= 2


def matrix_dims(shape: Sequence[int], lsp_dim: int, lsp_nonzeros: int) -> tuple[int, int]:
    """(d, s) for an m x n matrix: d capped at half the smaller dimension, s at d."""
    d = max(1, min(lsp_dim, min(shape) // 2))
    return d, min(lsp_nonzeros, d)


def device_bytes(shape: Sequence[int], d: int, s: int, dp_shard: int = 1) -> int:
    """Projector rows (int32) and values (fp32) of P and Q; the same regrouped by rows for the
    products (columns int32, values fp32, d row offsets int32 each), P's for the rank's rows
    only (rank 0's ceil(m / dp_shard) under FSDP2); and the d x d update buffer."""
    m, n = shape
    held = min(m, -(-m // dp_shard))
    return (m + n) * s * (4 + 4) + (held + n) * s * (4 + 4) + 2 * d * 4 + 4 * d * d


def host_bytes(d: int, n_microbatches: int) -> dict[str, int]:
    """Host bytes of one LSP matrix by ledger key."""
    staging = 4 * d * d * (2 if n_microbatches > 1 else 1)  # update (+ transfer buffer)
    return {
        "host_optimizer_bytes": 8 * d * d + 4,
        "host_master_bytes": 0,
        "host_grad_bytes": 4 * d * d,
        "host_staging_bytes": staging,
    }


class LspSplit(NamedTuple):
    """A rank's parameters split between the projectors and the ZeRO path."""

    matrices: tuple[tuple[int, int], ...]  # shapes of the LSP matrices (whole)
    zero_numel: int  # elements on the ZeRO-Offload path (this rank's FSDP2 shard of them)
    zero_tensors: int
    matrix_numel: int = 0  # elements of the LSP matrices this rank holds (its shard of them)


def split(
    model: ModelConfig,
    layers: int,
    root: Sequence[tuple[str, tuple[int, ...]]],
    dp_shard: int = 1,
) -> LspSplit:
    """The LSP matrices of `layers` blocks and the rest (the block's others and `root`'s);
    the element counts are rank 0's FSDP2 shard over `dp_shard` ranks (ceil(rows / dp_shard))."""
    mats: list[tuple[int, int]] = []
    numel = tensors = held = 0
    block = model.parameter_shapes()["block"]
    for _ in range(layers):
        for name, shape in block:
            if is_lsp_matrix(name, shape):
                mats.append((shape[0], shape[1]))
                held += _shard_numel(shape, dp_shard)
            else:
                numel += _shard_numel(shape, dp_shard)
                tensors += 1
    for _, shape in root:
        numel += _shard_numel(shape, dp_shard)
        tensors += 1
    return LspSplit(tuple(mats), numel, tensors, held)


def one_process_split(model: ModelConfig, dp_shard: int = 1) -> LspSplit:
    """The split of the whole model on one process, or on one FSDP2 rank of `dp_shard`
    (rank 0's shard; lsp serves no TP, PP or CP)."""
    shapes = model.parameter_shapes()
    return split(model, model.n_layers, [*shapes["embedding"], *shapes["head"]], dp_shard)


def hooks_per_step(n_microbatches: int, dp_replicate: int = 1, dp_shard: int = 1) -> int:
    """Gradient hooks per parameter per step: once under data parallelism (FSDP2 and
    replicate reduce on the last micro-step only), else once per micro-step."""
    return 1 if dp_replicate * dp_shard > 1 else n_microbatches


class LspTraffic(NamedTuple):
    down: int  # device -> host bytes
    up: int  # host -> device bytes

    @property
    def total(self) -> int:
        return self.down + self.up


def lsp_bytes_per_step(
    model: ModelConfig,
    *,
    lsp_dim: int,
    lsp_nonzeros: int,
    precision: Precision,
    n_microbatches: int,
    check: bool = False,
    fit: bool = False,
    refit: bool = False,
    dp_replicate: int = 1,
    dp_shard: int = 1,
) -> LspTraffic:
    """Bytes copied each way in one step of offload "lsp" by one rank (rank 0 under FSDP2).

    `check`: the step measures each matrix's error (every `lsp_check_every` steps but the
    first); `fit`: the projectors are fitted (the first step, or a check over the threshold);
    `refit`: a fit after the first step, whose change of basis goes down too.
    """
    sp = one_process_split(model, dp_shard)
    pb = DTYPE_BYTES[precision]
    hooks = hooks_per_step(n_microbatches, dp_replicate, dp_shard)
    down = pb * sp.zero_numel * hooks
    up = pb * sp.zero_numel
    for shape in sp.matrices:
        d, _ = matrix_dims(shape, lsp_dim, lsp_nonzeros)
        down += 4 * d * d * hooks + 4 * (check + fit) + (8 * d * d if refit else 0)
        up += 4 * d * d
    return LspTraffic(down, up)


def host_adam_numel(
    model: ModelConfig, *, lsp_dim: int, lsp_nonzeros: int, dp_shard: int = 1
) -> int:
    """Elements the host's AdamW steps on in one step of offload "lsp" on one rank: the ZeRO
    path's (rank 0's FSDP2 shard) and a d x d subspace per LSP matrix."""
    sp = one_process_split(model, dp_shard)
    return sp.zero_numel + sum(
        matrix_dims(shape, lsp_dim, lsp_nonzeros)[0] ** 2 for shape in sp.matrices
    )


def lsp_memory(
    model: ModelConfig,
    *,
    lsp_dim: int,
    lsp_nonzeros: int,
    precision: Precision,
    n_microbatches: int,
    dp_replicate: int = 1,
    dp_shard: int = 1,
) -> dict[str, int]:
    """The runtime's ledger for offload "lsp" on one rank (rank 0 under FSDP2), by metrics key.

    `device_lsp_bytes` (projectors, update buffers), the host keys of both paths, and
    `param_bytes` (the rank's device weights in the working dtype).
    """
    sp = one_process_split(model, dp_shard)
    pb = DTYPE_BYTES[precision]
    hooks = hooks_per_step(n_microbatches, dp_replicate, dp_shard)
    staging = precision != "fp32" or hooks > 1
    row = {
        "host_optimizer_bytes": 8 * sp.zero_numel + 4 * sp.zero_tensors,
        "host_master_bytes": 4 * sp.zero_numel,
        "host_grad_bytes": 4 * sp.zero_numel,
        "host_staging_bytes": pb * sp.zero_numel if staging else 0,
        "device_lsp_bytes": 0,
        "param_bytes": pb * (sp.zero_numel + sp.matrix_numel),
    }
    for shape in sp.matrices:
        d, s = matrix_dims(shape, lsp_dim, lsp_nonzeros)
        row["device_lsp_bytes"] += device_bytes(shape, d, s, dp_shard)
        for k, v in host_bytes(d, hooks).items():
            row[k] += v
    return row


def _shard_numel(shape: Sequence[int], dp_shard: int) -> int:
    """Elements of rank 0's FSDP2 shard: ceil(rows / dp_shard) rows (`plan.params`' rule)."""
    n = -(-shape[0] // dp_shard)
    for x in shape[1:]:
        n *= x
    return n
