"""Loss scaling, overflow skipping, underflow measurement, bf16/fp16 runs."""

import math

import pytest
import torch

from llmscale.config import PrecisionSection
from llmscale.train.precision import DynamicLossScaler, underflow_report
from llmscale.train.trainer import Trainer


def test_scaler_follows_gradscaler_trajectory_within_bounds() -> None:
    """Same growth/backoff rule as torch.amp.GradScaler, step by step."""
    cfg = PrecisionSection(
        mode="fp16", initial_scale=2.0**10, growth_interval=3, min_scale=1.0, max_scale=2.0**20
    )
    ours = DynamicLossScaler(cfg, enabled=True)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    pattern = [False, False, False, True, False, False, False, False, False, True, True, False]
    for overflow in pattern:
        ref.scale(torch.ones(()))  # GradScaler initialises its scale tensor on first use
        p.grad = torch.tensor([1.0, math.inf if overflow else 2.0, 3.0]) * ref.get_scale()
        ref.step(opt)
        ref.update()
        grads = [torch.tensor([1.0, math.inf if overflow else 2.0, 3.0]) * ours.scale]
        found = ours.unscale_and_check(grads)
        assert found == overflow
        ours.update(found)
        assert ours.scale == ref.get_scale()
    assert ours.skipped_steps == 3


def test_scaler_stays_within_min_and_max() -> None:
    cfg = PrecisionSection(
        mode="fp16", initial_scale=16.0, growth_interval=1, min_scale=8.0, max_scale=32.0
    )
    s = DynamicLossScaler(cfg, enabled=True)
    for _ in range(5):
        s.update(False)
    assert s.scale == 32.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 8.0


def test_unscale_divides_gradients() -> None:
    s = DynamicLossScaler(PrecisionSection(mode="fp16", initial_scale=1024.0), enabled=True)
    g = torch.full((4,), 2048.0)
    assert not s.unscale_and_check([g])
    assert torch.equal(g, torch.full((4,), 2.0))


def test_disabled_scaler_is_identity() -> None:
    s = DynamicLossScaler(PrecisionSection(), enabled=False)
    loss = torch.tensor(3.0)
    assert s.scale_loss(loss) is loss
    assert not s.unscale_and_check([torch.tensor([math.inf])])


def test_underflow_report_counts_exactly() -> None:
    # 2^-26 vanishes in fp16 unless scaled (smallest subnormal 2^-24, half of it rounds to 0);
    # 2^-20 survives; 1e3 overflows once scaled by 2^7 (> 65504).
    g = torch.tensor([2.0**-26, 2.0**-26, 2.0**-20, 1e3, 0.0])
    rows = {r.scale: r for r in underflow_report([g], scales=[1.0, 4.0, 128.0])}
    assert rows[1.0].nonzero == 4
    assert rows[1.0].underflow == 2 and rows[1.0].underflow_fraction == 0.5
    assert rows[4.0].underflow == 0 and rows[4.0].overflow == 0
    assert rows[128.0].overflow == 1


def test_overflow_skips_the_step_and_backs_off(cfg_factory) -> None:
    t = Trainer(cfg_factory("--precision.mode", "fp16", "--precision.initial_scale", "1024"))
    before = [p.detach().clone() for p in t.model.parameters()]
    t.forward_backward(t.train_stream.next_batch(4))
    next(t.model.parameters()).grad[0, 0] = math.inf
    out = t.optimizer_step()
    assert out["skipped"] is True
    assert t.scaler.scale == 512.0
    assert all(torch.equal(a, p) for a, p in zip(before, t.model.parameters(), strict=True))
    assert t.scheduler.last_epoch == 0  # a skipped step does not advance the schedule


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_low_precision_runs_train_and_keep_fp32_master_weights(cfg_factory, mode: str) -> None:
    t = Trainer(
        cfg_factory(
            "--precision.mode", mode, "--train.steps", "4", "--precision.underflow_steps", "[2]"
        )
    )
    r = t.fit()
    assert all(math.isfinite(x) for x in r.losses)
    assert r.losses[-1] < r.losses[0]
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    from llmscale.train.metrics import read_jsonl

    rows = [row for row in read_jsonl(t.run_dir / "metrics.jsonl") if row.get("kind") == "train"]
    under = rows[1]["underflow"]
    assert [u["scale"] for u in under] == [2.0**k for k in range(16)]
    fractions = [u["underflow_fraction"] for u in under]
    assert fractions == sorted(fractions, reverse=True)  # more scale, fewer vanish
    assert 0.0 <= fractions[-1] < fractions[0] or fractions[0] == 0.0


def test_fp16_backward_underflow_shrinks_with_scale() -> None:
    from llmscale.model.config import get_preset
    from llmscale.model.transformer import build_model
    from llmscale.train.precision import fp16_backward_underflow
    from llmscale.train.trainer import lm_loss

    model = build_model(get_preset("tiny").with_overrides(init_std=0.002))
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    rows = fp16_backward_underflow(
        lambda: lm_loss(model(tokens[:, :-1]), tokens[:, 1:]), params, scales=[1.0, 2.0**8, 2.0**15]
    )
    f = [r.underflow_fraction for r in rows]
    assert 0.5 * sum(p.numel() for p in params) < rows[0].nonzero <= sum(p.numel() for p in params)
    assert f[0] > 0.01  # tiny init: many gradients are below fp16's range unscaled
    assert f[0] > f[1] >= f[2]
    assert all(p.grad is None for p in params)
