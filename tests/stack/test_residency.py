"""The stack's gather and reduce rule, torch-free: the ZeRO table and torch's pipeline actions.

The pipeline figures are those the runtime counted (pp 2 x dp_shard 2, 8 layers, 4
micro-batches, steps after the first; docs/parallel.md), predicted here from the planner's own
schedule orders.
"""

from __future__ import annotations

import dataclasses

import pytest

from llmscale.model.config import get_preset
from llmscale.plan.schedule import schedule_ops
from llmscale.stack.residency import (
    micro_batch_controls,
    pipeline_gathers,
    predict_collectives,
    stage_units,
    unit_numel,
)


def test_micro_batch_controls_are_the_zero_table() -> None:
    # (requires_gradient_sync, reshard_after_backward) for an early and the last micro-batch
    got = {
        z: [tuple(vars(micro_batch_controls(z, last)).values()) for last in (False, True)]
        for z in (1, 2, 3)
    }
    assert got == {
        1: [(False, False), (True, True)],
        2: [(True, False), (True, True)],
        3: [(True, True), (True, True)],
    }


def test_unit_numel_pads_the_first_dimension() -> None:
    assert unit_numel([(5, 3), (4,)], 2) == 6 * 3 + 4
    assert unit_numel([(5, 3), (4,)], 1) == 5 * 3 + 4


def test_without_a_pipeline_counts_follow_the_table() -> None:
    model = get_preset("tiny")
    units = stage_units(model, 0, 1)
    assert len(units) == model.n_layers + 1  # blocks, then the root
    got = {
        z: predict_collectives(model, dp_shard=2, zero_stage=z, microbatches=4) for z in (1, 2, 3)
    }
    assert [(c.param_allgathers, c.grad_reduces) for c in got.values()] == [
        (5, 5), (5, 20), (40, 20),
    ]  # fmt: skip
    one_pass = sum(unit_numel(u, 2) for u in units) * 4  # fp32
    assert got[1].param_allgather_bytes == got[1].grad_reduce_bytes == one_pass
    assert got[3].param_allgather_bytes == 8 * one_pass
    assert predict_collectives(model, dp_shard=1, zero_stage=3, microbatches=4).to_dict() == {
        "param_allgathers": 0, "grad_reduces": 0,
        "param_allgather_bytes": 0, "grad_reduce_bytes": 0,
        "grad_allreduces": 0, "grad_allreduce_bytes": 0,
    }  # fmt: skip


def test_all_reduces_across_replicas_and_of_a_tied_embedding() -> None:
    """replicate (dp_shard 1) all-reduces every unit's whole gradients once per step; HSDP
    all-reduces each reduce-scatter's output (the unit's shard); a tied pipeline adds one
    all-reduce of the local embedding gradient on pp ranks 0 and pp - 1, none in a V."""
    model = get_preset("tiny")
    units = stage_units(model, 0, 1)
    whole = sum(unit_numel(u, 1) for u in units) * 4
    rep = predict_collectives(model, dp_shard=1, zero_stage=1, microbatches=4, replicas=2)
    assert rep.to_dict() == {
        "param_allgathers": 0, "grad_reduces": 0,
        "param_allgather_bytes": 0, "grad_reduce_bytes": 0,
        "grad_allreduces": 5, "grad_allreduce_bytes": whole,
    }  # fmt: skip
    hsdp = predict_collectives(model, dp_shard=2, zero_stage=3, microbatches=4, replicas=2)
    assert hsdp.grad_allreduces == hsdp.grad_reduces == 20
    assert hsdp.grad_allreduce_bytes == hsdp.grad_reduce_bytes // 2
    tied = dataclasses.replace(model, tie_embeddings=True)
    emb = 4 * tied.vocab_size * tied.dim
    order = [("F", 0), ("B", 0)]
    for rank, n in ((0, 1), (1, 0), (2, 0), (3, 1)):  # pp 4: ranks 0 and 3
        c = predict_collectives(tied, dp_shard=1, zero_stage=1, microbatches=4, pp=4,
                                pp_rank=rank, order=order)  # fmt: skip
        assert (c.grad_allreduces, c.grad_allreduce_bytes) == (n, n * emb)
    sharded = predict_collectives(tied, dp_shard=2, zero_stage=1, microbatches=4, pp=2,
                                  pp_rank=1, order=[("F", 1), ("B", 1)])  # fmt: skip
    assert sharded.grad_allreduces == 1 and sharded.grad_allreduce_bytes == emb // 2
    v = predict_collectives(tied, dp_shard=1, zero_stage=1, microbatches=4, pp=2,
                            schedule="zbv", chunks=2, pp_rank=0)  # fmt: skip
    assert v.grad_allreduces == 0


@pytest.mark.parametrize(
    ("schedule", "chunks"),
    [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2),
     ("dualpipev", 2)],
)  # fmt: skip
def test_up_to_three_chunks_gather_once_or_m_plus_one_times(schedule, chunks) -> None:
    for rank, ops in enumerate(schedule_ops(schedule, 2, 4, chunks)):
        order = [(op.kind, op.stage) for op in ops]
        assert set(pipeline_gathers(1, order).values()) == {1}, (schedule, rank)
        assert set(pipeline_gathers(3, order).values()) == {5}, (schedule, rank)


def test_four_chunks_evict_and_gather_again() -> None:
    """Interleaved 1F1B with 4 chunks per rank: torch keeps 3 stages gathered, so stages are
    gathered again within the step. Measured: rank 0 (stages 0, 2, 4, 6) 11 gathers of its
    4 blocks and 4 of the embedding; rank 1, 9 and 2 of the head (zero 1); zero 3, 22 and 6,
    23 and 6."""
    model = get_preset("tiny").with_overrides(n_layers=8)
    orders = schedule_ops("interleaved_1f1b", 2, 4, 4)
    want = {(1, 0): (11, 4), (1, 1): (9, 2), (3, 0): (22, 6), (3, 1): (23, 6)}
    for (z, rank), (blocks, root) in want.items():
        order = [(op.kind, op.stage) for op in orders[rank]]
        per_stage = pipeline_gathers(z, order)
        root_stage = 0 if rank == 0 else 7
        assert per_stage[root_stage] == root, (z, rank, per_stage)
        assert sum(per_stage.values()) == blocks, (z, rank, per_stage)
        c = predict_collectives(
            model, dp_shard=2, zero_stage=z, microbatches=4, pp=2,
            schedule="interleaved_1f1b", chunks=4, pp_rank=rank, order=order,
        )  # fmt: skip
        assert (c.param_allgathers, c.grad_reduces) == (blocks + root, 5)


def test_a_tied_pipeline_gathers_the_last_stages_copy() -> None:
    """Tied embeddings under pp: the last stage's root holds a copy of the embedding.
    Measured (tied tiny model, pp 2 x dp_shard 2, 1F1B, 4 micro-batches, zero 1): rank 1 gathers
    462,080 bytes per step, rank 0 461,824."""
    model = get_preset("tiny").with_overrides(tie_embeddings=True)
    v, d = model.vocab_size, model.dim
    assert (v, d) in stage_units(model, 1, 2)[-1]
    # one process: the embedding alone, which the head reads
    assert stage_units(model, 0, 1)[-1].count((v, d)) == 1
    got = []
    for rank, ops in enumerate(schedule_ops("1f1b", 2, 4)):
        order = [(op.kind, op.stage) for op in ops]
        c = predict_collectives(
            model, dp_shard=2, zero_stage=1, microbatches=4, pp=2, pp_rank=rank, order=order
        )
        got.append(c.param_allgather_bytes)
    assert got == [461_824, 462_080]
