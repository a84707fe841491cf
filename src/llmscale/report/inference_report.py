"""What `llmscale infer` prints: the serving layout, each phase's time and regime, throughput."""

from __future__ import annotations

from typing import NamedTuple

from rich.table import Table

from llmscale.plan.inference import ServingPrediction
from llmscale.report.report import gib as _gib


class InferenceReport(NamedTuple):
    title: str
    table: Table
    lines: list[str]


def gib(nbytes: float) -> str:
    return f"{_gib(nbytes)} GiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def inference_report(pred: ServingPrediction) -> InferenceReport:
    """The prediction as a title, a table of the two phases and the lines that read it."""
    p = pred
    title = (
        f"{p.model} on {p.gpus} x {p.gpu} ({p.precision}), input {p.input_len} + output "
        f"{p.output_len} tokens: tp {p.tp} x {p.replicas} replica(s), batch {p.batch} "
        f"(at most {p.max_batch} fit)"
    )
    t = Table(title="Per GPU, per phase (one prefill of the batch; one decode step)")
    for col in ("phase", "time", "compute", "HBM", "all-reduce", "FLOP/B", "ridge", "regime"):
        t.add_column(col, justify="left" if col in ("phase", "regime") else "right")
    for name, ph in (("prefill", p.prefill), ("decode step", p.decode)):
        t.add_row(
            name, _ms(ph.seconds), _ms(ph.compute_s), _ms(ph.memory_s), _ms(ph.comm_s),
            f"{ph.intensity:,.1f}", f"{ph.ridge:,.1f}", ph.bound,
        )  # fmt: skip
    lines = [
        f"memory per GPU: weights {gib(p.weight_bytes_per_gpu)}, left for the KV cache "
        f"{gib(p.kv_budget_bytes_per_gpu)} after a {p.reserve:.0%} reserve; KV cache per "
        f"sequence {gib(p.kv_cache_bytes_per_sequence)} ({gib(p.kv_cache_bytes_per_sequence_per_gpu)}"
        f" per GPU) -> batch <= {p.max_batch}",
        f"one batch: {p.batch_seconds:,.2f} s (prefill {p.prefill_s:,.2f} s + "
        f"{p.output_len - 1} x {_ms(p.decode_s_per_token)})",
        f"throughput: {p.tokens_per_s:,.0f} generated tokens/s "
        f"({p.tokens_per_s / p.gpus:,.0f} per GPU)",
    ]
    return InferenceReport(title, t, lines)
