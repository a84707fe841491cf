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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

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
    return signs * (d / (n_cols * s)) ** 0.5


def dense(rows: torch.Tensor, vals: torch.Tensor, d: int) -> torch.Tensor:
    """The sparse projector as a dense d x k matrix (k = rows.shape[0]); differentiable in vals.

    Built for each use and dropped: a transient of d x k fp32, the layout matmuls want (a loop
    of s gathers and scatters is slower than one matmul at these sizes, on CPU and GPU).
    """
    out = vals.new_zeros((rows.shape[0], d))
    return out.scatter_(1, rows.long(), vals).t()  # (scatter takes int64 indices: a transient)


Pair = tuple[torch.Tensor, torch.Tensor]
# A fit's objective at values (p_vals, q_vals): the squared relative error (0-d) and, when asked,
# its gradients with respect to both (else an empty sequence).
LossAndGrads = tuple[torch.Tensor, Sequence[torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor, bool], LossAndGrads]


def compress_with(p: Pair, q: Pair, d: int, g: torch.Tensor) -> torch.Tensor:
    """P G Qᵀ (d x d) in fp32.

    The larger of G's dimensions is reduced first: (P G) Qᵀ costs d m n + d² n multiply-adds,
    P (G Qᵀ) d m n + d² m (a wide 256 x 768 matrix at d = 128: 22% fewer).
    """
    g = g.float()
    if g.shape[0] >= g.shape[1]:
        return (dense(*p, d) @ g) @ dense(*q, d).t()
    return dense(*p, d) @ (g @ dense(*q, d).t())


def _decompress_factors(p: Pair, q: Pair, d: int, u: torch.Tensor) -> Pair:
    """Two factors whose product is Pᵀ U Q, in the cheaper order: (Pᵀ U) and Q for m <= n
    (m d² + m d n multiply-adds), else Pᵀ and (U Q) (d² n + m d n)."""
    u = u.float()
    if p[0].shape[0] <= q[0].shape[0]:
        return dense(*p, d).t() @ u, dense(*q, d)
    return dense(*p, d).t(), u @ dense(*q, d)


def decompress_with(p: Pair, q: Pair, d: int, u: torch.Tensor) -> torch.Tensor:
    """Pᵀ U Q (m x n) in fp32."""
    left, right = _decompress_factors(p, q, d, u)
    return left @ right


def apply_update(p: Pair, q: Pair, d: int, u: torch.Tensor, w: torch.Tensor, decay: float) -> None:
    """W <- decay x W + Pᵀ U Q, in place. An fp32 W takes it in one fused `addmm_` (no m x n
    temporary, one pass over W); a 16-bit W gets the fp32 product rounded to its dtype."""
    left, right = _decompress_factors(p, q, d, u)
    if w.dtype == torch.float32:
        w.addmm_(left, right, beta=decay)
        return
    if decay != 1.0:
        w.mul_(decay)
    w.add_((left @ right).to(w.dtype))


def relative_error_with(p: Pair, q: Pair, d: int, g: torch.Tensor) -> torch.Tensor:
    """||Pᵀ P G Qᵀ Q − G|| / ||G|| (a 0-d fp32 tensor on the device)."""
    g = g.float()
    pd, qd = dense(*p, d), dense(*q, d)
    r = pd.t() @ (pd @ g @ qd.t()) @ qd
    return (r - g).norm() / g.norm().clamp_min(torch.finfo(torch.float32).tiny)


@dataclass(eq=False)
class Projectors:
    """P (d x m) and Q (d x n) of one matrix, on the device: fixed rows, trained values."""

    d: int
    p_rows: torch.Tensor  # m x s, int32 (ROW_DTYPE)
    p_vals: torch.Tensor  # m x s, fp32
    q_rows: torch.Tensor  # n x s
    q_vals: torch.Tensor  # n x s

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

    def compress(self, g: torch.Tensor) -> torch.Tensor:
        return compress_with(self.p, self.q, self.d, g)

    def decompress(self, u: torch.Tensor) -> torch.Tensor:
        return decompress_with(self.p, self.q, self.d, u)

    def relative_error(self, g: torch.Tensor) -> torch.Tensor:
        return relative_error_with(self.p, self.q, self.d, g)

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
        p = self.proj
        apply_update(p.p, p.q, p.d, self.update_device, weight, self.decay)
        self.pending = False

    def state(self) -> dict[str, torch.Tensor]:
        return {**self.proj.tensors(), "lsp_error": self.error}
