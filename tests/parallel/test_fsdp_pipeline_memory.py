"""FSDP2 under a pipeline holds every unit's unsharded gradients and parameters until the step's
end, as the planner predicts (issue 12).

torch.distributed.pipelining turns FSDP2's gradient sync and its reshard-after-backward off for
every micro-batch and reduce-scatters once after the last (`backward_maybe_with_nosync`,
`perform_reduce_grad`). Four gloo ranks (pp=2 x dp_shard=2, or pp=2 x dp_replicate=2: replicate)
train the tiny model; right before each stage's reduction the unsharded gradients and the
unsharded parameters (param_dtype) the rank holds equal the planner's `grads` and
`working_params` for that rank, exactly, and so does the most the rank holds at any point of the
step (`peak_params`: gathered units plus all-gathers issued and not yet copied out).

A V (zbv) holds the planner's working_params too, at the step's start: the schedule issues the
all-gathers of both of the rank's stages there (`_add_unshard_reshard`), and reshards a stage
once it has no op left in the step, so at the end only the first stage's units are gathered
(pp rank 0, bf16 zero 3: 264,832 B untied). With tied embeddings the last stage's root unit
(final norm and the one tied weight) is gathered by the first stage's embedding and stays until
the last stage's own forward reshards it (zero 3): it adds nothing to that peak (231,040 B).

Gradients, every schedule: a chunk's fp32 accumulator lives from its first post-backward to its
reduction, so a rank's chunks need not hold theirs at once (interleaved with one round of
micro-batches: one chunk at a time), and a split backward's W leaves param_dtype gradients
beside it until the chunk's next B or its reduction (zbv, dualpipev, zero_bubble); in a tied V
the first stage's lookup adds to the last stage's tied weight after that stage's post-backward.
The planner walks the schedule's op order (`schedule.held_grad_points`). Before it counted
every chunk's accumulator at once and nothing waiting: on the tied V's rank 0 (bf16 zero 3)
462,080 B against 594,560 measured, untied 529,664 against 397,440, interleaved 461,824
against 264,704.

Under replicate FSDP2's param_dtype replaces autocast: the rank holds every parameter's copy in
param_dtype (bf16 or fp32), not autocast's casts of the linear weights (the planner's figure
before: 230,400 B against 231,040 on the tied V's rank 0, bf16; none in fp32).
"""

from __future__ import annotations

import json

import pytest
from parallel_harness import HERE, torchrun

pytestmark = pytest.mark.slow

LAYOUTS = [
    "bf16:3",
    "fp32:2",
    "bf16:3:zbv",
    "bf16:3:zbv:tied",
    "bf16:1:zbv:tied:replicate",
    "fp32:1:1f1b:replicate",
    "bf16:3:interleaved_1f1b:v2",
    "bf16:3:zero_bubble:v2:m4",
    "bf16:3:dualpipev:tied:m4",
]


def test_fsdp_under_pp_holds_what_the_planner_predicts(tmp_path) -> None:
    out = tmp_path / "held.json"
    torchrun(4, str(HERE / "fsdp_pp_worker.py"), str(out), *LAYOUTS, timeout=400)
    rows = [r for f in sorted(tmp_path.glob("held.json.rank*")) for r in json.loads(f.read_text())]
    assert sorted((r["layout"], r["pp_rank"]) for r in rows) == sorted(
        (layout, rank) for layout in LAYOUTS for rank in (0, 1)
    )
    for r in rows:
        got, want = r["measured"], r["predicted"]
        assert got["grads"] > 0 and got["peak_params"] == want["params"], r
        assert got["grads"] == want["grads"], r  # the most held at any reduction
        one_stage = "zbv" not in r["layout"] and "dualpipev" not in r["layout"]
        if one_stage and "v2" not in r["layout"]:  # all of its stage held at its reduction
            assert got["params"] == want["params"], r
        elif r["pp_rank"] == 0 and not one_stage:  # the V's rank 0 ends with its first stage
            assert got["params"] < got["peak_params"], r
