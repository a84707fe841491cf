"""The per-rank work record (plan/work.py): what a rank does for one micro-batch, derived once
and folded by the memory model, the time model and the runtime's expected metrics alike."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmscale.model.config import get_preset
from llmscale.plan import activations as act
from llmscale.plan import cache, work
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import estimate_memory, memory_options
from llmscale.plan.plan import Plan
from llmscale.plan.time import estimate_step_time, time_params
from llmscale.stack import MEGATRON_CORE

L8 = get_preset("llama3-8b")


def test_the_record_by_hand() -> None:
    """Llama 3 8B, pp 4 in a V (zbv: rank r holds stages r and 7 - r), tp 2, cp 2: rank 0
    holds the embedding and, in a V, the head; every linear sees b s / cp tokens and is split
    over tp as the runtime's TP plan splits it."""
    plan = Plan(model=L8, seq_len=8192, micro_batch_size=2, global_batch_size=32, tp=2, pp=4,
                cp=2, pp_schedule="zbv", pp_chunks=2, sequence_parallel=True,
                recompute="full")  # fmt: skip
    kernels = MEGATRON_CORE.kernels
    w0, w1 = work.rank_work(plan, 0, kernels), work.rank_work(plan, 1, kernels)
    assert w0.embedding and w0.head and not w1.embedding and not w1.head
    assert w0.layers == (0, 1, 2, 3, 28, 29, 30, 31) and w1.layers == (4, 5, 6, 7, 24, 25, 26, 27)
    assert w0.modes == {"full": 8} and w0.n_full == 8 and w0.n_blocks == 8
    assert w0.tokens == 2 * 8192 // 2
    d, kv, ffn = L8.dim, L8.kv_dim, L8.ffn_dim
    t = 8192
    assert w0.gemms == [(t, d // 2, d), (t, kv // 2, d), (t, kv // 2, d), (t, d, d // 2),
                        (t, ffn // 2, d), (t, ffn // 2, d), (t, d, ffn // 2)]  # fmt: skip
    k = work.plan_kernels(plan, kernels)
    args = (L8, 2, 8192, "bf16", 2, True, k)
    assert w0.block_saved["full"] == act.block_bytes(*args, "full") / 2
    assert w0.block_saved["none"] == act.block_bytes(*args, "none") / 2
    assert w0.head_saved == act.head_bytes(*args) / 2 and w1.head_saved == 0.0
    assert w0.saved == 8 * w0.block_saved["full"] + w0.embedding_saved + w0.head_saved


def test_memory_and_time_fold_the_same_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Doctor the record (every block saves twice its bytes): the memory model's activations
    and the recompute transient, and the time model's element-wise traffic (a stack that
    counts passes over the saved bytes), all move with it; neither derives its own."""
    plan = Plan(model=L8, seq_len=8192, micro_batch_size=1, global_batch_size=8, dp_shard=4,
                pp=2, recompute="full")  # fmt: skip
    h100 = Cluster.of("h100")
    opts, tparams = memory_options(MEGATRON_CORE), time_params(MEGATRON_CORE)

    def measure() -> tuple[float, float, float]:
        cache.clear_all()
        mem = estimate_memory(plan, opts, validate=False).per_rank[0]  # no loss on rank 0
        step = estimate_step_time(plan, h100, tparams, validate=False)
        return mem.activations, mem.transient, step.breakdown["elementwise"]

    acts, transient, elem = measure()
    honest = work._rank_work

    def doctored(p: Plan, rank: int, kernels: act.Kernels) -> work.RankWork:
        w = honest(p, rank, kernels)
        return replace(w, block_saved={m: 2 * v for m, v in w.block_saved.items()})

    monkeypatch.setattr(work, "_rank_work", doctored)
    acts2, transient2, elem2 = measure()
    cache.clear_all()
    w = honest(plan, 0, opts.kernels)
    in_flight = 2  # 1F1B: rank 0 of 2 holds two micro-batches (8 per step)
    blocks = in_flight * w.n_blocks * w.block_saved["full"]
    assert acts2 - acts == pytest.approx(blocks)
    # the recomputed block's forward, once twice its bytes outgrow FSDP's reduce-scatter buffer,
    # beside its MLP's gradients (SwiGLU: two b x s x ffn tensors in bf16)
    mlp = 2 * 8192 * L8.ffn_dim * 2
    assert transient2 == 2 * w.block_saved["none"] + mlp > transient
    assert elem2 > 1.5 * elem
