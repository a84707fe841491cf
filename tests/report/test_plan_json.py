"""plan --json: each llmscale candidate carries the collectives its metrics rows will count."""

from __future__ import annotations

from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.search import SearchSpace, search
from llmscale.report.report import search_json
from llmscale.stack.residency import predict_collectives


def test_candidates_carry_the_runtime_collectives() -> None:
    model = get_preset("llama3-8b")
    space = SearchSpace(tp=1, pp=1, dp_shard=8, zero_stages=(1,), micro_batch_sizes=(1,))
    res = search(model, 8, Cluster.of("h100"), 4096, 64, top=1, space=space)
    (c,) = search_json(res, {"stack": "llmscale"})["candidates"]
    want = predict_collectives(model, dp_shard=8, zero_stage=1, microbatches=8, param_bytes=2)
    assert c["collectives"] == want.to_dict()
    # zero 1: every unit gathered once per step and reduced once
    assert c["collectives"]["param_allgathers"] == c["collectives"]["grad_reduces"]
    (other,) = search_json(res, {"stack": "torchtitan"})["candidates"]
    assert "collectives" not in other
