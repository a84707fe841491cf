"""What `llmscale network` prints: each network for the GPUs, and the best plan's time on it.

The plan is the planner's fastest for the model on a rail-optimized fat-tree of those GPUs; its
tensor-, data- and pipeline-parallel peers across nodes share a rail, so a rail-only network
(Wang et al. 2023, arXiv:2307.12169; see plan/network.py) leaves its step time unchanged. Only
traffic between rails, such as a mixture-of-experts all-to-all, pays for the NVLink hop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from rich.table import Table

from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig
from llmscale.plan import network
from llmscale.plan.cluster import Cluster
from llmscale.plan.search import search
from llmscale.plan.time import estimate_step_time
from llmscale.report import report

# The all-to-all overhead of rail-only over a fat-tree that Wang et al. 2023 report.
PUBLISHED_A2A_OVERHEAD = "+8.2% to +11.2%"


class NetworkReport(NamedTuple):
    """The topologies side by side, then the sentences that read them."""

    rows: list[network.NetworkRow]
    table: Table
    lines: list[str]


def network_report(
    model: ModelConfig,
    gpus: int,
    gpu: str,
    seq: int = 4096,
    global_batch: int | None = None,
    a2a_mb: float = 256.0,
) -> NetworkReport:
    """Size every network for `gpus` x `gpu` and cost the best plan for `model` on each."""
    base = Cluster.of(gpu)
    network.check_gpus(gpus, gpu)
    if global_batch is not None and global_batch <= 0:
        raise ConfigError("global_batch", global_batch, "a positive number of sequences")
    if not (math.isfinite(a2a_mb) and a2a_mb > 0):
        raise ConfigError("a2a_mb", a2a_mb, "a finite number of MB > 0")
    gbs = gpus if global_batch is None else global_batch
    found = search(model, gpus, base, seq, gbs, top=1)
    if not found.candidates:
        raise ConfigError("gpus", gpus, f"enough GPUs for a {model.name} plan to fit")
    best = found.candidates[0].plan
    rows = network.compare(gpus, gpu, lambda c: estimate_step_time(best, c).seconds, a2a_mb * 1e6)
    lab = report.plan_label(best)
    layout = ", ".join(f"{k} {lab[k]}" for k in ("tp", "pp", "dp", "mbs", "recompute"))
    fat, rail = rows[0].all_to_all_seconds, rows[1].all_to_all_seconds
    lines = [
        f"plan: {model.name}, seq {seq}, global batch {gbs}: {layout}. Its tensor-, data- "
        "and pipeline-parallel peers across nodes share a rail, so rail-only leaves its step "
        "time unchanged",
        f"all-to-all of {a2a_mb:g} MB per GPU (MoE-style): rail-only {rail / fat - 1:+.1%} "
        f"for forwarding cross-rail bytes over NVLink (Wang et al. 2023 report "
        f"{PUBLISHED_A2A_OVERHEAD})",
    ]
    return NetworkReport(rows, report.network_table(rows, gpus, gpu), lines)
