"""The hardware a plan runs on: a GPU, its node shape and the links between GPUs and to hosts."""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GPU, Catalog, Link, Node, default_catalog
from llmscale.hardware.spec import Sourced
from llmscale.plan.cache import Memo
from llmscale.plan.collectives import Fabric
from llmscale.stack import Stack

_RUN_BY: Memo[Cluster] = Memo("cluster.run_by")


@dataclass(frozen=True)
class Cluster:
    """`gpu` in nodes of `node`'s shape; NICs of `fabric.inter`; offload over `host_link`."""

    gpu: GPU
    node: Node
    fabric: Fabric
    host_link: Link

    @property
    def gpus_per_node(self) -> int:
        return self.node.gpus_per_node

    def run_by(self, stack: Stack) -> Cluster:
        """This cluster with the GPU's rates scaled by the factors `stack` was fitted to on it
        (`Stack.fitted`): the one place the planner applies them (itself when the
        stack has none for this GPU). Cached per (cluster, stack), so the search's keys by
        identity keep hitting."""
        fits = [f for f in stack.fitted if f.gpu == self.gpu.name]
        if not fits:
            return self

        def build() -> Cluster:
            cal = self.gpu.calibration
            for fit in fits:
                scaled = {
                    name: Sourced(round(num.value * fit.scale.value, 6), fit.scale.source)
                    for name in fit.fields
                    if (num := getattr(cal, name)) is not None
                }
                cal = replace(cal, **scaled)
            return replace(self, gpu=replace(self.gpu, calibration=cal))

        return _RUN_BY.get((id(self), id(stack)), build, (self, stack))

    @classmethod
    def of(
        cls,
        gpu: str,
        node: str | None = None,
        nic: str | None = None,
        catalog: Catalog | None = None,
    ) -> Cluster:
        """The catalog's node shape for `gpu` (or `node`), optionally with another NIC link."""
        cat = catalog or default_catalog()
        g = cat.gpu(gpu)
        n = cat.node(node) if node else cat.node_for_gpu(gpu)
        if n.gpu != gpu:  # a node shape holds one GPU model: another's would be costed silently
            shapes = [m.name for m in cat.nodes.values() if m.gpu == gpu]
            raise ConfigError("node", node, f"a node shape of {gpu}: " + " | ".join(shapes))
        fabric = Fabric.of(n, cat.link(n.scale_up), cat.link(nic or n.nic))
        return cls(g, n, fabric, cat.link(g.host_link))
