"""LSP-Offload's projectors (offload/lsp.py): the math against dense matrices, the fit, the
moments' change of basis, and the planner's sizes (plan/lsp.py)."""

from __future__ import annotations

import pytest
import torch

from llmscale.model.config import get_preset
from llmscale.offload.lsp import Projectors, apply_update, dense, reproject_moments
from llmscale.plan.lsp import (
    device_bytes,
    is_lsp_matrix,
    lsp_bytes_per_step,
    matrix_dims,
    one_process_split,
)

CPU = torch.device("cpu")


def _grad(m: int, n: int, rank: int = 3, seed: int = 0) -> torch.Tensor:
    """A gradient-like matrix: low rank plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(m, rank, generator=g) @ torch.randn(rank, n, generator=g)
    return low + 0.05 * torch.randn(m, n, generator=g)


def test_compress_and_decompress_are_the_dense_products() -> None:
    m, n, d, s = 48, 20, 8, 3
    pr = Projectors.new(m, n, d, s, seed=1, device=CPU)
    p, q = dense(pr.p_rows, pr.p_vals, d), dense(pr.q_rows, pr.q_vals, d)
    assert p.shape == (d, m) and q.shape == (d, n)
    # count-sketch: s non-zeros per column, at distinct rows
    assert ((p != 0).sum(0) == s).all() and ((q != 0).sum(0) == s).all()
    g, u = _grad(m, n), torch.randn(d, d)
    torch.testing.assert_close(pr.compress(g), p @ g @ q.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pr.decompress(u), p.T @ u @ q, rtol=1e-5, atol=1e-5)
    want = (p.T @ p @ g @ q.T @ q - g).norm() / g.norm()
    torch.testing.assert_close(pr.relative_error(g), want, rtol=1e-5, atol=0)
    # compressing is linear: the sum of micro-steps' compressions is the compressed sum
    g2 = _grad(m, n, seed=2)
    torch.testing.assert_close(pr.compress(g) + pr.compress(g2), pr.compress(g + g2))


@pytest.mark.parametrize("shape", [(48, 20), (20, 48), (24, 24)])
def test_the_sparse_kernels_and_the_apply_are_the_dense_products(shape) -> None:
    """The sparse kernels (embedding_bag) on wide, tall and square matrices, and the apply of
    the decay and the step into the weight (one pass in fp32): each against the dense
    reference."""
    (m, n), d, s = shape, 8, 3
    pr = Projectors.new(m, n, d, s, seed=4, device=CPU)
    p, q = dense(pr.p_rows, pr.p_vals, d), dense(pr.q_rows, pr.q_vals, d)
    g, u = _grad(m, n), torch.randn(d, d)
    torch.testing.assert_close(pr.compress(g), p @ g @ q.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pr.decompress(u), p.T @ u @ q, rtol=1e-5, atol=1e-5)
    w0 = torch.randn(m, n)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for decay in (1.0, 0.99):
            w = w0.to(dtype)
            want = (w.float() * decay + p.T @ u @ q).to(dtype)
            apply_update(w, pr.decompress(u), decay)
            torch.testing.assert_close(w, want, rtol=tol, atol=tol)


def test_rows_no_column_reaches_and_rewritten_rows_are_served() -> None:
    """A row of P that no column reaches sums nothing (an empty bag); rows written in place (a
    checkpoint load) or replaced rebuild the cached structure."""
    m, n, d, s = 6, 40, 16, 2  # 12 non-zeros of P over 16 rows: some rows stay empty
    pr = Projectors.new(m, n, d, s, seed=5, device=CPU)
    g, u = _grad(m, n), torch.randn(d, d)

    def check() -> None:
        p, q = dense(pr.p_rows, pr.p_vals, d), dense(pr.q_rows, pr.q_vals, d)
        torch.testing.assert_close(pr.compress(g), p @ g @ q.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pr.decompress(u), p.T @ u @ q, rtol=1e-5, atol=1e-5)

    check()
    other = Projectors.new(m, n, d, s, seed=6, device=CPU)
    pr.p_rows.copy_(other.p_rows)  # in place, as a load
    pr.p_vals.copy_(other.p_vals)
    check()
    pr.q_rows = other.q_rows.clone()  # a new tensor
    pr.q_vals = other.q_vals.clone()
    check()


def test_fitting_lowers_the_reconstruction_error() -> None:
    m, n, d, s = 96, 64, 16, 8
    pr = Projectors.new(m, n, d, s, seed=3, device=CPU)
    g = _grad(m, n)
    before = float(pr.relative_error(g))
    rows = pr.p_rows.clone(), pr.q_rows.clone()
    trace = [float(e) for e in pr.fit(g)]
    after = float(pr.relative_error(g))
    assert trace[0] == pytest.approx(before, rel=1e-5)
    assert before > 0.8  # a random sketch keeps little of a rank-3 gradient
    assert after < 0.5 * before
    assert after == pytest.approx(min(trace), rel=1e-5)  # the best values are kept
    # falls while fitting: the running minimum goes down, and the last third is below the first
    thirds = len(trace) // 3
    assert min(trace[-thirds:]) < min(trace[:thirds])
    assert torch.equal(pr.p_rows, rows[0]) and torch.equal(pr.q_rows, rows[1])  # rows fixed
    # a gradient the fit did not see, from the same low-rank subspace, is also reconstructed
    # better than by the random start
    g_rng = torch.Generator().manual_seed(0)
    low = torch.randn(m, 3, generator=g_rng) @ torch.randn(3, n, generator=g_rng)
    assert float(pr.relative_error(low)) < before


def test_a_zero_or_non_finite_gradient_leaves_the_projectors_alone() -> None:
    pr = Projectors.new(16, 12, 4, 2, seed=0, device=CPU)
    vals = pr.snapshot()
    bad = torch.full((16, 12), float("inf"))
    for g in (torch.zeros(16, 12), bad):
        assert all(torch.isnan(e) for e in pr.fit(g, steps=3))
    assert torch.equal(pr.p_vals, vals[0]) and torch.equal(pr.q_vals, vals[1])


def test_moments_move_by_the_change_of_basis() -> None:
    m, n, d, s = 40, 24, 8, 4
    pr = Projectors.new(m, n, d, s, seed=5, device=CPU)
    g = _grad(m, n)
    old = pr.snapshot()
    p0, q0 = dense(pr.p_rows, old[0], d), dense(pr.q_rows, old[1], d)
    pr.fit(g, steps=10)
    p1, q1 = dense(pr.p_rows, pr.p_vals, d), dense(pr.q_rows, pr.q_vals, d)
    a, b = pr.change_of_basis(old)
    torch.testing.assert_close(a, p1 @ p0.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, q0 @ q1.T, rtol=1e-5, atol=1e-6)
    # first moment: the old coordinates of G, moved, are P' (Pᵀ P G Qᵀ Q) Q'ᵀ
    m_old = p0 @ g @ q0.T
    v_old = m_old**2
    exp_avg, exp_avg_sq = m_old.clone(), v_old.clone()
    reproject_moments(exp_avg, exp_avg_sq, a, b)
    torch.testing.assert_close(exp_avg, p1 @ (p0.T @ m_old @ q0) @ q1.T, rtol=1e-4, atol=1e-4)
    assert (exp_avg_sq >= 0).all()


def test_the_second_moment_moves_as_the_variance_of_the_moved_coordinates() -> None:
    """V' = (A∘A) V (B∘B) is the variance of A X B for X with independent zero-mean entries of
    variance V: checked against that definition by sampling (not the formula restated), and
    exactly on a signed permutation, where the squares move with the coordinates."""
    d = 5
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(d, d, generator=g), torch.randn(d, d, generator=g)
    v = torch.rand(d, d, generator=g) + 0.1
    samples = 200_000
    x = torch.randn(samples, d, d, generator=g, dtype=torch.float64) * v.double().sqrt()
    empirical = ((a.double() @ x @ b.double()) ** 2).mean(0)
    exp_avg, exp_avg_sq = torch.zeros(d, d), v.clone()
    reproject_moments(exp_avg, exp_avg_sq, a, b)
    # 200,000 samples: a relative standard error of sqrt(2 / 200,000) = 0.3%
    torch.testing.assert_close(exp_avg_sq.double(), empirical, rtol=0.02, atol=0)
    perm = torch.eye(d)[torch.randperm(d, generator=g)] * torch.tensor([1.0, -1, 1, -1, -1])
    exp_avg, exp_avg_sq = v.clone(), v.clone()
    reproject_moments(exp_avg, exp_avg_sq, perm, perm.T)
    torch.testing.assert_close(exp_avg_sq, (perm.abs() @ v @ perm.abs().T), rtol=0, atol=1e-6)
    torch.testing.assert_close(exp_avg_sq, exp_avg.abs())  # V's entries, moved with their signs


@pytest.mark.parametrize(("m", "n", "d", "s"), [(48, 20, 8, 3), (96, 64, 16, 8), (30, 30, 6, 6)])
def test_the_projectors_start_as_a_norm_preserving_sketch(m, n, d, s) -> None:
    """The count-sketch start: each column's s non-zeros are ±sqrt(d / (k s)), so every column of
    P (d x k) has squared norm d / k exactly and trace(P Pᵀ) = d: P Pᵀ is the identity in
    expectation (a random projection). Independent of the code's formula: norms summed by hand.

    Catches: the square root dropped from the init scale (`offload/lsp.sketch_values`): the
    column norms are then d / (k s) instead of sqrt of it, and trace(P Pᵀ) = d² / (k s).
    """
    pr = Projectors.new(m, n, d, s, seed=2, device=CPU)
    for rows, vals, k in ((pr.p_rows, pr.p_vals, m), (pr.q_rows, pr.q_vals, n)):
        p = dense(rows, vals, d).double()
        assert p.shape == (d, k)
        torch.testing.assert_close((p * p).sum(0), torch.full((k,), d / k, dtype=torch.float64))
        assert float(torch.trace(p @ p.T)) == pytest.approx(d, rel=1e-6)
        # E[|P x|²] = |x|² for a random x: within a few % over 2,000 draws
        x = torch.randn(k, 2000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        ratio = float(((p @ x) ** 2).sum() / (x**2).sum() * k / d)
        assert ratio == pytest.approx(1.0, rel=0.05)


def test_which_matrices_and_their_sizes() -> None:
    assert is_lsp_matrix("layers.0.attention.wq.weight", (64, 64))
    assert is_lsp_matrix("module.layers.3.feed_forward.w2.weight", (64, 192))
    assert not is_lsp_matrix("layers.0.attention_norm.weight", (64,))
    assert not is_lsp_matrix("tok_embeddings.weight", (256, 64))
    assert not is_lsp_matrix("output.weight", (256, 64))
    assert matrix_dims((4096, 11008), 512, 16) == (512, 16)
    assert matrix_dims((64, 192), 512, 16) == (32, 16)  # capped at half the smaller dimension
    assert matrix_dims((64, 16), 512, 16) == (8, 8)  # and s at d


def test_traffic_per_step_is_a_fraction_of_zero_offloads() -> None:
    model = get_preset("small")
    kw = {"lsp_dim": 512, "lsp_nonzeros": 16, "precision": "bf16", "n_microbatches": 2}
    steady = lsp_bytes_per_step(model, **kw)
    sp = one_process_split(model)
    zero = 2 * model.num_params() * (2 + 1)  # bf16 gradients down twice, weights up once
    assert steady.total < zero
    # the blocks' share: d = 128 for the small model's 256 x 256 and 256 x 768 matrices
    d2 = sum(matrix_dims(s, 512, 16)[0] ** 2 for s in sp.matrices)
    assert steady.down - 2 * 2 * sp.zero_numel == 4 * d2 * 2
    refit = lsp_bytes_per_step(model, **kw, check=True, fit=True, refit=True)
    assert refit.down - steady.down == 8 * len(sp.matrices) + 8 * d2
    assert refit.up == steady.up


def test_rows_are_int32_and_the_device_bytes_are_the_planners() -> None:
    m, n, d, s = 48, 20, 8, 3
    pr = Projectors.new(m, n, d, s, seed=1, device=CPU)
    assert pr.p_rows.dtype == torch.int32 and pr.q_rows.dtype == torch.int32
    update = torch.zeros(d, d)
    pr.compress(torch.randn(m, n))  # builds the regrouped projectors
    assert pr.nbytes + pr.bags_nbytes + update.nbytes == device_bytes((m, n), d, s)
    pr.bags("p", 0, 24)  # a rank's rows of two FSDP2 shards: its part of P only
    pr._bags.pop(("p", 0, m))
    assert pr.nbytes + pr.bags_nbytes + update.nbytes == device_bytes((m, n), d, s, dp_shard=2)


@pytest.mark.slow  # three short runs with checkpoints
def test_a_checkpoint_with_int64_rows_resumes_bitwise(cfg_factory, monkeypatch) -> None:
    """Checkpoints written before the rows were int32 hold int64 rows: they load (cast) and the
    resumed run equals one that never left int32."""
    from llmscale.offload import lsp as lsp_module
    from llmscale.train.trainer import Trainer

    common = (
        "--optimizer.offload", "lsp", "--model.n_layers", "1",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
        "--optimizer.lsp_check_every", "2", "--optimizer.lsp_refit_threshold", "1e-9",
        "--train.steps", "3", "--checkpoint.enabled", "true",
    )  # fmt: skip
    full = Trainer(cfg_factory(*common, run="full"))
    full.fit()
    with monkeypatch.context() as mp:
        mp.setattr(lsp_module, "ROW_DTYPE", torch.int64)
        old = Trainer(cfg_factory(*common, "--checkpoint.stop_after", "2", run="resumed"))
        wq = dict(old.model.named_parameters())["layers.0.attention.wq.weight"]
        assert old.optimizer.state[wq]["lsp_p_rows"].dtype == torch.int64
        assert old.fit().interrupted
    new = Trainer(cfg_factory(*common, "--checkpoint.resume", "true", run="resumed"))
    new.fit()  # step 2 is a check and a refit, after the resume
    for p, q in zip(full.model.parameters(), new.model.parameters(), strict=True):
        assert torch.equal(p, q)
        a, b = full.optimizer.state[p], new.optimizer.state[q]
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressing_from_a_layers_factors_is_compressing_its_gradient(dtype) -> None:
    """(P dYᵀ)(Q Xᵀ)ᵀ = P (dYᵀ X) Qᵀ, and the swapped layer's backward gives the input's and the
    bias's gradients as F.linear's, handing (X, dY) over instead of the weight's."""
    from torch import nn

    from llmscale.offload.lsp_linear import install

    m, n, tokens = 24, 40, 30
    pr = Projectors.new(m, n, 8, 3, seed=7, device=CPU)
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(tokens, n, generator=g), torch.randn(tokens, m, generator=g)
    torch.testing.assert_close(
        pr.compress_factors(x.to(dtype), dy.to(dtype)),
        pr.compress(dy.to(dtype).float().T @ x.to(dtype).float()),
        rtol=1e-5,
        atol=1e-5,
    )
    layer = nn.Linear(n, m, bias=True)
    got: list[tuple[torch.Tensor, ...]] = []
    swap = install(layer, lambda w, a, b: got.append((w, a, b)))
    xs = torch.randn(2, 3, n, requires_grad=True)
    ref_x = xs.detach().clone().requires_grad_(True)
    up = torch.randn(2, 3, m)
    layer(xs).backward(up)
    assert layer.weight.grad is None and len(got) == 1
    w, a, b = got[0]
    assert w is layer.weight
    torch.testing.assert_close(b.T @ a, up.reshape(-1, m).T @ xs.detach().reshape(-1, n))
    db = layer.bias.grad.clone()
    layer.bias.grad = None
    swap.remove()  # the class's forward again: the ordinary gradients
    torch.nn.functional.linear(ref_x, layer.weight, layer.bias).backward(up)
    torch.testing.assert_close(xs.grad, ref_x.grad)
    torch.testing.assert_close(db, layer.bias.grad)
    assert layer.weight.grad is not None
