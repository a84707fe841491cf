"""`Plan`: generated from the config's keys, and cache keys that name every field a result reads.

Every field of `Plan` is perturbed in turn; for each cached planner result (a rank's states, its
activations at the peak, its micro-batch time), either the field is in the cache key (the key
changes) or the result does not depend on it. A field missing from a key would otherwise give
stale, silently wrong predictions.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from typing import Any

import pytest

from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.model.config import get_preset
from llmscale.plan import cache
from llmscale.plan import time as tm
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import (
    DEFAULT_OPTIONS,
    pipeline_held,
    rank_activation_bytes,
    rank_block_bytes,
    rank_pieces,
    rank_states,
)
from llmscale.plan.plan import Plan

L7 = get_preset("llama2-7b")
TINY = get_preset("tiny")
H200 = Cluster.of("h200")

BASES = {
    "pp2_fsdp_tp": Plan(
        model=L7, seq_len=2048, micro_batch_size=1, global_batch_size=16, precision="bf16",
        dp_shard=2, tp=2, pp=2, recompute="every_k", recompute_every_k=3,
    ),
    "interleaved_sp_offload": Plan(
        model=L7, seq_len=1024, micro_batch_size=2, global_batch_size=32, precision="bf16",
        dp_replicate=2, tp=4, pp=2, pp_schedule="interleaved_1f1b", pp_chunks=2,
        sequence_parallel=True, offload="optimizer",
    ),
    "one_rank": Plan(model=TINY, seq_len=64, micro_batch_size=2, global_batch_size=8),
    "zbv_split_backward": Plan(
        model=L7, seq_len=1024, micro_batch_size=1, global_batch_size=8, precision="bf16",
        tp=2, pp=2, pp_schedule="zbv", pp_chunks=2, recompute="selective",
    ),
    "fp8_rowwise": Plan(
        model=L7, seq_len=1024, micro_batch_size=1, global_batch_size=8, precision="fp8",
        float8_recipe="rowwise", dp_shard=2,
    ),
}  # fmt: skip

# Another value of each field (a list: the first that gives a valid plan is used).
OTHER: dict[str, list[Any]] = {
    "model": [dataclasses.replace(L7, name="other", ffn_dim=8192), get_preset("small")],
    "seq_len": [512, 32],
    "micro_batch_size": [4, 1],
    "global_batch_size": [64, 16],
    "recompute": ["full", "selective", "none"],
    "recompute_every_k": [2, 4],
    "precision": ["fp32", "fp16"],
    "offload": ["optimizer+params", "none"],
    "lsp_dim": [64, 512],
    "lsp_nonzeros": [4, 16],
    "dp_replicate": [2, 1],
    "dp_shard": [1, 4],
    "tp": [1, 2],
    "pp": [1, 2],
    "pp_schedule": ["gpipe", "1f1b"],
    "pp_chunks": [3, 1],
    "pp_layers": [(15, 17), (7, 9, 8, 8), (4,)],
    "cp": [2, 1],
    "sequence_parallel": [False, True],
    "zero_stage": [1, 2],
    "offload_activations": [2, 0],
    "float8_recipe": ["rowwise", "tensorwise"],
}

RESULTS: dict[str, tuple[Callable[[Plan], tuple[Any, ...]], Callable[[Plan, int], Any]]] = {
    "states": (Plan.states_key, lambda p, r: rank_states(p, r, DEFAULT_OPTIONS)),
    "activations": (Plan.activations_key, lambda p, r: rank_activation_bytes(p, r)),
    "pipeline held": (Plan.pipeline_key, lambda p, r: pipeline_held(p, r)),
    "rank blocks": (Plan.blocks_key, lambda p, r: rank_block_bytes(p, r)),
    "every piece": (
        lambda p: (*p.states_key(), *p.activations_key()),
        lambda p, r: rank_pieces(p, r),
    ),
    "stage time": (
        Plan.stage_time_key,
        lambda p, r: (lambda t: (t.stage_fwd[r], t.stage_bwd[r]))(
            tm.estimate_step_time(p, H200, validate=False)
        ),
    ),
}


def test_every_field_is_listed() -> None:
    assert set(OTHER) == {f.name for f in dataclasses.fields(Plan)}


# The only (base, field) pairs with no valid perturbation among OTHER's values (the runtime's
# rules: pp's schedule and chunks need pp > 1, sequence parallelism needs tp > 1, ...).
NO_OTHER_VALID = {
    ("interleaved_sp_offload", "pp"),
    ("interleaved_sp_offload", "pp_schedule"),
    ("pp2_fsdp_tp", "pp_chunks"),
    ("one_rank", "pp_chunks"),
    ("one_rank", "sequence_parallel"),
    ("zbv_split_backward", "pp"),  # a V holds exactly 2 chunks: other pp fail its microbatch rule
    ("zbv_split_backward", "pp_schedule"),
    # optimizer offload with cp > 1: config.offload_layout_problem
    ("interleaved_sp_offload", "cp"),
    # activation offload: pp 1 only (Megatron-Core's rule)
    ("pp2_fsdp_tp", "offload_activations"),
    ("interleaved_sp_offload", "offload_activations"),
    ("zbv_split_backward", "offload_activations"),
    # a float8 recipe other than tensorwise needs fp8; fp8_rowwise is one rank of pp and tp 1
    ("pp2_fsdp_tp", "float8_recipe"),
    ("interleaved_sp_offload", "float8_recipe"),
    ("one_rank", "float8_recipe"),
    ("zbv_split_backward", "float8_recipe"),
    ("fp8_rowwise", "precision"),
    ("fp8_rowwise", "pp_chunks"),
    ("fp8_rowwise", "pp_layers"),
    ("fp8_rowwise", "sequence_parallel"),
}


def _valid(plan: Plan) -> bool:
    """Whether the runtime accepts the plan: a ConfigError is its one way of saying no; any
    other exception is a bug and fails the test instead of turning it into a skip."""
    try:
        plan.validate()
    except ConfigError:
        return False
    return True


def _perturbed(base: Plan, name: str) -> Plan | None:
    for value in OTHER[name]:
        if value == getattr(base, name):
            continue
        p = dataclasses.replace(base, **{name: value})
        if _valid(p):
            return p
    return None


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("name", list(OTHER))
def test_a_key_names_every_field_its_result_reads(base: str, name: str) -> None:
    a = BASES[base]
    b = _perturbed(a, name)
    assert (b is None) == ((base, name) in NO_OTHER_VALID)  # a new skip is a failure
    if b is None:
        pytest.skip(f"no valid plan with another {name} from {base}")
    for what, (key, result) in RESULTS.items():
        for rank in sorted({0, a.pp - 1} & {0, b.pp - 1}):
            ka, kb = key(a), key(b)
            if ka == kb:
                cache.clear_all()
                ra = result(a, rank)
                cache.clear_all()
                rb = result(b, rank)
                assert ra == rb, f"{what} of rank {rank} reads {name}, its key does not name it"


@pytest.mark.parametrize("base", list(BASES))
def test_plan_and_job_config_convert_both_ways(base: str) -> None:
    plan = BASES[base]
    assert Plan.from_job(plan.to_job()) == plan
    # The overrides `llmscale plan` prints reproduce the plan in `llmscale train`.
    args = shlex.split(" ".join(plan.overrides()))
    assert Plan.from_job(load_config(None, args)) == dataclasses.replace(plan, model=plan.model)


def test_plan_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        Plan(TINY, 64, 2, 8)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASES["one_rank"].tp = 2  # type: ignore[misc]


def test_clear_all_empties_every_memo() -> None:
    rank_activation_bytes(BASES["one_rank"], 0)
    assert cache.entries() > 0
    cache.clear_all()
    assert cache.entries() == 0
