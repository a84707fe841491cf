"""LSP-Offload's learned sparse projectors (Chen et al., AAAI 2025, arXiv 2406.10181).

For one weight matrix W (m x n) a pair of sparse projectors P (d x m) and Q (d x n), count-sketch
style: column j of P has `s` non-zeros at fixed random rows `p_rows[j]` with trained values
`p_vals[j]` (the same for Q). The gradient G (m x n) is compressed to C = P G Qᵀ (d x d) on the
device, Adam runs on C on the host, and the host's update U (d x d) is decompressed to Pᵀ U Q
(m x n) on the device. The approximation: the update lives in the subspace the projectors span;
what leaves it is lost. Its measure is the relative reconstruction error
    err(G) = ||Pᵀ P G Qᵀ Q − G||_F / ||G||_F,
which `fit` minimises over the non-zero values (the rows stay fixed) by a few steps of Adam on the
device, from the gradient at hand (the paper trains the projectors on the current gradients with
gradient descent; the loss here is the squared error, so the scale of P and Q is free and only
the subspace and the reconstruction matter). Everything here is plain device arithmetic on
tensors: no copies to the host (the coordinator does those through its copiers).

When the projectors change from (P, Q) to (P', Q'), moments kept in the old coordinates move to
the new ones by the change of basis A = P' Pᵀ (d x d), B = Q Q'ᵀ (d x d): M' = A M B (since
M ≈ P G Qᵀ and G ≈ Pᵀ M Q), and the second moment, a mean of squares, by the element-wise squares
of the same maps: V' = (A∘A) V (B∘B) (exact when each new coordinate draws on one old one, and
non-negative always). `reproject_moments` does that on the host.

The per-step products use the sparsity: each is a weighted `embedding_bag` sum (`sketch`,
`sketch_t`: s multiply-adds per column and output column, not d), P's by its rows through the
regrouping `Projectors.bags` keeps. `compress_factors` compresses a linear layer's gradient from
its input and output gradient without forming it (`offload.lsp_linear`). The fit and the change
of basis, on checks only, use dense projectors (`dense`: autograd through the values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from llmscale.torch_internals import tensor_version

FIT_STEPS = 25  # Adam steps per fit on the non-zero values
FIT_LR = 0.25  # their learning rate, relative to the starting values' magnitude


ROW_DTYPE = torch.int32  # the projectors' row indices (d < 2**31; half the bytes of int64)


def sparse_rows(
    n_cols: int, d: int, s: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """For each of `n_cols` columns, `s` distinct rows of `d` drawn at random (int32, n_cols x s)."""
    keys = torch.rand((n_cols, d), generator=gen, device=device)
    return keys.argsort(dim=1)[:, :s].to(ROW_DTYPE).contiguous()


def sketch_values(
    n_cols: int, d: int, s: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Count-sketch values: random signs, scaled so that E[PᵀP] is d/k times the identity
    (k = n_cols: P P ᵀ is then about the identity, and the start is a random projection)."""
    signs = torch.randint(0, 2, (n_cols, s), generator=gen, device=device).float() * 2 - 1
    scale: float = (d / (n_cols * s)) ** 0.5
    return signs * scale


def dense(rows: torch.Tensor, vals: torch.Tensor, d: int) -> torch.Tensor:
    """The sparse projector as a dense d x k matrix (k = rows.shape[0]); differentiable in vals.

    For the fit (autograd through the values) and the change of basis, which run on checks
    only; a transient of d x k fp32. The per-step products use `sketch` and `sketch_t`.
    """
    out = vals.new_zeros((rows.shape[0], d))
    return out.scatter_(1, rows.long(), vals).t()  # (scatter takes int64 indices: a transient)


class RowBags(NamedTuple):
    """A count-sketch matrix P (d x k), held column by column (rows, vals: k x s), regrouped by
    its d rows (P in CSR form): row r's non-zeros are `weights[offsets[r]:offsets[r + 1]]` in
    columns `cols[...]` (the same slice). 8 B per non-zero and 4 B per row of P, kept on the
    device next to the projector (`Projectors.bags`: rebuilt when the rows or values are
    written, i.e. by a fit or a checkpoint load)."""

    cols: torch.Tensor  # ROW_DTYPE, k * s
    offsets: torch.Tensor  # ROW_DTYPE, d
    weights: torch.Tensor  # fp32, k * s: the values in that order


def row_bags(rows: torch.Tensor, vals: torch.Tensor, d: int) -> RowBags:
    flat = rows.reshape(-1)
    order = torch.argsort(flat, stable=True)
    cols = torch.div(order, rows.shape[1], rounding_mode="floor").to(ROW_DTYPE)
    counts = torch.bincount(flat, minlength=d)
    offsets = (counts.cumsum(0) - counts).to(ROW_DTYPE)
    return RowBags(cols, offsets, vals.reshape(-1)[order])


def sketch(bags: RowBags, x: torch.Tensor) -> torch.Tensor:
    """P X (d x n) for X (k x n, fp32): row r is the sum of P[r, j] X[j] over row r's non-zeros.

    One weighted `embedding_bag` (a gather-and-sum kernel, on the CPU and on CUDA): s k n
    multiply-adds, where the dense product takes d k n (d / s times as many).
    """
    return F.embedding_bag(bags.cols, x, bags.offsets, mode="sum", per_sample_weights=bags.weights)


def sketch_t(rows: torch.Tensor, vals: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pᵀ Y (k x n) for Y (d x n, fp32): row j is the sum of vals[j, i] Y[rows[j, i]] over i
    (fixed bags of s: `embedding_bag` again, s k n multiply-adds)."""
    return F.embedding_bag(rows, y, mode="sum", per_sample_weights=vals)


Pair = tuple[torch.Tensor, torch.Tensor]
# A fit's objective at values (p_vals, q_vals): the squared relative error (0-d) and, when asked,
# its gradients with respect to both (else an empty sequence).
LossAndGrads = tuple[torch.Tensor, Sequence[torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor, bool], LossAndGrads]


def compress_with(p_bags: RowBags, q_bags: RowBags, g: torch.Tensor) -> torch.Tensor:
    """P G Qᵀ (d x d, fp32): P G by rows of G, then Q (P G)ᵀ, transposed.

    With `p_bags` those of P's columns [a, b) (a row block of the matrix) and G that block's
    rows, the block's part of the sum P G Qᵀ (`offload.lsp_shard`).
    """
    pg = sketch(p_bags, g.float().contiguous())  # d x n
    return sketch(q_bags, pg.t().contiguous()).t().contiguous()


def decompress_with(p: Pair, q: Pair, u: torch.Tensor) -> torch.Tensor:
    """Pᵀ U Q (m x n, fp32) from (rows, vals) pairs: U Q = (Qᵀ Uᵀ)ᵀ, then Pᵀ (U Q). With p
    a row block's (rows, vals), that block's rows of Pᵀ U Q."""
    uq = sketch_t(*q, u.float().t().contiguous()).t().contiguous()  # d x n
    return sketch_t(*p, uq)


def fp32_transposed(t: torch.Tensor) -> torch.Tensor:
    """tᵀ, contiguous, in fp32 (one copy, whatever t's dtype)."""
    out = torch.empty((t.shape[1], t.shape[0]), dtype=torch.float32, device=t.device)
    return out.copy_(t.t())


def apply_update(w: torch.Tensor, update: torch.Tensor, decay: float) -> None:
    """W <- decay x W + update, in place, in one pass computed in fp32 (a 16-bit W is rounded
    once, at the end)."""
    torch.add(update, w, alpha=decay, out=w)


@dataclass(eq=False)
class Projectors:
    """P (d x m) and Q (d x n) of one matrix, on the device: fixed rows, trained values."""

    d: int
    p_rows: torch.Tensor  # m x s, int32 (ROW_DTYPE)
    p_vals: torch.Tensor  # m x s, fp32
    q_rows: torch.Tensor  # n x s
    q_vals: torch.Tensor  # n x s
    _bags: dict[tuple[str, int, int], tuple[tuple[int, ...], RowBags]] = field(
        default_factory=dict, init=False, repr=False
    )

    @classmethod
    def new(cls, m: int, n: int, d: int, s: int, seed: int, device: torch.device) -> Projectors:
        """Count-sketch projectors for an m x n matrix, drawn from their own generator (`seed`)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return cls(
            d,
            sparse_rows(m, d, s, gen, device),
            sketch_values(m, d, s, gen, device),
            sparse_rows(n, d, s, gen, device),
            sketch_values(n, d, s, gen, device),
        )

    @property
    def p(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.p_rows, self.p_vals

    @property
    def q(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_rows, self.q_vals

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state a checkpoint keeps (the tensors themselves: a load writes into them)."""
        return {
            "lsp_p_rows": self.p_rows,
            "lsp_p_vals": self.p_vals,
            "lsp_q_rows": self.q_rows,
            "lsp_q_vals": self.q_vals,
        }

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def bags(self, which: str, start: int = 0, stop: int | None = None) -> RowBags:
        """P (`which` "p") or Q ("q") regrouped by rows, or the columns [start, stop) of P;
        built on first use and kept while the rows and values stay the same tensors, unwritten
        (a fit or a checkpoint load writes them in place: their versions change)."""
        rows, vals = (self.p_rows, self.p_vals) if which == "p" else (self.q_rows, self.q_vals)
        stop = rows.shape[0] if stop is None else stop
        stamp = tuple(f(t) for t in (rows, vals) for f in (Tensor.data_ptr, tensor_version))
        hit = self._bags.get((which, start, stop))
        if hit is None or hit[0] != stamp:
            built = row_bags(rows[start:stop], vals[start:stop], self.d)
            hit = self._bags[(which, start, stop)] = (stamp, built)
        return hit[1]

    @property
    def bags_nbytes(self) -> int:
        """Device bytes of the regrouped projectors built so far."""
        return sum(t.nbytes for _, bags in self._bags.values() for t in bags)

    def compress(self, g: torch.Tensor) -> torch.Tensor:
        return compress_with(self.bags("p"), self.bags("q"), g)

    def decompress(self, u: torch.Tensor) -> torch.Tensor:
        return decompress_with(self.p, self.q, u)

    def compress_factors(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """P G Qᵀ for the weight gradient G = dYᵀ X of a linear layer (X: T x n, dY: T x m),
        without forming G: (P dYᵀ) (Q Xᵀ)ᵀ (`offload.lsp_linear`)."""
        a = sketch(self.bags("p"), fp32_transposed(dy))  # d x T
        b = sketch(self.bags("q"), fp32_transposed(x))  # d x T
        return a @ b.t()

    def relative_error(self, g: torch.Tensor) -> torch.Tensor:
        """||Pᵀ P G Qᵀ Q − G|| / ||G|| (a 0-d fp32 tensor on the device)."""
        g = g.float()
        r = self.decompress(self.compress(g))
        err: torch.Tensor = (r - g).norm() / g.norm().clamp_min(torch.finfo(torch.float32).tiny)
        return err

    @torch.no_grad()
    def fit(
        self, g: torch.Tensor, steps: int = FIT_STEPS, lr: float = FIT_LR
    ) -> list[torch.Tensor]:
        """Train the non-zero values on gradient `g` to lower err(g), in place.

        Adam on (p_vals, q_vals) for `steps` steps of the squared relative error; the best values
        seen are kept (never worse than the start). Returns err(g) before each step and after
        the last (0-d device tensors). A zero or non-finite `g` gives NaN errors, which are never
        better: the values stay as they were. (No value is read on the host here: the device
        runs on without waiting, and the coordinator copies what it needs through its copiers.)
        """
        g = g.detach().float()
        gn2 = (g * g).sum()

        def loss(vp: torch.Tensor, vq: torch.Tensor, grads: bool) -> LossAndGrads:
            with torch.enable_grad():
                vp, vq = vp.requires_grad_(grads), vq.requires_grad_(grads)
                pd, qd = dense(self.p_rows, vp, self.d), dense(self.q_rows, vq, self.d)
                r = pd.t() @ (pd @ g @ qd.t()) @ qd
                sq_err = ((r - g) ** 2).sum() / gn2
                return sq_err.detach(), torch.autograd.grad(sq_err, [vp, vq]) if grads else ()

        return fit_values(self, loss, steps, lr)

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.p_vals.clone(), self.q_vals.clone()

    def change_of_basis(
        self, old: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A = P' Pᵀ and B = Q Q'ᵀ (d x d each) from the old values `old` to the current ones."""
        a = dense(self.p_rows, self.p_vals, self.d) @ dense(self.p_rows, old[0], self.d).t()
        b = dense(self.q_rows, old[1], self.d) @ dense(self.q_rows, self.q_vals, self.d).t()
        return a, b  # P' Pᵀ, Q Q'ᵀ


@torch.no_grad()
def fit_values(proj: Projectors, loss: LossFn, steps: int, lr: float) -> list[torch.Tensor]:
    """Adam on `proj`'s non-zero values for `steps` steps of `loss`, keeping the best values
    seen (never worse than the start), written into `proj` in place. Returns err before each
    step and after the last (0-d device tensors). One loop for `Projectors.fit` (the whole
    gradient in one process) and the row-sharded fit (offload/lsp_shard.py: the same objective
    summed over ranks), so both train the values alike."""
    vals = [proj.p_vals.clone(), proj.q_vals.clone()]
    m, n, s = proj.p_rows.shape[0], proj.q_rows.shape[0], proj.p_rows.shape[1]
    lrs = [lr * (proj.d / (m * s)) ** 0.5, lr * (proj.d / (n * s)) ** 0.5]
    # Adam by hand (torch.optim's first use imports seconds of machinery)
    mom = [torch.zeros_like(v) for v in vals]
    sq = [torch.zeros_like(v) for v in vals]
    best = (vals[0].clone(), vals[1].clone())
    best_loss = torch.full((), float("inf"), device=vals[0].device)
    trace: list[torch.Tensor] = []
    for it in range(steps + 1):
        value, grads = loss(vals[0], vals[1], it < steps)
        vals = [v.detach() for v in vals]
        trace.append(value.sqrt())
        better = value < best_loss
        best_loss = torch.where(better, value, best_loss)
        best = (torch.where(better, vals[0], best[0]), torch.where(better, vals[1], best[1]))
        for i, gr in enumerate(grads):
            mom[i].mul_(0.9).add_(gr, alpha=0.1)
            sq[i].mul_(0.999).addcmul_(gr, gr, value=0.001)
            mhat = mom[i] / (1 - 0.9 ** (it + 1))
            vhat = sq[i] / (1 - 0.999 ** (it + 1))
            vals[i] = vals[i] - lrs[i] * mhat / (vhat.sqrt() + 1e-12)
    proj.p_vals.copy_(best[0])
    proj.q_vals.copy_(best[1])
    return trace


def reproject_moments(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> None:
    """Moments into the new subspace, in place: M' = A M B, V' = (A∘A) V (B∘B)."""
    exp_avg.copy_(a @ exp_avg @ b)
    exp_avg_sq.copy_((a * a) @ exp_avg_sq @ (b * b))


class LspSettings(NamedTuple):
    """`[optimizer] lsp_*` as the coordinator reads them."""

    dim: int = 512
    nonzeros: int = 16
    refit_threshold: float = 0.2
    check_every: int = 50
    seed: int = 0


@dataclass(eq=False)
class LspSlot:
    """One matrix's LSP-Offload state besides its host moments (`host_adam.HostSlot`)."""

    proj: Projectors  # on the device
    update_device: torch.Tensor  # d x d fp32 on the device: where the host's update lands
    update_host: torch.Tensor  # d x d fp32 on the host: -lr x Adam's direction, uploaded
    error: torch.Tensor  # 0-d fp32 on the host: the last measured reconstruction error
    decay: float = 1.0  # 1 - lr x weight_decay, applied with the pending update
    pending: bool = False  # an uploaded update not yet applied to the weight (training thread)

    @torch.no_grad()
    def apply(self, weight: torch.Tensor) -> None:
        """W <- decay x W + Pᵀ U Q, on the device (the decoupled weight decay, then the step)."""
        apply_update(weight, self.proj.decompress(self.update_device), self.decay)
        self.pending = False

    def state(self) -> dict[str, torch.Tensor]:
        return {**self.proj.tensors(), "lsp_error": self.error}
