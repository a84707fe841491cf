"""LSP-Offload over FSDP2's row shards: the projector arithmetic of `offload.lsp`, summed over ranks.

Under FSDP2 (`parallel.dp_shard > 1`) each rank holds rows [a, b) of every weight W (dim-0
shards) and, after the reduce-scatter, the same rows G_r of the step's averaged gradient G. The
projectors P (d x m) and Q (d x n) are the whole matrix's, identical on every rank (same seed,
same fits). Everything LSP-Offload needs is a sum over the row blocks:

- compress: C = P G Qᵀ = Σ_r P[:, a:b] G_r Qᵀ. Each rank computes its d x d partial and one
  all-reduce (sum) over the shard group gives every rank the same C; every rank then runs the
  host Adam on it (replicated, deterministic: the moments are d x d, small by design);
- decompress: the rank's rows of Pᵀ U Q are P[:, a:b]ᵀ U Q: no communication;
- the relative reconstruction error: ||Pᵀ C Q − G||² and ||G||² are sums of per-row-block terms:
  one all-reduce of two scalars (after the one of C);
- fitting the non-zero values: the loss is that same sum; its gradient with respect to the
  values runs through C (shared by all ranks) and through each rank's own rows. Each rank
  backpropagates its own term, all-reduces the loss and the gradient with respect to C, pushes
  that through its partial of C, and one all-reduce of the values' gradients ((m + n) x s) gives
  every rank the full gradient: every rank takes the same Adam step on the same values.

All-reduce results are the same bits on every rank (gloo's and NCCL's reductions end in a
broadcast of one rank's sum), so the errors, the refit decisions and the fitted values agree
everywhere and the collectives stay matched. The arithmetic is the one-process one summed in
another order: a run equals the one-process run with the same global batch to float rounding.

Replicated dimensions (replicate, HSDP's outer dimension) need nothing: their ranks see the same
averaged gradient and repeat the same arithmetic. `shard_of` refuses any other placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmscale.offload.lsp import (
    FIT_LR,
    FIT_STEPS,
    LspSlot,
    Projectors,
    apply_update,
    compress_with,
    decompress_with,
    dense,
    fit_values,
)


@dataclass(frozen=True)
class RowShard:
    """Rows [start, stop) of an m-row matrix held here; `group` the ranks that hold the others."""

    start: int
    stop: int
    group: Any  # a ProcessGroup


def global_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole parameter's shape (a DTensor's `shape` is its global one)."""
    return tuple(param.shape)


def shard_of(param: torch.Tensor) -> RowShard | None:
    """This rank's row block of a parameter sharded on dim 0 over one mesh dimension (FSDP2);
    None when this rank holds it whole (a plain tensor, or only replicated placements).

    Raises ValueError for any other layout (TP's, or a dim-0 shard over two mesh dimensions):
    LSP-Offload does not serve it."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return None
    mesh = param.device_mesh  # type: ignore[attr-defined]
    sharded = [(i, pl) for i, pl in enumerate(placements) if not pl.is_replicate()]
    if not sharded:
        return None
    if len(sharded) > 1 or not sharded[0][1].is_shard(0):
        raise ValueError(f"lsp: a parameter placed {placements} (only dim-0 FSDP2 shards served)")
    dim = sharded[0][0]
    size, coord = mesh.size(dim), mesh.get_local_rank(dim)
    m = param.shape[0]
    chunk = -(-m // size)  # torch.chunk's, as FSDP2 shards
    start = min(coord * chunk, m)
    stop = min(start + chunk, m)
    local = param.to_local()  # type: ignore[attr-defined]
    if local.shape[0] != stop - start:
        raise ValueError(f"lsp: shard of {stop - start} rows expected, {local.shape[0]} held")
    return RowShard(start, stop, mesh.get_group(dim))


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


@dataclass(eq=False)
class ShardedProjectors:
    """One matrix's projectors seen from one row block: the `Projectors` methods that read the
    gradient or write the weight, on the rank's rows, with the sums over the shard group."""

    proj: Projectors
    rows: RowShard

    def _p_rows(self, vals: torch.Tensor) -> torch.Tensor:
        a, b = self.rows.start, self.rows.stop
        return dense(self.proj.p_rows[a:b], vals[a:b], self.proj.d)

    def _p_block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This block's columns of P: (rows, vals) of matrix rows [a, b)."""
        a, b = self.rows.start, self.rows.stop
        return self.proj.p_rows[a:b], self.proj.p_vals[a:b]

    def compress(self, g: torch.Tensor) -> torch.Tensor:
        """P G Qᵀ (d x d fp32) of the whole gradient, from this rank's rows `g`."""
        pr = self.proj
        c = compress_with(pr.bags("p", self.rows.start, self.rows.stop), pr.bags("q"), g)
        return _all_reduce(c, self.rows.group)

    def decompress(self, u: torch.Tensor) -> torch.Tensor:
        """This rank's rows of Pᵀ U Q."""
        return decompress_with(self._p_block(), self.proj.q, u)

    def relative_error(self, g: torch.Tensor) -> torch.Tensor:
        """||Pᵀ P G Qᵀ Q − G|| / ||G|| of the whole gradient (0-d, the same on every rank)."""
        g = g.float()
        r = self.decompress(self.compress(g))  # this rank's rows of the reconstruction
        sums = _all_reduce(torch.stack([((r - g) ** 2).sum(), (g * g).sum()]), self.rows.group)
        return sums[0].sqrt() / sums[1].sqrt().clamp_min(torch.finfo(torch.float32).tiny)

    def _loss(
        self, g: torch.Tensor, gn2: torch.Tensor, vp: torch.Tensor, vq: torch.Tensor, grads: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The whole matrix's squared relative error at values (vp, vq), and its gradient with
        respect to them (the same on every rank), or none with `grads=False`."""
        d, group = self.proj.d, self.rows.group
        with torch.enable_grad():
            vp, vq = vp.requires_grad_(grads), vq.requires_grad_(grads)
            pd, qd = self._p_rows(vp), dense(self.proj.q_rows, vq, d)
            partial = pd @ g @ qd.t()
            c = _all_reduce(partial.detach().clone(), group).requires_grad_(grads)
            r = pd.t() @ c @ qd
            own = ((r - g) ** 2).sum() / gn2
        if not grads:
            return _all_reduce(own.detach(), group), []
        gp, gq, gc = torch.autograd.grad(own, [vp, vq, c], retain_graph=True)
        buf = _all_reduce(torch.cat([own.detach().reshape(1), gc.reshape(-1)]), group)
        gp2, gq2 = torch.autograd.grad(partial, [vp, vq], grad_outputs=buf[1:].view(d, d))
        flat = _all_reduce(torch.cat([(gp + gp2).reshape(-1), (gq + gq2).reshape(-1)]), group)
        return buf[0], [flat[: vp.numel()].view_as(vp), flat[vp.numel() :].view_as(vq)]

    @torch.no_grad()
    def fit(
        self, g: torch.Tensor, steps: int = FIT_STEPS, lr: float = FIT_LR
    ) -> list[torch.Tensor]:
        """`Projectors.fit` on the whole gradient: the same Adam on the values, the same
        keep-the-best rule, from losses and gradients summed over the row blocks."""
        g = g.detach().float()
        gn2 = _all_reduce((g * g).sum(), self.rows.group)
        return fit_values(
            self.proj, lambda vp, vq, grads: self._loss(g, gn2, vp, vq, grads), steps, lr
        )

    @torch.no_grad()
    def apply(self, lsp: LspSlot, weight: torch.Tensor) -> None:
        """`LspSlot.apply` on this rank's rows: W_r <- decay x W_r + (Pᵀ U Q)_r."""
        apply_update(weight, self.decompress(lsp.update_device), lsp.decay)
        lsp.pending = False
