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
(A V's gradients are not compared: zbv's weight halves run after FSDP2's post-backward hook, so
a stage holds param_dtype gradients beside its fp32 accumulated ones until its reduction;
measured on the tied V's pp rank 0, bf16 zero 3: 594,560 B at the first stage's reduction
against the planner's 462,080, the last stage's param_dtype gradients.)

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
        if "zbv" not in r["layout"]:  # one stage per rank: all of it held at its reduction
            assert {k: got[k] for k in want} == want, r
        elif r["pp_rank"] == 0:  # the V's rank 0 ends with its first stage alone gathered
            assert got["params"] < got["peak_params"], r
