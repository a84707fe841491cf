"""What `llmscale roofline` prints: training and decoding against the GPU's ridge point."""

from __future__ import annotations

from typing import NamedTuple

from rich.table import Table

from llmscale.config import Precision
from llmscale.hardware.catalog import GPU
from llmscale.model.config import ModelConfig
from llmscale.plan import roofline
from llmscale.report import report


class RooflineReport(NamedTuple):
    """A title, the two workloads' table, and the sentence that reads it."""

    rows: list[roofline.Roofline]
    title: str
    table: Table
    conclusion: str


def roofline_report(
    model: ModelConfig, gpu: GPU, batch: int, seq: int, precision: Precision = "bf16"
) -> RooflineReport:
    """A training step of batch x seq tokens, and decoding one token of `batch` sequences with
    `seq` tokens of KV cache; where decoding turns compute-bound."""
    rows = [
        roofline.training(model, gpu, batch, seq, precision),
        roofline.decode(model, gpu, batch, seq, precision),
    ]
    b = roofline.decode_batch_at_ridge(model, gpu, seq, precision)
    if b == float("inf"):
        where = f"stays memory-bound at any batch with {seq} tokens of context (KV cache)"
    else:
        where = f"turns compute-bound above batch {b:,.0f} with {seq} tokens of context"
    return RooflineReport(
        rows,
        f"{model.name} on {gpu.display}",
        report.roofline_table(rows),
        f"training: {rows[0].bound}; decode {where}",
    )
