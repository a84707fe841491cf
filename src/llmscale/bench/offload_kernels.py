"""The host kernels of CPU offload, timed: a record for docs/offload.md.

    python -m llmscale.bench.offload_kernels [--model small] [--repeats 5]
                                             [--json-out docs/results/offload-kernels.json]

- **Host AdamW**: one step of torch's AdamW over fp32 tensors shaped like `--model`'s
  parameters, with each kernel the offloaded optimizer can run: `fused`
  (`torch._fused_adamw_`, `offload_kernel = "fused"`), `exact` (torch's per-tensor loop,
  `offload_kernel = "exact"`, bit for bit the on-device foreach AdamW) and `foreach` (torch's
  multi-tensor kernel, which the host does not use); and how far `fused` drifts from `exact`
  over 5 steps from the same state on the same random gradients (the weights' difference as a
  share of what the steps changed).
- **LSP compression**: C = P G Qᵀ of an m x n gradient with count-sketch projectors of d rows and
  s non-zeros per column, through the sparse kernels the optimizer runs
  (`Projectors.compress`: `embedding_bag` sums) and as two dense products (d x m, m x n, n x d),
  for a matrix of the small model (256 x 768, d = 128) and one of the LSP-Offload paper's
  proportions (4096 x 4096, d = 512).

Each figure is the fastest of `--repeats` runs after one warm-up (the machine is shared: the
fastest is the least disturbed); the record holds the torch threads and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.optim.adamw import adamw as functional_adamw

from llmscale.bench.records import suite_record, write_record
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.offload.lsp import Projectors, dense

SUITE = "offload_kernels"
ADAMW_KERNELS = ("fused", "exact", "foreach")
# (m, n, d) of the compressions timed; s is the config's default lsp_nonzeros
COMPRESSIONS = ((256, 768, 128), (4096, 4096, 512))
NONZEROS = 16


def fastest(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def adamw_seconds(model: str, repeats: int) -> tuple[int, dict[str, float]]:
    """The model's parameter count and one host AdamW step's seconds per kernel."""
    shapes = [p.shape for p in build_model(get_preset(model)).parameters()]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    m = [torch.zeros(s) for s in shapes]
    v = [torch.zeros(s) for s in shapes]
    steps = [torch.zeros(()) for _ in shapes]
    out = {}
    for kernel in ADAMW_KERNELS:

        def step(k: str = kernel) -> None:
            _adamw(k, params, grads, m, v, steps)

        out[kernel] = fastest(step, repeats)
    return sum(p.numel() for p in params), out


def _adamw(kernel: str, *state: list[torch.Tensor]) -> None:
    """One AdamW step in place of (params, grads, exp_avg, exp_avg_sq, steps) with `kernel`."""
    params, grads, m, v, steps = state
    functional_adamw(
        params, grads, m, v, [], steps, foreach=kernel == "foreach", fused=kernel == "fused",
        amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8,
        maximize=False,
    )  # fmt: skip


def fused_rounding(model: str, steps: int = 5) -> list[float]:
    """How far `fused` drifts from `exact`: after each of `steps` steps from the same state on
    the same random gradients, ||w_fused - w_exact|| / ||w_exact - w_0|| over the model's
    parameters (the difference as a share of what the steps changed)."""
    shapes = [p.shape for p in build_model(get_preset(model)).parameters()]
    gen = torch.Generator().manual_seed(0)
    w0 = [torch.randn(s, generator=gen) for s in shapes]
    runs = {
        k: ([w.clone() for w in w0], [torch.zeros(s) for s in shapes],
            [torch.zeros(s) for s in shapes], [torch.zeros(()) for _ in shapes])
        for k in ("fused", "exact")
    }  # fmt: skip
    out = []
    for _ in range(steps):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for k, (w, m, v, st) in runs.items():
            _adamw(k, w, [g.clone() for g in grads], m, v, st)
        f, e = runs["fused"][0], runs["exact"][0]
        diff = sum(float((a - b).pow(2).sum()) for a, b in zip(f, e, strict=True)) ** 0.5
        moved = sum(float((b - a).pow(2).sum()) for a, b in zip(w0, e, strict=True)) ** 0.5
        out.append(diff / moved)
    return out


def compression_seconds(m: int, n: int, d: int, s: int, repeats: int) -> dict[str, Any]:
    """One compression P G Qᵀ of an m x n gradient: the sparse kernels and the dense products."""
    pr = Projectors.new(m, n, d, s, seed=0, device=torch.device("cpu"))
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(1))
    pd, qd = dense(*pr.p, d), dense(*pr.q, d)
    sparse = fastest(lambda: pr.compress(g), repeats)
    dense_s = fastest(lambda: pd @ g @ qd.t(), repeats)
    return {"m": m, "n": n, "d": d, "s": s, "sparse_s": sparse, "dense_s": dense_s}


def record(args: argparse.Namespace, figures: dict[str, Any], argv: list[str],
           load: tuple[float, float]) -> dict[str, Any]:  # fmt: skip
    return suite_record(
        SUITE,
        "The host kernels of CPU offload: AdamW and LSP's compression",
        "llmscale.bench.offload_kernels",
        argv,
        load,
        repeats=args.repeats,
        **figures,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-out", type=Path, help="the record (docs/results/offload-kernels.json)")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    n, adamw = adamw_seconds(args.model, args.repeats)
    comp = [compression_seconds(m, k, d, NONZEROS, args.repeats) for m, k, d in COMPRESSIONS]
    print(f"host AdamW, {args.model} ({n:,} parameters), {torch.get_num_threads()} threads:")
    for kernel, sec in adamw.items():
        print(f"  {kernel:8s} {1e3 * sec:8.2f} ms")
    for c in comp:
        print(f"compression {c['m']} x {c['n']}, d = {c['d']}, s = {c['s']}: sparse "
              f"{1e3 * c['sparse_s']:.2f} ms, dense {1e3 * c['dense_s']:.2f} ms")  # fmt: skip
    drift = fused_rounding(args.model)
    print("fused vs exact, relative difference after each step: "
          + ", ".join(f"{x:.1e}" for x in drift))  # fmt: skip
    figures = {"model": args.model, "n_params": n, "adamw_s": adamw,
               "fused_vs_exact": drift, "compression": comp}  # fmt: skip
    if args.json_out is not None:
        rec = record(args, figures, sys.argv[1:] if argv is None else argv,
                     (load, os.getloadavg()[0]))  # fmt: skip
        write_record(args.json_out, rec)


if __name__ == "__main__":
    main()
