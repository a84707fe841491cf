"""OffloadedAdamW on its own: numerics against torch's AdamW, the pipeline's order, its state."""

from __future__ import annotations

import math
import time

import pytest
import torch
from offload_loops import CFG, HP
from offload_loops import batches as _batches
from offload_loops import loss as _loss
from offload_loops import rel as _rel
from offload_loops import train_offloaded as _train_offloaded
from offload_loops import train_reference as _train_reference

from llmscale.config import PrecisionSection
from llmscale.model.transformer import build_model
from llmscale.offload import OffloadedAdamW, layer_units, overlap_stats, unscale_and_clip
from llmscale.train.optim import param_groups
from llmscale.train.precision import DynamicLossScaler


def _offloaded(model: torch.nn.Module, **kw) -> OffloadedAdamW:
    groups = param_groups(model, HP["weight_decay"])
    return OffloadedAdamW(model.named_parameters(), groups=groups, **HP, **kw).attach(model)


def test_layer_units_group_blocks_and_the_ends() -> None:
    names = [n for n, _ in build_model(CFG, "meta").named_parameters()]
    units = layer_units(names)
    assert [u for u, _ in units] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert units[0][1] == ["tok_embeddings.weight"]
    assert units[-1][1] == ["norm.weight", "output.weight"]
    assert sum(len(ns) for _, ns in units) == len(names)
    with pytest.raises(ValueError, match="out of order"):
        layer_units(["layers.0.w", "layers.1.w", "layers.0.b"])


@pytest.mark.parametrize(
    "overlap, micro, max_norm, kernel",
    [
        (False, 1, math.inf, "fused"),
        (True, 1, math.inf, "fused"),
        (False, 3, 0.5, "fused"),  # accumulation, and clipping that bites (the norm is ~2-7)
        (True, 3, 0.5, "fused"),
        (False, 3, 0.5, "exact"),  # torch's own arithmetic: then equal bit for bit
        (True, 3, 0.5, "exact"),
    ],
)
def test_five_steps_equal_torch_adamw(overlap, micro, max_norm, kernel) -> None:
    batches = _batches(5, micro)
    ref = build_model(CFG, seed=1)
    ref_losses = _train_reference(ref, batches, max_norm)
    model = build_model(CFG, seed=1)
    opt = _offloaded(model, overlap=overlap, n_microbatches=micro, kernel=kernel)
    losses, norms = _train_offloaded(model, opt, batches, max_norm)
    if math.isfinite(max_norm):
        assert min(norms) > max_norm  # clipping was in play on every step
    exact = not opt.fused
    if exact:
        assert losses == ref_losses
    else:  # the fused CPU kernel rounds differently from foreach (last bits, per step)
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    assert losses[0] == ref_losses[0]  # the first forward runs the same weights
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, r) if exact else _rel(p, r) < 1e-6, name
        assert torch.equal(opt.state[p]["master"], p.detach())  # fp32: device copy = master
    assert opt.slots[0].step.item() == 5


@pytest.mark.parametrize("kernel", ["exact", "fused"])
def test_update_in_backward_runs_during_backward_and_matches(kernel: str) -> None:
    batches = _batches(4, 2)
    ref = build_model(CFG, seed=2)
    ref_losses = _train_reference(ref, batches, math.inf)
    model = build_model(CFG, seed=2)
    # The first block's backward sleeps 50 ms (releasing the GIL): on a busy 2-core machine the
    # update worker then surely gets a core while backward still has work left, so the check
    # below tests that the update was started during backward, not how threads were scheduled.
    model.layers["0"].register_full_backward_pre_hook(lambda *_: time.sleep(0.05))
    opt = _offloaded(model, overlap=True, update_in_backward=True, n_microbatches=2, kernel=kernel)
    losses, _ = _train_offloaded(model, opt, batches, math.inf)
    if not opt.fused:
        assert losses == ref_losses
        assert all(
            torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters(), strict=True)
        )
    else:
        # Unclipped Adam amplifies the fused kernel's last-bit differences (m / sqrt(v) of
        # near-zero gradients) more than clipped Adam does; both stay within 1e-6.
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
        assert (
            max(_rel(p, r) for p, r in zip(model.parameters(), ref.parameters(), strict=True))
            < 1e-5
        )
    ivs = opt.timeline.intervals()
    for step in (1, 2, 3):
        back = [iv for iv in ivs if iv.step == step and iv.phase == "backward"]
        first_update = min(iv.start for iv in ivs if iv.step == step and iv.phase == "update")
        # The head's update starts before the embedding's gradient is even computed.
        assert first_update < max(iv.end for iv in back)
    with pytest.raises(RuntimeError, match="clipping"):
        unscale_and_clip([opt], DynamicLossScaler(PrecisionSection(), enabled=False), 1.0)


def test_more_micro_steps_than_declared_is_an_error_when_updating_in_backward() -> None:
    model = build_model(CFG, seed=0)
    _offloaded(model, overlap=True, update_in_backward=True, n_microbatches=1)
    (mb,) = _batches(1, 1)[0]
    _loss(model, mb).backward()
    with pytest.raises(RuntimeError, match="n_microbatches=1"):
        _loss(model, mb).backward()


def test_with_clipping_no_update_starts_before_the_last_gradient_is_in() -> None:
    model = build_model(CFG, seed=0)
    opt = _offloaded(model, overlap=True, n_microbatches=1, link_bytes_per_s=2e8)
    _train_offloaded(model, opt, _batches(3, 1), 1.0)
    ivs = opt.timeline.intervals()
    for step in (0, 1, 2):
        last_in = max(iv.end for iv in ivs if iv.step == step and iv.phase in ("download", "norm"))
        updates = [iv for iv in ivs if iv.step == step and iv.phase == "update"]
        assert len(updates) == len(opt.units)
        assert min(iv.start for iv in updates) >= last_in


def test_each_forward_waits_for_its_own_upload_and_later_uploads_overlap_it() -> None:
    """The upload of unit k ends before unit k's next forward; some uploads run under forward."""
    model = build_model(CFG, seed=0)
    # A slow link (20 MB/s) makes each unit's upload long next to its forward.
    opt = _offloaded(model, overlap=True, n_microbatches=1, link_bytes_per_s=2e7)
    _train_offloaded(model, opt, _batches(3, 1), 1.0)
    ivs = opt.timeline.intervals()
    hidden = 0.0
    for step in (0, 1):
        fwd = [iv for iv in ivs if iv.step == step + 1 and iv.phase == "forward"]
        for unit in opt.units:
            up_end = max(
                iv.end
                for iv in ivs
                if iv.step == step and iv.unit == unit.name and iv.phase == "upload"
            )
            starts = [iv.start for iv in fwd if iv.unit == unit.name]
            assert starts and min(starts) >= up_end, unit.name
        hidden += overlap_stats(ivs, [step]).per_lane_s["h2d"] > 0
    stats = overlap_stats(ivs, [1])
    assert stats.hidden_s > 0 and 0 < stats.hidden_fraction <= 1


def test_fp16_unscale_is_folded_in_and_an_overflow_skips_the_step() -> None:
    scaler_cfg = PrecisionSection(initial_scale=2.0**10, min_scale=1.0, max_scale=2.0**20)
    model = build_model(CFG, seed=3)
    opt = _offloaded(model, working_dtype=torch.float16, overlap=True)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    scaler = DynamicLossScaler(scaler_cfg, enabled=True)
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: grads.__setitem__(name, g.detach().float().clone()))
    masters = [opt.state[p]["master"].clone() for p in model.parameters()]
    (mb,) = _batches(1, 1)[0]
    scaler.scale_loss(_loss(model, mb, "fp16")).backward()
    found, norm = unscale_and_clip([opt], scaler, 1.0)
    assert not found
    expect = torch.linalg.vector_norm(
        torch.stack(
            [torch.linalg.vector_norm(grads[n] / 2.0**10) for n, _ in model.named_parameters()]
        )
    )
    assert norm.item() == pytest.approx(expect.item(), rel=1e-6)
    opt.step()
    opt.synchronize()
    # The host update saw (fp16 grad / scale) x clip coefficient, as torch's AdamW would.
    coef = min(1.0, 1.0 / (expect.item() + 1e-6))
    params = [torch.nn.Parameter(m.clone()) for m in masters]
    for p, (n, _) in zip(params, model.named_parameters(), strict=True):
        p.grad = grads[n] / 2.0**10 * coef
    ref = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], foreach=True,
    )  # fmt: skip
    ref.step()
    for (n, p), r in zip(model.named_parameters(), params, strict=True):
        assert _rel(opt.state[p]["master"], r) < 1e-5, n
        assert torch.equal(p.detach(), opt.state[p]["master"].half())
    opt.zero_grad()

    # An overflow: a loss scaled past fp16's range leaves inf gradients; nothing moves.
    before = [opt.state[p]["master"].clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    (_loss(model, mb, "fp16") * 1e30).backward()
    found, norm = unscale_and_clip([opt], scaler, 1.0)
    assert found and not math.isfinite(norm.item())
    scaler.update(True)
    opt.zero_grad()
    assert scaler.scale == 2.0**9
    for p, b, w in zip(model.parameters(), before, weights, strict=True):
        assert torch.equal(opt.state[p]["master"], b) and torch.equal(p.detach(), w)


def test_bf16_device_weights_are_the_rounded_master_and_the_ledger_is_12_bytes() -> None:
    model = build_model(CFG, seed=4)
    n = sum(p.numel() for p in model.parameters())
    fp32 = [p.detach().clone() for p in model.parameters()]
    opt = _offloaded(model, working_dtype=torch.bfloat16, overlap=True, n_microbatches=2)
    for p, w in zip(model.parameters(), fp32, strict=True):
        assert p.dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["master"], w)  # the master kept full precision
    _train_offloaded(model, opt, _batches(2, 2), 1.0)
    for p in model.parameters():
        assert torch.equal(p.detach(), opt.state[p]["master"].bfloat16())
    mem = opt.memory_report()
    assert mem["host_master_bytes"] == 4 * n
    assert mem["host_optimizer_bytes"] == 8 * n + 4 * len(opt.slots)  # moments + step counters
    assert mem["host_grad_bytes"] == 4 * n and mem["host_staging_bytes"] == 2 * n
    assert mem["device_optimizer_bytes"] == mem["device_master_bytes"] == 0
    assert all(p.grad is None for p in model.parameters())  # device gradients released


def test_state_dict_round_trips_bitwise() -> None:
    batches = _batches(4, 1)
    a_model = build_model(CFG, seed=5)
    a = _offloaded(a_model, overlap=True)
    _train_offloaded(a_model, a, batches[:2], 1.0)
    sd = a.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    b_model = build_model(CFG, seed=6)  # different weights, fresh state
    b = _offloaded(b_model, overlap=False)
    b.load_state_dict(
        {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},
         "param_groups": sd["param_groups"]}
    )  # fmt: skip
    for pa, pb in zip(a_model.parameters(), b_model.parameters(), strict=True):
        assert torch.equal(pa, pb)  # the masters were uploaded
    la, _ = _train_offloaded(a_model, a, batches[2:], 1.0)
    lb, _ = _train_offloaded(b_model, b, batches[2:], 1.0)
    assert la == lb
    for pa, pb in zip(a_model.parameters(), b_model.parameters(), strict=True):
        assert torch.equal(pa, pb)
        assert torch.equal(a.state[pa]["exp_avg_sq"], b.state[pb]["exp_avg_sq"])


def test_thread_copier_throttles_to_the_link() -> None:
    from llmscale.offload.engine import ThreadCopier
    from llmscale.offload.timeline import TransferTimeline

    tl = TransferTimeline()
    c = ThreadCopier("h2d", tl, link_bytes_per_s=1e8)
    src, dst = torch.ones(2_500_000), torch.zeros(2_500_000)  # 10 MB: >= 0.1 s at 100 MB/s
    c.copy(dst, src, 0, "u", "upload").wait()
    c.close()
    (iv,) = tl.intervals()
    assert torch.equal(dst, src) and iv.end - iv.start >= 0.1
