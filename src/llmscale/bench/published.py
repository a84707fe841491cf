"""Predicted / published training throughput for Narayanan et al. 2021, Table 1.

    .venv/bin/python bench/published.py
    python -m llmscale.bench.published

The rows, each with its source: src/llmscale/plan/data/published.toml.

Efficiencies are the planner's defaults (plan/time.py TimeParams), one set for every row; see
src/llmscale/plan/published.py for the runtime facts that differ (Megatron-LM 2021's kernels).
"""

from __future__ import annotations

import argparse

from rich.table import Table

from llmscale.plan.published import MEGATRON_2021_RUNTIME, narayanan_2021
from llmscale.ui import console


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    rows = narayanan_2021()
    t = Table(title="Narayanan et al. 2021, Table 1 (A100 80GB, Selene): TFLOP/s per GPU")
    for col in ("model", "tp", "pp", "dp", "GPUs", "batch", "published", "predicted", "ratio"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        p = r.plan
        t.add_row(
            r.name, str(p.tp), str(p.pp), str(p.dp), str(p.world_size), str(p.global_batch_size),
            f"{r.published_tflops:.0f}", f"{r.predicted_tflops:.1f}", f"{r.ratio:.3f}",
        )  # fmt: skip
    c = console()
    c.print(t)
    ratios = [r.ratio for r in rows]
    c.print(
        f"ratio range {min(ratios):.3f} .. {max(ratios):.3f}; "
        f"matmul_efficiency={MEGATRON_2021_RUNTIME.matmul_efficiency}, "
        f"fwd/bwd passes={MEGATRON_2021_RUNTIME.fwd_passes}/{MEGATRON_2021_RUNTIME.bwd_passes}"
    )


if __name__ == "__main__":
    main()
