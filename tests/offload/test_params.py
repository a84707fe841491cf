"""optimizer+params on its own: parameters on the host between uses, on the device around a unit.

Numerics against torch's AdamW (bit for bit with the exact kernel, with recomputation and tied
embeddings), which units are on the device when (exactly two consecutive ones), that the
uploads overlap compute, the state dict, and that a missed fetch fails loudly.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from offload_loops import CFG, HP, train_offloaded
from offload_loops import batches as _batches
from offload_loops import loss as _loss
from offload_loops import train_reference as _train_reference

from llmscale.model.transformer import build_model
from llmscale.offload import OffloadedAdamW, overlap_stats
from llmscale.offload.timeline import PARAMS_LANE
from llmscale.parallel.activation_checkpoint import apply_recompute
from llmscale.train.optim import param_groups

CLIP = 0.5  # bites: the norms here are 2-7


def _model(seed: int, recompute: str = "none", **overrides) -> torch.nn.Module:
    model = build_model(CFG.with_overrides(**overrides), seed=seed)
    apply_recompute(model, recompute)
    return model


def _offloaded(model: torch.nn.Module, **kw) -> OffloadedAdamW:
    groups = param_groups(model, HP["weight_decay"])
    return OffloadedAdamW(
        model.named_parameters(), groups=groups, **HP, offload_params=True, **kw
    ).attach(model)


def _train(model, opt, batches, max_norm) -> list[float]:
    return train_offloaded(model, opt, batches, max_norm)[0]


@pytest.mark.parametrize(
    "overlap, kernel, recompute",
    [
        (False, "exact", "none"),
        (True, "exact", "none"),
        (True, "exact", "full"),  # the recomputed forward runs inside backward, on fetched weights
        (True, "exact", "selective"),
        (True, "fused", "none"),
    ],
)
def test_five_steps_equal_torch_adamw(overlap: bool, kernel: str, recompute: str) -> None:
    batches = _batches(5, 2)
    ref = _model(1, recompute)
    if kernel == "exact":
        ref_losses = _train_reference(ref, batches, CLIP)
    else:  # the fused kernel rounds unlike torch's AdamW: compare with offloading the optimizer only
        groups = param_groups(ref, HP["weight_decay"])
        plain = OffloadedAdamW(
            ref.named_parameters(), groups=groups, **HP, n_microbatches=2
        ).attach(ref)
        ref_losses = _train(ref, plain, batches, CLIP)
    model = _model(1, recompute)
    opt = _offloaded(model, overlap=overlap, n_microbatches=2, kernel=kernel)
    assert opt.fused == (kernel == "fused")
    losses = _train(model, opt, batches, CLIP)
    # Between steps the device holds no parameter; the state dict holds the host copies.
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    sd = model.state_dict()
    assert losses == ref_losses
    for name, r in ref.named_parameters():
        assert torch.equal(sd[name], r), name
    assert opt.memory_report()["host_param_bytes"] == 0  # fp32: the master is what is uploaded


def _open_intervals(ivs, step: int) -> list[tuple[float, int, str]]:
    """(time, +1 at a fetch / -1 at a release, unit) for the residency bars of `step`."""
    events = []
    for iv in ivs:
        if iv.lane == PARAMS_LANE and iv.step == step:
            events += [(iv.start, +1, iv.unit), (iv.end, -1, iv.unit)]
    return sorted(events, key=lambda e: (e[0], e[1]))  # a release before a fetch at a tie


def test_two_consecutive_units_at_a_time_each_fetched_twice_per_micro_step() -> None:
    model = _model(0)
    opt = _offloaded(model, overlap=True, n_microbatches=2)
    assert opt.params is not None
    names = [u.name for u in opt.units]
    at_forward: dict[str, list[str]] = {}

    def record(key: str) -> None:
        assert opt.params is not None
        at_forward.setdefault(key, [u.name for u in opt.params.units if u.resident])

    for key, block in model.layers.items():  # appended: runs after the optimizer's own hook
        block.register_forward_pre_hook(lambda m, a, key=key: record(key))
    _train(model, opt, _batches(3, 2), CLIP)
    # In forward: the running block and the next unit (prefetched), nothing else.
    assert at_forward == {
        "0": ["layers.0", "layers.1"],
        "1": ["layers.1", "layers.2"],
        "2": ["layers.2", "head"],
    }
    bytes_of = {u.name: u.bytes for u in opt.params.units}
    ivs = opt.timeline.intervals()
    for step in (0, 1, 2):
        mine = [iv for iv in ivs if iv.lane == PARAMS_LANE and iv.step == step]
        # Up before the forward and again before the backward, for each of 2 micro-batches; the
        # head, whose forward ends just before its backward starts, stays from one to the other.
        assert sorted(iv.unit for iv in mine) == sorted(names[:-1] * 4 + ["head"] * 2)
        open_units: set[str] = set()
        most, peak = 0, 0
        for _, delta, unit in _open_intervals(ivs, step):
            if delta > 0:
                open_units.add(unit)
            else:
                open_units.discard(unit)
            most = max(most, len(open_units))
            peak = max(peak, sum(bytes_of[u] for u in open_units))
            if len(open_units) == 2:
                a, b = sorted(names.index(u) for u in open_units)
                assert b == a + 1, open_units  # consecutive, in forward or backward order
        assert most == 2
    # The ledger's peak is that of the worst window: two consecutive units.
    windows = [bytes_of[a] + bytes_of[b] for a, b in zip(names, names[1:], strict=False)]
    assert opt.memory_report()["device_param_peak_bytes"] == peak == max(windows)
    assert opt.params.resident_bytes == 0


def test_tied_embedding_stays_from_its_forward_to_its_gradient() -> None:
    batches = _batches(3, 2)
    ref = _model(2, "full", tie_embeddings=True)
    ref_losses = _train_reference(ref, batches, CLIP)
    model = _model(2, "full", tie_embeddings=True)
    opt = _offloaded(
        model, n_microbatches=2, kernel="exact", keep_resident=["tok_embeddings.weight"]
    )
    assert _train(model, opt, batches, CLIP) == ref_losses
    sd = model.state_dict()
    assert all(torch.equal(sd[n], r) for n, r in ref.named_parameters())
    ivs = opt.timeline.intervals()
    embed = [iv for iv in ivs if iv.lane == PARAMS_LANE and iv.unit == "embed" and iv.step == 1]
    assert len(embed) == 2  # once per micro-step: through the whole forward and backward
    back = [iv for iv in ivs if iv.step == 1 and iv.phase == "backward"]
    assert max(iv.end for iv in embed) >= max(iv.end for iv in back)


def test_a_parameter_read_while_released_fails_loudly() -> None:
    # The tied head reads the embedding outside the embedding's unit: without keep_resident the
    # weight has no storage there, and torch refuses it (no silent garbage).
    model = _model(3, tie_embeddings=True)
    _offloaded(model)
    (mb,) = _batches(1, 1)[0]
    with pytest.raises(RuntimeError, match="storage of size 0"):
        _loss(model, mb)


def test_uploads_run_under_compute() -> None:
    """Each unit's prefetch is issued before the previous unit computes, and runs meanwhile."""
    model = _model(4)
    # A slow link (20 MB/s: a block takes ~10 ms) and a 30 ms sleep in each block's forward, so
    # the copy thread has compute to hide under whatever the machine's load.
    opt = _offloaded(model, overlap=True, link_bytes_per_s=2e7)
    for block in model.layers.values():
        block.register_forward_pre_hook(lambda *_: time.sleep(0.03))
    _train(model, opt, _batches(3, 1), CLIP)
    ivs = opt.timeline.intervals()
    for step in (1, 2):
        fwd = {iv.unit: iv for iv in ivs if iv.step == step and iv.phase == "forward"}
        res = [iv for iv in ivs if iv.step == step and iv.lane == PARAMS_LANE]
        for prev, nxt in [("layers.0", "layers.1"), ("layers.1", "layers.2"), ("layers.2", "head")]:
            fetched = min(iv.start for iv in res if iv.unit == nxt)
            assert fetched <= fwd[prev].start, (step, nxt)
        phases = {iv.phase for iv in ivs if iv.step == step and iv.lane == "h2d"}
        assert phases == {"fetch", "refetch"}
    stats = overlap_stats(ivs, [1])
    assert stats.hidden_s > 0 and stats.per_lane_s["h2d"] > 0


def test_bf16_host_copies_and_state_dict_round_trip() -> None:
    a_model = _model(5)
    a = _offloaded(a_model, working_dtype=torch.bfloat16, n_microbatches=1)
    n = sum(p.numel() for p in a_model.parameters())
    _train(a_model, a, _batches(2, 1), CLIP)
    sd = a_model.state_dict()
    for name, p in a_model.named_parameters():
        assert p.dtype == torch.bfloat16 and sd[name].device.type == "cpu"
        assert torch.equal(sd[name], a.state[p]["master"].bfloat16())  # the rounded master
    assert a.memory_report()["host_param_bytes"] == 2 * n
    b_model = _model(6)
    b = _offloaded(b_model, working_dtype=torch.bfloat16)
    b_model.load_state_dict({k: v.clone() for k, v in sd.items()})
    assert all(p.untyped_storage().nbytes() == 0 for p in b_model.parameters())
    b_sd = b_model.state_dict()
    assert all(torch.equal(b_sd[k], v) for k, v in sd.items())
    for p in b_model.parameters():  # loaded weights that are not a rounded master: it follows
        assert torch.equal(b.state[p]["master"], b_sd[_name(b_model, p)].float())
    (mb,) = _batches(1, 1, seed=9)[0]
    with torch.no_grad():  # an evaluation: fetched and released again
        assert torch.equal(a_model(mb), b_model(mb))
    assert b.params is not None and b.params.resident_bytes == 0
    b.close()  # the parameters come back to the device
    assert all(torch.equal(p.detach(), b_sd[k]) for k, p in b_model.named_parameters())


def _name(model: torch.nn.Module, p: torch.Tensor) -> str:
    return next(n for n, q in model.named_parameters() if q is p)


def test_update_in_backward_with_params_offloaded_matches() -> None:
    batches = _batches(3, 2)
    ref = _model(7)
    ref_losses = _train_reference(ref, batches, math.inf)
    model = _model(7)
    opt = _offloaded(model, overlap=True, update_in_backward=True, n_microbatches=2, kernel="exact")
    assert _train(model, opt, batches, math.inf) == ref_losses
    sd = model.state_dict()
    assert all(torch.equal(sd[n], r) for n, r in ref.named_parameters())
