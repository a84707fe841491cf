"""Bytes moved between device and host per optimizer step, per offload mode (one pipeline rank).

The runtime's metrics row carries `offload_bytes_moved`: both directions, one step, one rank.
What moves is a function of the offload mode, the parameters the rank holds (TP-local, FSDP
shard), the working dtype and the micro-batches per step; this module writes it down once, and
`plan.predict.expected_runtime_metrics` reports it next to the other byte keys. The tests compare
it with the runtime's count (tests/offload/test_bytes_moved.py): they are equal, not close.

- `none`: 0.
- `optimizer` (ZeRO-Offload, offload/adamw.py): every parameter's gradient goes down in the
  working dtype once per micro-step (once per step under data parallelism, where FSDP2/replicate
  run the gradient hooks on the last micro-step only, on the rank's shard), and every updated
  parameter comes back up once per step.
- `optimizer+params` in one process (offload/params.py): gradients go down as above; nothing is
  uploaded by the update (it writes the host copies), but every unit (embedding, each block,
  head) is fetched before its forward in every micro-step, and again before its backward except
  the last unit (held from its forward to its backward) and a tied embedding (kept from its
  forward to its gradient). Modelled without pipelining (under a pipeline schedule warm-up
  forwards release the held unit: `None`, not modelled).
- `optimizer+params` under data parallelism is FSDP2's `CPUOffloadPolicy`, whose copies FSDP2
  makes itself; the runtime computes them from what FSDP2 copies
  (`offload.engine.fsdp_cpu_offload_bytes`): each all-gather copies the fp32 padded shard up
  (every unit, the root's embedding, norm and head included, twice per micro-step under
  zero_stage 3 with dp_shard > 1, as llmscale passes reshard_after_forward=True to each; once
  otherwise), and the fp32 gradient shard comes down once per step.

Modes are looked up in `TRAFFIC` (mode -> function of plan, rank, kernels): a new offload mode
adds its function there.

Approximations: a step the fp16 loss scaler skips uploads nothing (predicted as not skipped); the
rank-0 shard is the padded one (equal to rank 0's unpadded shard unless a dimension is smaller
than the shard count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmscale.config import DTYPE_BYTES
from llmscale.plan import activations as act
from llmscale.plan.lsp import lsp_bytes_per_step
from llmscale.plan.memory import plan_rank_params
from llmscale.plan.params import RankParams
from llmscale.plan.plan import Plan


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Bytes one rank copies in one optimizer step, by direction."""

    down: float  # device to host
    up: float  # host to device

    @property
    def total(self) -> float:
        return self.down + self.up


TrafficFn = Callable[[Plan, int, act.Kernels], "Traffic | None"]


def _none(plan: Plan, rank: int, kernels: act.Kernels) -> Traffic:
    return Traffic(down=0.0, up=0.0)


def _grads_down(plan: Plan, rp: RankParams) -> float:
    """The gradients' downloads: per micro-step, or once per step on the shard under dp."""
    pb = DTYPE_BYTES[plan.precision]
    if plan.dp > 1:
        return float(pb * rp.shard_numel)
    return float(pb * rp.numel * plan.n_microbatches)


def _optimizer(plan: Plan, rank: int, kernels: act.Kernels) -> Traffic:
    rp = plan_rank_params(plan, rank, kernels)
    pb = DTYPE_BYTES[plan.precision]
    local = rp.shard_numel if plan.dp > 1 else rp.numel
    return Traffic(down=_grads_down(plan, rp), up=float(pb * local))


def _optimizer_params(plan: Plan, rank: int, kernels: act.Kernels) -> Traffic | None:
    if plan.fsdp_cpu_offload:
        return fsdp_cpu_offload_traffic(plan, rank, kernels)
    if plan.pp > 1:
        return None
    rp = plan_rank_params(plan, rank, kernels)
    assert rp.embedding is not None and rp.head is not None  # one stage holds them all
    pb = DTYPE_BYTES[plan.precision]
    tied = plan.model.tie_embeddings
    forward = rp.numel
    # Backward refetches every unit but the last (the head, held) and a tied (kept) embedding.
    backward = rp.numel - rp.head.numel - (rp.embedding.numel if tied else 0)
    up = float(pb * (forward + backward) * plan.n_microbatches)
    return Traffic(down=_grads_down(plan, rp), up=up)


def fsdp_cpu_offload_traffic(plan: Plan, rank: int, kernels: act.Kernels) -> Traffic:
    """FSDP2's CPUOffloadPolicy: fp32 shards up at every all-gather, fp32 gradients down once."""
    rp = plan_rank_params(plan, rank, kernels)
    gathers = 2 if plan.dp_shard > 1 and plan.zero_stage == 3 else 1
    up = 4.0 * gathers * rp.shard_numel * plan.n_microbatches
    return Traffic(down=4.0 * rp.shard_numel, up=up)


def _lsp(plan: Plan, rank: int, kernels: act.Kernels) -> Traffic | None:
    """LSP-Offload (one process, or data parallel: rank 0's FSDP2 shard): a steady step's
    bytes, the blocks' matrices as d x d compressed gradients and updates (`plan/lsp.py`). The
    first step (a fit), a check step and a refit move a few bytes more:
    `lsp_bytes_per_step(..., check=, fit=, refit=)`. Not modelled under TP, PP or CP (not served)."""
    if plan.tp * plan.pp * plan.cp > 1:
        return None
    t = lsp_bytes_per_step(
        plan.model,
        lsp_dim=plan.lsp_dim,
        lsp_nonzeros=plan.lsp_nonzeros,
        precision=plan.precision,
        n_microbatches=plan.n_microbatches,
        dp_replicate=plan.dp_replicate,
        dp_shard=plan.dp_shard,
    )
    return Traffic(down=float(t.down), up=float(t.up))


TRAFFIC: dict[str, TrafficFn] = {
    "none": _none,
    "optimizer": _optimizer,
    "optimizer+params": _optimizer_params,
    "lsp": _lsp,
}


def offload_traffic(plan: Plan, rank: int, kernels: act.Kernels) -> Traffic | None:
    """Bytes pipeline `rank` moves between device and host per step; None where not modelled."""
    fn = TRAFFIC.get(plan.offload)
    return fn(plan, rank, kernels) if fn is not None else None
