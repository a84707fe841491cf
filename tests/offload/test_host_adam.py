"""The host half on its own: AdamW on plain host tensors, without hooks, threads or a model."""

from __future__ import annotations

import torch

from llmscale.offload.host_adam import HostAdamW
from llmscale.offload.lsp import Projectors, dense
from llmscale.parallel.dims import ParallelDims
from llmscale.parallel.grads import global_norm_and_overflow, grad_norm_and_overflow_


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((4, 3), (3,), (2, 5))]


def test_update_is_bitwise_torch_adamw_and_norms_reduce_like_the_device_path() -> None:
    params = _params()
    host = HostAdamW(torch.float32, n_microbatches=2, pin=False, fused=False, offload_params=False)
    slots = [
        host.make_slot(i, f"p{i}", p, unit=0, group=int(p.dim() < 2)) for i, p in enumerate(params)
    ]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(
        [{"params": [ref[0], ref[2]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True,
    )  # fmt: skip
    hyper = [dict(g, params=None) for g in opt.param_groups]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        micro = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)]
        for r, a, b in zip(ref, *micro, strict=True):
            r.grad = a.clone().add_(b)
        for first, grads in ((True, micro[0]), (False, micro[1])):
            for s, grad in zip(slots, grads, strict=True):
                dst = host.download_buffer(s, grad.dtype, first)
                dst.copy_(grad)
                if dst is not s.grad:  # the first fp32 gradient lands in place
                    host.accumulate(s, first)
        host.norms(slots)
        host_norm = global_norm_and_overflow([s.norm for s in slots], [1, 1, 1], 1).norm
        device = grad_norm_and_overflow_([r.grad for r in ref], ParallelDims())
        assert torch.equal(host_norm, device.norm) and not device.found_inf
        host.update(slots, hyper, None)
        opt.step()
    for s, r in zip(slots, ref, strict=True):
        assert torch.equal(s.master, r.detach())
        assert torch.equal(s.exp_avg_sq, opt.state[r]["exp_avg_sq"])
    mem = host.memory_report(slots)
    n = sum(p.numel() for p in params)
    assert mem["host_master_bytes"] == 4 * n and mem["host_optimizer_bytes"] == 8 * n + 4 * 3


def test_overflow_is_a_non_finite_norm() -> None:
    norms = [torch.tensor(1.0), torch.tensor(float("inf"))]
    assert global_norm_and_overflow(norms, [1, 1], 1, check_overflow=True).found_inf
    assert not global_norm_and_overflow(norms[:1], [1], 1, check_overflow=True).found_inf
    assert not global_norm_and_overflow(norms, [1, 1], 1, check_overflow=False).found_inf


def test_an_lsp_matrix_steps_as_adamw_in_the_subspace_with_the_decay_on_the_weight() -> None:
    """LSP-Offload's step (Chen et al.: Adam on the d x d compressed gradient, the update
    decompressed as Pᵀ U Q) with AdamW's decoupled decay W <- (1 - lr wd) W, against torch's
    own AdamW on a d x d zero parameter (wd 0) and the decay written out by hand.

    Catches: dropping the weight decay on LSP matrices (`host_adam._update_lsp` setting
    `decay` to 1.0, or forgetting to set it): the weight then misses its 1 - lr x wd factor.
    """
    m, n, d, s = 12, 10, 4, 2
    proj = Projectors.new(m, n, d, s, seed=3, device=torch.device("cpu"))
    w = torch.nn.Parameter(torch.randn(m, n, generator=torch.Generator().manual_seed(2)))
    host = HostAdamW(torch.float32, n_microbatches=1, pin=False, fused=False, offload_params=False)
    slot = host.make_lsp_slot(0, "layers.0.attention.wq.weight", w, unit=0, group=0, proj=proj)
    lr, wd = 0.05, 0.2
    hyper = [{"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd}]
    sub = torch.nn.Parameter(torch.zeros(d, d))  # the reference's update accumulates here
    ref = torch.optim.AdamW([sub], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    want = w.detach().clone()
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        grad_c = torch.randn(d, d, generator=g)
        host.download_buffer(slot, torch.float32, True).copy_(grad_c)
        host.update([slot], hyper, None)
        assert slot.lsp is not None
        slot.lsp.update_device.copy_(slot.lsp.update_host)
        slot.lsp.apply(w.data)
        before = sub.detach().clone()
        sub.grad = grad_c
        ref.step()
        u = sub.detach() - before  # -lr x m̂ / (√v̂ + eps): torch's AdamW, no decay
        p, q = dense(proj.p_rows, proj.p_vals, d), dense(proj.q_rows, proj.q_vals, d)
        want = (1 - lr * wd) * want + p.T @ u @ q
        torch.testing.assert_close(w.detach(), want, rtol=1e-5, atol=1e-6)
