"""FSDP2 under a pipeline holds every unit's unsharded gradients and parameters until the step's
end, as the planner predicts (issue 12).

torch.distributed.pipelining turns FSDP2's gradient sync and its reshard-after-backward off for
every micro-batch and reduce-scatters once after the last (`backward_maybe_with_nosync`,
`perform_reduce_grad`). Four gloo ranks (pp=2 x dp_shard=2) train the tiny model; right before
each stage's reduce-scatter the unsharded fp32 gradients and the unsharded parameters
(param_dtype) it holds equal the planner's `grads` and `working_params` for that stage, exactly.
"""

from __future__ import annotations

import json

import pytest
from parallel_harness import HERE, torchrun

pytestmark = pytest.mark.slow

LAYOUTS = ["bf16:3", "fp32:2"]


def test_fsdp_under_pp_holds_what_the_planner_predicts(tmp_path) -> None:
    out = tmp_path / "held.json"
    torchrun(4, str(HERE / "fsdp_pp_worker.py"), str(out), *LAYOUTS, timeout=300)
    rows = [r for f in sorted(tmp_path.glob("held.json.rank*")) for r in json.loads(f.read_text())]
    assert sorted((r["layout"], r["pp_rank"]) for r in rows) == sorted(
        (layout, rank) for layout in LAYOUTS for rank in (0, 1)
    )
    for r in rows:
        assert r["measured"]["grads"] > 0, r
        assert r["measured"] == r["predicted"], r
