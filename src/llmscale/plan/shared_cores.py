"""A step of several CPU ranks sharing a machine's cores, over gloo (the demo's layout).

The planner's step (plan/time.py) prices one rank's kernels at one process's measured rates and
its collectives on the cluster's links. Ranks that outnumber the cores and talk over loopback
pay what that leaves out; train/shared_cores.py measures it (`SharedCoreCosts`) and this module
composes it with the planner's step:

    step = step_overhead_s                                  (measured: a one-token step)
         + oversubscription x (matmul + elementwise)       (the tokens' compute, shared cores)
         + tp_comm                                         (the tokens' all-reduces, gloo link)

each token-proportional term net of the same term for one token per micro-batch (`one_token`),
which the measured overhead already holds. The overhead replaces the planner's fixed terms
(dispatch, the optimizer, FSDP's gathers and reductions, the loss's reductions): the measured
one-token step runs exactly those, on the run's own stack, under the same sharing of the cores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmscale.hardware.catalog import Link
from llmscale.hardware.spec import Sourced
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.time import StepTime

TOKEN_TERMS = ("matmul", "elementwise")  # scaled by the oversubscription
COMM_TERMS = ("tp_comm",)  # on the measured gloo link
SOURCE = "measured by llmscale on this machine's ranks (train/shared_cores.py)"


@dataclass(frozen=True, kw_only=True)
class SharedCoreCosts:
    """What ranks sharing a CPU's cores cost beyond one process's kernels (CPU stack costs, kept
    apart from a device's rates: train/shared_cores.py measures them, every rank at once)."""

    oversubscription: float  # a fixed GEMM's time on every rank at once / on one rank alone
    allreduce_latency_s: float  # gloo all-reduce over the tp group: t(S) = latency + S / rate
    allreduce_bytes_per_s: float
    step_overhead_s: float  # an optimizer step of the run's stack on one token per micro-batch
    other_load_cores: float  # other processes' CPU use while measuring, cores on average
    measured_at: float  # unix time


def overhead_seq_len(plan: Plan) -> int:
    """Tokens per sequence of the measured overhead step: one, or one per tp rank where
    sequence parallelism splits the sequence over them."""
    return plan.tp if plan.sequence_parallel else 1


def one_token(plan: Plan) -> Plan:
    """`plan` at `overhead_seq_len` tokens per sequence (the same micro-batches): the work of
    the measured overhead step, which the token-proportional terms are net of."""
    return dataclasses.replace(plan, seq_len=overhead_seq_len(plan))


def gloo_cluster(cluster: Cluster, plan: Plan, costs: SharedCoreCosts) -> Cluster:
    """`cluster` whose links are the measured gloo all-reduce, as the planner's ring all-reduce
    over tp ranks reads them (2 (n - 1) latencies and 2 (n - 1) / n of the bytes per link):
    exact for tp = 2; over more ranks the planner may price a tree, lower in latency."""
    n = max(plan.tp, 2)
    link = Link(
        name="gloo",
        display="gloo over loopback (measured)",
        kind="scale-up",
        bandwidth_GBps=Sourced(costs.allreduce_bytes_per_s * 2 * (n - 1) / n / 1e9, SOURCE),
        latency_us=Sourced(1e6 * costs.allreduce_latency_s / (2 * (n - 1)), SOURCE),
    )
    fabric = dataclasses.replace(cluster.fabric, intra=link, inter=link)
    return dataclasses.replace(cluster, fabric=fabric)


def shared_cores_step(
    step: StepTime, one: StepTime, costs: SharedCoreCosts
) -> tuple[float, dict[str, float]]:
    """Seconds per step and where they go, from the planner's step of the run (`step`) and of
    `one_token(plan)` (`one`), both on `gloo_cluster`."""

    def net(key: str) -> float:
        return max(0.0, step.breakdown.get(key, 0.0) - one.breakdown.get(key, 0.0))

    parts = {"step_overhead": costs.step_overhead_s}
    for key in TOKEN_TERMS:
        parts[key] = costs.oversubscription * net(key)
    for key in COMM_TERMS:
        parts[key] = net(key)
    return sum(parts.values()), parts
