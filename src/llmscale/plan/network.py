"""Rail-optimized fat-tree vs rail-only networks: switches, links, cost, and step-time impact.

Wang et al. 2023 ("How to Build Low-cost Networks for Large Language Models (without
Sacrificing Performance)", arXiv:2307.12169) observe that LLM training traffic outside the
high-bandwidth (NVLink) domain stays within rails (NIC i of every node talks to NIC i of the
others) and remove the spine that joins rails; the little cross-rail traffic (MoE all-to-all)
is forwarded over NVLink to a GPU on the right rail first.

Switch counting, for E endpoints (NIC ports) on switches of radix k, non-blocking Clos:
- E <= k: one switch, E links.
- E <= k^2/2 (2 tiers): ceil(E / (k/2)) leaves with k/2 ports down and k/2 up, ceil(E/k) spines;
  links E + E.
- E <= k^3/4 (3 tiers): leaves and aggregation switches ceil(E / (k/2)) each, ceil(E/k) cores
  (5E/k in all, the folded-Clos count of Al-Fares et al. 2008); links 3E.
A rail-optimized fat-tree is one Clos over all E ports (rails decide which leaf a NIC plugs
into, not how many switches). Rail-only builds one Clos per rail over E / rails ports and no
spine between them.
Cost = switches x switch price + per link one cable and one transceiver per end that is not a
co-packaged switch port (the NIC end always has one). Prices are assumptions (network.toml).

Step-time impact: with the runtime's rank order (tp innermost, then data parallel, then
pipeline), every inter-node peer of a GPU in a tensor-, data- or pipeline-parallel group has
the same local rank, so all of a dense model's inter-node traffic is same-rail and a rail-only
network costs nothing in step time (the planner's step time is computed on both and compared).
All-to-all across nodes (MoE expert parallelism) is not same-rail: rail-only first moves the
(g-1)/g of each GPU's cross-node bytes bound for other rails over NVLink, then sends them on
the rail; `all_to_all_seconds` costs both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import Catalog, Switch, default_catalog
from llmscale.plan.cluster import Cluster
from llmscale.plan.collectives import collective

KINDS = ("fat-tree", "rail-only", "single-switch")


@dataclass(frozen=True)
class Clos:
    tiers: int
    switches: int
    links: int  # including the endpoint (NIC) links
    switch_links: int  # links with a switch at both ends


def clos(endpoints: int, radix: int) -> Clos:
    """Smallest non-blocking folded Clos of radix-`radix` switches for `endpoints` ports."""
    if endpoints < 1:
        raise ConfigError("gpus", endpoints, "a positive integer")
    if radix < 2 or radix % 2:
        raise ConfigError("switch.ports", radix, "an even number >= 2")
    e, k, half = endpoints, radix, radix // 2
    if e <= k:
        return Clos(1, 1, e, 0)
    if e <= k * k // 2:
        leaves, spines = math.ceil(e / half), math.ceil(e / k)
        return Clos(2, leaves + spines, 2 * e, e)
    if e <= k**3 // 4:
        edge = math.ceil(e / half)
        return Clos(3, 2 * edge + math.ceil(e / k), 3 * e, 2 * e)
    raise ConfigError("gpus", endpoints, f"<= {k**3 // 4} NIC ports for radix-{k} 3-tier Clos")


@dataclass(frozen=True)
class NetworkDesign:
    """One topology for `gpus` GPUs: its switches, links, transceivers and price."""

    name: str
    kind: str
    switch: Switch
    gpus: int
    rails: int
    tiers: int
    switches: int
    links: int
    transceivers: int
    cost_usd: float


def design(
    kind: str, gpus: int, cluster: Cluster, switch: Switch, catalog: Catalog | None = None
) -> NetworkDesign:
    """Switch and link counts and cost of a `kind` network for `gpus` GPUs of `cluster`."""
    cat = catalog or default_catalog()
    if kind not in KINDS:
        raise ConfigError("topology", kind, " | ".join(KINDS))
    g = cluster.gpus_per_node
    if gpus % g:
        raise ConfigError("gpus", gpus, f"a multiple of {g} GPUs per node ({cluster.node.name})")
    nics = gpus // g * cluster.node.nics_per_node
    rails = cluster.node.nics_per_node
    k = switch.radix
    if kind == "rail-only":
        per = clos(nics // rails, k)
        c = Clos(per.tiers, rails * per.switches, rails * per.links, rails * per.switch_links)
    else:
        c = clos(nics, k)
        if kind == "single-switch" and c.tiers != 1:
            raise ConfigError("gpus", gpus, f"<= {k} NIC ports for one radix-{k} switch")
    switch_ends = 0 if switch.co_packaged_optics else 1
    endpoint_links = c.links - c.switch_links
    transceivers = endpoint_links * (1 + switch_ends) + c.switch_links * 2 * switch_ends
    optic = cat.optic(switch.link)
    cost = c.switches * switch.price_usd.value + transceivers * optic.price_usd.value
    cost += c.links * optic.cable_usd.value
    name = f"{kind} ({switch.name})"
    return NetworkDesign(
        name, kind, switch, gpus, rails, c.tiers, c.switches, c.links, transceivers, cost
    )


def all_to_all_seconds(nbytes: float, gpus: int, cluster: Cluster, kind: str) -> float:
    """All-to-all of `nbytes` per GPU over `gpus` GPUs (whole nodes) on a `kind` network."""
    g = cluster.gpus_per_node
    fabric = cluster.fabric
    base = collective("all_to_all", nbytes, gpus, min(g, gpus), fabric).seconds
    if kind != "rail-only" or gpus <= g:
        return base
    cross = nbytes * (gpus - g) / gpus  # bytes a GPU sends off its node
    forward = (g - 1) / g * cross / fabric.intra.bus_bandwidth + (g - 1) * fabric.intra.latency
    return base + forward


@dataclass(frozen=True)
class NetworkRow:
    """One topology, with a plan's step time on it and a sample all-to-all's time."""

    design: NetworkDesign
    step_seconds: float
    all_to_all_seconds: float


def max_gpus(gpu: str, catalog: Catalog | None = None) -> int:
    """The most GPUs of `gpu` every compared network can connect: a 3-tier non-blocking Clos
    of radix k holds k^3/4 NIC ports (`clos`), on the plain and the co-packaged switches."""
    cat = catalog or default_catalog()
    base = Cluster.of(gpu, catalog=cat)
    radix = min(cat.switch_for_link(base.fabric.inter.name).radix,
                cat.switch_for_link("cpo-800g").radix)  # fmt: skip
    return radix**3 // 4 // base.node.nics_per_node * base.gpus_per_node


def check_gpus(gpus: int, gpu: str, catalog: Catalog | None = None) -> None:
    """Refuse a count the networks cannot be sized for before anything is costed."""
    base = Cluster.of(gpu, catalog=catalog)
    limit = max_gpus(gpu, catalog)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 or gpus % base.gpus_per_node:
        raise ConfigError(
            "gpus", gpus, f"a positive multiple of {base.gpus_per_node} (whole nodes)"
        )
    if gpus > limit:
        raise ConfigError("gpus", gpus, f"<= {limit} (a 3-tier Clos of the {gpu} NICs' switches)")


def compare(
    gpus: int,
    gpu: str,
    plan_step: Callable[[Cluster], float],
    all_to_all_bytes: float = 256e6,
    catalog: Catalog | None = None,
) -> list[NetworkRow]:
    """Rail-optimized fat-tree, rail-only, a co-packaged-optics fat-tree, and one switch if it
    fits; `plan_step(cluster)` gives the step time of the plan being compared on each."""
    cat = catalog or default_catalog()
    base = Cluster.of(gpu, catalog=cat)
    cpo = Cluster.of(gpu, nic="cpo-800g", catalog=cat)
    sw = cat.switch_for_link(base.fabric.inter.name)
    options: list[tuple[str, Cluster, Switch]] = [
        ("fat-tree", base, sw),
        ("rail-only", base, sw),
        ("fat-tree", cpo, cat.switch_for_link("cpo-800g")),
    ]
    if gpus // base.gpus_per_node * base.node.nics_per_node <= sw.radix:
        options.append(("single-switch", base, sw))
    rows = []
    for kind, cluster, switch in options:
        d = design(kind, gpus, cluster, switch, cat)
        a2a = all_to_all_seconds(
            all_to_all_bytes, gpus, cluster, "rail-only" if kind == "rail-only" else kind
        )
        # Dense-model traffic is same-rail (module docstring): the plan runs as on a fat-tree.
        rows.append(NetworkRow(d, plan_step(cluster), a2a))
    return rows
