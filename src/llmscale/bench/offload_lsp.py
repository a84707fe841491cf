"""LSP-Offload's fits and its price in loss, on the tiny model: a record for docs/offload.md.

    python -m llmscale.bench.offload_lsp [--steps 6] [--check-every 3]
                                         [--json-out docs/results/offload-lsp.json]

Two trainers on the same batches, `optimizer.offload = "lsp"` (its checks every `--check-every`
steps) and `"optimizer"` (ZeRO-Offload, the whole gradient), each `--steps` steps. Recorded:
- every fit of the lsp run: the step, the matrix's shape and d, its relative reconstruction
  error before the fit (the random sketch at the first step, the old projectors at a refit) and
  after (the best values the fit kept), read from `Projectors.fit`'s own trace;
- each step's loss of both runs and the lsp run's `lsp_reconstruction_error`;
- one fit on a rank-3 test gradient (96 x 64, d = 16, s = 8, as tests/offload/test_lsp.py).
Runs in seconds on a CPU host; nothing here is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from llmscale.bench.jobs import short_job
from llmscale.bench.records import suite_record, write_record
from llmscale.config import load_config
from llmscale.offload.lsp import Projectors
from llmscale.train.trainer import Trainer

SUITE = "offload_lsp"
RANK3 = {"m": 96, "n": 64, "d": 16, "s": 8, "rank": 3, "seed": 3}


@contextmanager
def recorded_fits(fits: list[dict[str, Any]], step: list[int]) -> Iterator[None]:
    """Record every `Projectors.fit` while inside: shape, d, the error before and after.

    The one place this recorder reaches into the optimizer: it wraps the class's `fit`, whose
    trace is err(g) before each Adam step and after the last (the fit keeps the best values).
    """
    fit = Projectors.fit

    def wrapped(self: Projectors, g: torch.Tensor, *a: Any, **k: Any) -> list[torch.Tensor]:
        trace = fit(self, g, *a, **k)
        errs = [float(e) for e in trace]
        fits.append({
            "step": step[0], "shape": list(g.shape), "d": self.d,
            "before": errs[0], "after": min(errs),
        })  # fmt: skip
        return trace

    Projectors.fit = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        Projectors.fit = fit  # type: ignore[method-assign]


def _trainer(offload: str, args: argparse.Namespace) -> Trainer:
    overrides = short_job(
        model__name=args.model,
        job__run_dir=tempfile.mkdtemp(prefix=f"bench-lsp-{offload}-"),
        train__steps=args.steps,
        optimizer__offload=offload,
        optimizer__lsp_check_every=args.check_every,
        metrics__activation_memory=False,
    )
    return Trainer(load_config(None, overrides))


def rank3_fit() -> dict[str, Any]:
    """One fit on a rank-3 gradient plus a little noise (tests/offload/test_lsp.py's case)."""
    c = RANK3
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(c["m"], c["rank"], generator=gen) @ torch.randn(
        c["rank"], c["n"], generator=gen
    )
    g = g + 0.05 * torch.randn(c["m"], c["n"], generator=gen)
    pr = Projectors.new(c["m"], c["n"], c["d"], c["s"], seed=c["seed"], device=torch.device("cpu"))
    errs = [float(e) for e in pr.fit(g)]
    return {**c, "before": errs[0], "after": min(errs)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    fits: list[dict[str, Any]] = []
    losses: dict[str, list[float]] = {}
    errors: list[float] = []
    lsp_cfg: dict[str, Any] = {}
    for offload in ("lsp", "optimizer"):
        t = _trainer(offload, args)
        step = [0]
        losses[offload] = []
        with recorded_fits(fits if offload == "lsp" else [], step):
            for i in range(args.steps):
                step[0] = i + 1
                row = t.train_step()
                losses[offload].append(float(row["loss"]))
                if offload == "lsp":
                    errors.append(float(row.get("lsp_reconstruction_error", float("nan"))))
        if offload == "lsp":
            o = t.cfg.optimizer
            lsp_cfg = {"lsp_dim": o.lsp_dim, "lsp_nonzeros": o.lsp_nonzeros,
                       "lsp_refit_threshold": o.lsp_refit_threshold,
                       "lsp_check_every": o.lsp_check_every,
                       "n_blocks": t.cfg.model.n_layers}  # fmt: skip
        if hasattr(t.optimizer, "close"):
            t.optimizer.close()
    return {"settings": lsp_cfg, "fits": fits, "loss": losses, "lsp_error": errors,
            "rank3": rank3_fit()}  # fmt: skip


def record(args: argparse.Namespace, figures: dict[str, Any], argv: list[str],
           load: tuple[float, float]) -> dict[str, Any]:  # fmt: skip
    return suite_record(
        SUITE,
        "LSP-Offload's fits and loss against ZeRO-Offload",
        "llmscale.bench.offload_lsp",
        argv,
        load,
        model=args.model,
        steps=args.steps,
        **figures,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--check-every", type=int, default=3, help="optimizer.lsp_check_every")
    ap.add_argument("--json-out", type=Path, help="the record (docs/results/offload-lsp.json)")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    figures = measure(args)
    for f in figures["fits"]:
        print(f"  step {f['step']} fit {f['shape'][0]} x {f['shape'][1]} (d = {f['d']}): "
              f"error {f['before']:.2f} -> {f['after']:.2f}")  # fmt: skip
    for mode, xs in figures["loss"].items():
        print(f"  loss {mode:9s} " + " ".join(f"{x:.3f}" for x in xs))
    r = figures["rank3"]
    print(f"  rank-3 gradient: error {r['before']:.2f} -> {r['after']:.2f}")
    if args.json_out is not None:
        rec = record(args, figures, sys.argv[1:] if argv is None else argv,
                     (load, os.getloadavg()[0]))  # fmt: skip
        write_record(args.json_out, rec)


if __name__ == "__main__":
    main()
