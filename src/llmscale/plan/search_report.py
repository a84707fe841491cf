"""What `llmscale plan` prints: the question, the search's counts, the table and how to read it."""

from __future__ import annotations

from typing import Any, NamedTuple

from llmscale.config import Precision
from llmscale.model.config import get_preset
from llmscale.plan import report
from llmscale.plan.cluster import Cluster
from llmscale.plan.search import SearchResult, search

NO_PLAN = "no plan fits: try more GPUs, a smaller global batch or a shorter sequence"
MEMORY_LEGEND = (
    "memory columns are the fullest GPU, GiB: states = params + grads + optimizer; "
    "working = bf16 weight copies or FSDP-unsharded params; transient includes the "
    "allocator's 5%"
)


class PlanReport(NamedTuple):
    """A search and the inputs that asked for it (as `--json` prints them)."""

    result: SearchResult
    inputs: dict[str, Any]

    def json(self) -> dict[str, Any]:
        return report.search_json(self.result, self.inputs)

    def headline(self) -> str:
        i, res = self.inputs, self.result
        return (
            f"{i['model']} on {i['gpus']} x {res.cluster.gpu.display} ({i['node']}, {i['nic']}); "
            f"seq {i['seq']}, global batch {i['global_batch']}, {i['precision']}: "
            f"{res.evaluated:,} plans costed, {res.feasible:,} fit, "
            f"searched in {res.seconds:.2f} s"
        )

    def best_command(self) -> str:
        """The `llmscale train` overrides of the fastest plan (there must be one)."""
        return "best: llmscale train " + " ".join(self.result.candidates[0].plan.overrides())


def plan_report(
    model: str,
    gpus: int,
    gpu: str,
    seq: int = 4096,
    global_batch: int = 1024,
    precision: Precision = "bf16",
    top: int = 10,
    node: str | None = None,
    nic: str | None = None,
) -> PlanReport:
    """Search the layouts of preset `model` on `gpus` x `gpu`; keep the `top` fastest that fit."""
    cfg = get_preset(model)
    cluster = Cluster.of(gpu, node=node, nic=nic)
    res = search(cfg, gpus, cluster, seq, global_batch, precision, top)
    inputs = {
        "model": model, "gpu": gpu, "gpus": gpus, "seq": seq, "global_batch": global_batch,
        "precision": precision, "node": cluster.node.name, "nic": cluster.fabric.inter.name,
    }  # fmt: skip
    return PlanReport(res, inputs)
