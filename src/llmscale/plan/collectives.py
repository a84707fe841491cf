"""Alpha-beta cost of collectives: a fixed latency per step plus bytes over bandwidth.

Conventions. `n` ranks; `nbytes` is the size of the *full* buffer on one rank: the tensor being
all-reduced, the gathered output of an all-gather, the input of a reduce-scatter, everything a
rank sends in an all-to-all, the message of a p2p send. `bw` is bytes/s in each direction per
rank, `alpha` seconds per step. The formulas are the standard ones (Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009) and the ones
NCCL's own tuner uses (github.com/NVIDIA/nccl, src/graph/tuning.cc):

- ring all-reduce = reduce-scatter + all-gather: 2(n-1) steps, each rank sends 2(n-1)/n of the
  buffer:  T = 2(n-1)*alpha + 2(n-1)/n * nbytes/bw
- ring all-gather, ring reduce-scatter: T = (n-1)*alpha + (n-1)/n * nbytes/bw
- double binary tree all-reduce (Sanders, Speck & Traeff, "Two-tree algorithms for full
  bandwidth broadcast, reduction and scan", Parallel Computing 2009; NCCL 2.4+): reduce up and
  broadcast down two complementary trees, each carrying half the data, pipelined; every rank
  sends and receives about the whole buffer in each phase, so
  T = 2*ceil(log2 n)*alpha + 2*nbytes/bw  (NCCL: algorithm bandwidth = bus bandwidth / 2)
- all-to-all (pairwise exchange): T = (n-1)*alpha + (n-1)/n * nbytes/bw
- p2p: T = alpha + nbytes/bw

Groups that span nodes (`g` ranks on each of `k` nodes, n = g*k) see two links: the scale-up
link inside a node and the NICs between nodes. Three algorithms are costed and the cheapest kept,
as NCCL's tuner picks per call:

- flat ring across nodes: NCCL builds one ring per NIC, each crossing every node boundary once,
  so the ring's bandwidth is the bottleneck min(bw_intra, g * bw_nic_per_gpu), and of its
  2(n-1) steps 2(k-1) cross the network:
  T = 2(n-k)*alpha_intra + 2(k-1)*alpha_inter + 2(n-1)/n * nbytes/bw_bottleneck
- hierarchical (2-D): reduce-scatter inside the node (g ranks), all-reduce of the 1/g shard
  across nodes (k ranks, g such all-reduces in parallel, one per rail, each on one GPU's share of
  the NICs), all-gather inside the node:
  T = RS_intra(nbytes, g) + AR_inter(nbytes/g, k) + AG_intra(nbytes, g)
- tree: a double binary tree over the k nodes with a chain inside each node (NCCL's layout):
  T = 2*((g-1)*alpha_intra + ceil(log2 k)*alpha_inter) + 2*nbytes/bw_bottleneck

Where a tree is chosen, its bandwidth is taken as TREE_BW_EFFICIENCY (0.9) of the link's, as
NCCL's tuner does; the single-link functions below are the plain formulas.

All-gather and reduce-scatter across nodes take the flat ring or the hierarchical form (the
inter-node phase runs on 1/g of the data). p2p across nodes uses one GPU's NIC share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import Link, Node
from llmscale.hardware.spec import Sourced
from llmscale.plan.cache import memoize

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
# NCCL's tuner derates tree bandwidth to 0.9 of the ring's bus bandwidth (tuning.cc:
# `busBw = min(busBw * .9, maxTreeBw)`), which is why rings win for large messages.
TREE_BW_EFFICIENCY = 0.9


# ---- single-link formulas -----------------------------------------------------------------


def _check(nbytes: float, n: int, bw: float, alpha: float) -> None:
    if nbytes < 0:
        raise ConfigError("nbytes", nbytes, ">= 0")
    if n < 1:
        raise ConfigError("n", n, "an integer >= 1")
    if bw <= 0:
        raise ConfigError("bw", bw, "> 0 bytes/s")
    if alpha < 0:
        raise ConfigError("alpha", alpha, ">= 0 s")


def ring_all_reduce(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """2(n-1)*alpha + 2(n-1)/n * nbytes/bw."""
    _check(nbytes, n, bw, alpha)
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw


def ring_all_gather(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """(n-1)*alpha + (n-1)/n * nbytes/bw, nbytes = the gathered (output) size."""
    _check(nbytes, n, bw, alpha)
    if n == 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


def ring_reduce_scatter(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """(n-1)*alpha + (n-1)/n * nbytes/bw, nbytes = the input (unreduced) size."""
    return ring_all_gather(nbytes, n, bw, alpha)


def tree_all_reduce(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Double binary tree: 2*ceil(log2 n)*alpha + 2*nbytes/bw."""
    _check(nbytes, n, bw, alpha)
    if n == 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bw


def all_to_all(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Pairwise exchange: (n-1)*alpha + (n-1)/n * nbytes/bw, nbytes = all a rank sends."""
    _check(nbytes, n, bw, alpha)
    if n == 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


def p2p(nbytes: float, bw: float, alpha: float) -> float:
    """alpha + nbytes/bw."""
    _check(nbytes, 1, bw, alpha)
    return alpha + nbytes / bw


# ---- groups on a fabric ---------------------------------------------------------------------


@dataclass(frozen=True)
class Fabric:
    """The links a job's collectives run on: scale-up inside a node, NICs between nodes."""

    intra: Link
    inter: Link
    gpus_per_node: int
    nics_per_node: int

    @classmethod
    def of(cls, node: Node, intra: Link, inter: Link) -> Fabric:
        return cls(intra, inter, node.gpus_per_node, node.nics_per_node)

    @property
    def nic_bw_per_gpu(self) -> float:
        """Each GPU's share of its node's NIC bandwidth (bytes/s each way)."""
        return self.inter.bandwidth * self.nics_per_node / self.gpus_per_node

    def with_inter_bandwidth_scale(self, scale: float) -> Fabric:
        """The same fabric with NIC bandwidth multiplied by `scale` (oversubscription, tests)."""
        bw = self.inter.bandwidth_GBps
        inter = replace(
            self.inter, bandwidth_GBps=Sourced(bw.value * scale, f"{bw.source} x {scale}")
        )
        return Fabric(self.intra, inter, self.gpus_per_node, self.nics_per_node)


@dataclass(frozen=True)
class Cost:
    """Seconds one collective takes, and the algorithm that gave them."""

    seconds: float
    algorithm: str


@memoize
def collective(op: str, nbytes: float, n: int, per_node: int, fabric: Fabric) -> Cost:
    """Cost of `op` over `n` ranks placed `per_node` to a node (the cheapest algorithm).

    per_node = n means the group sits inside one node; per_node = 1 means one rank per node
    (a data-parallel group across tensor/pipeline blocks of 8).
    """
    if op not in OPS:
        raise ConfigError("op", op, " | ".join(OPS))
    if n < 1 or per_node < 1 or n % per_node:
        raise ConfigError("per_node", per_node, f"a divisor of the group size n={n}")
    if per_node > fabric.gpus_per_node:
        raise ConfigError("per_node", per_node, f"<= gpus per node = {fabric.gpus_per_node}")
    if n == 1 and op != "p2p":
        return Cost(0.0, "none")
    intra, inter = fabric.intra, fabric.inter
    nodes = n // per_node
    if op == "p2p":
        if per_node >= 2 or nodes == 1:
            pair = min(intra.pair_bandwidth, intra.bus_bandwidth)
            return Cost(p2p(nbytes, pair, intra.latency), "p2p-intra")
        return Cost(p2p(nbytes, fabric.nic_bw_per_gpu, inter.latency), "p2p-inter")
    if nodes == 1:
        return _intra(op, nbytes, n, intra)
    g, k = per_node, nodes
    bottleneck = min(intra.bus_bandwidth, g * fabric.nic_bw_per_gpu)
    if op == "all_to_all":
        # Every rank sends (n-g)/n of its data across nodes over its own NIC share.
        t = (n - 1) * inter.latency + (n - g) / n * nbytes / fabric.nic_bw_per_gpu
        t += (g - 1) / n * nbytes / intra.bus_bandwidth
        return Cost(t, "pairwise")
    steps = 2 if op == "all_reduce" else 1
    ring = steps * ((n - k) * intra.latency + (k - 1) * inter.latency)
    ring += steps * (n - 1) / n * nbytes / bottleneck
    options = [Cost(ring, "ring")]
    if g > 1:
        shard = nbytes / g
        if op == "all_reduce":
            across = min(
                ring_all_reduce(shard, k, fabric.nic_bw_per_gpu, inter.latency),
                tree_all_reduce(
                    shard, k, TREE_BW_EFFICIENCY * fabric.nic_bw_per_gpu, inter.latency
                ),
            )
            local = 2 * ring_all_gather(nbytes, g, intra.bus_bandwidth, intra.latency)
        else:
            across = ring_all_gather(shard, k, fabric.nic_bw_per_gpu, inter.latency)
            local = ring_all_gather(nbytes, g, intra.bus_bandwidth, intra.latency)
        options.append(Cost(local + across, "hierarchical"))
    if op == "all_reduce":
        tree = 2 * ((g - 1) * intra.latency + math.ceil(math.log2(k)) * inter.latency)
        tree += 2 * nbytes / (TREE_BW_EFFICIENCY * bottleneck)
        options.append(Cost(tree, "tree"))
    return min(options, key=lambda c: c.seconds)


def _intra(op: str, nbytes: float, n: int, link: Link) -> Cost:
    bw, a = link.bus_bandwidth, link.latency
    if op == "all_reduce":
        ring = ring_all_reduce(nbytes, n, bw, a)
        tree = tree_all_reduce(nbytes, n, TREE_BW_EFFICIENCY * bw, a)
        return Cost(ring, "ring") if ring <= tree else Cost(tree, "tree")
    if op == "all_to_all":
        return Cost(all_to_all(nbytes, n, bw, a), "pairwise")
    return Cost(ring_all_gather(nbytes, n, bw, a), "ring")
