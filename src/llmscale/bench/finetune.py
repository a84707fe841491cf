"""Fine-tuning comparison: one pretrained model continued with each way of running AdamW.

    llmscale bench --what finetune [--model small]
    python -m llmscale.bench.finetune [--model small] [--pretrain-steps 40] [--steps 30]
                                      [--lsp-dim D]

The model is first pretrained briefly on the embedded corpus (`checkpoint.enabled`, one
checkpoint at the end). Each contender then starts from those weights (`checkpoint.init_from
RUN_DIR`: the weights only, a fresh optimizer) and trains the same steps on the same batches:
- `none`: torch AdamW on the device;
- `optimizer`: ZeRO-Offload, AdamW on the host with the layer-wise pipeline;
- every further mode of `config.OFFLOAD_MODES` that runs in one process (e.g. `lsp`, once the
  config accepts it), except `optimizer+params`, whose numerics are those of `optimizer`.

Reported per mode: the final loss (mean of the last 5 steps), the bytes moved between device
and host per step (`offload_bytes_moved`, measured, next to the planner's
`plan/offload_traffic.py`), the median step time; one plot holds every loss curve.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from llmscale.bench.memory import memory_options
from llmscale.bench.report import Row, SuiteResult, print_suite
from llmscale.bench.runner import BenchOptions, png_path
from llmscale.config import OFFLOAD_MODES, JobConfig
from llmscale.plan.predict import expected_runtime_metrics
from llmscale.train.metrics import read_jsonl
from llmscale.train.trainer import Trainer

PRETRAIN_STEPS = 40
FINETUNE_STEPS = 30
MICRO_BATCH, GLOBAL_BATCH = 4, 8  # two micro-steps: the offload path accumulates on the host
LR = "3e-4"
TAIL = 5  # the final loss: mean of the last TAIL steps


def contenders() -> list[str]:
    """Offload modes to compare: on-device AdamW, ZeRO-Offload, and any newer mode."""
    return [m for m in OFFLOAD_MODES if m != "optimizer+params"]


def _job(opts: BenchOptions, run: str, steps: int, *extra: str) -> JobConfig:
    cfg = opts.job(
        "--train.steps", str(steps),
        "--train.micro_batch_size", str(MICRO_BATCH),
        "--train.global_batch_size", str(GLOBAL_BATCH),
        "--optimizer.lr", LR,
        *extra,
        run=run,
    )  # fmt: skip
    return cfg


def _train(cfg: JobConfig) -> list[dict[str, Any]]:
    with Trainer(cfg) as t:
        t.fit()
    rows = read_jsonl(Path(cfg.job.run_dir) / "metrics.jsonl")
    return [r for r in rows if r.get("kind") == "train"]


def run(
    opts: BenchOptions,
    pretrain_steps: int = PRETRAIN_STEPS,
    steps: int = FINETUNE_STEPS,
    lsp_dim: int | None = None,
) -> SuiteResult:
    """`lsp_dim`: the lsp contender's `optimizer.lsp_dim` (None: the config's)."""
    res = SuiteResult(
        "finetune",
        f"Fine-tuning from a pretrained {opts.model} ({pretrain_steps} steps): {steps} steps per "
        f"optimizer mode, batch {MICRO_BATCH} x {GLOBAL_BATCH // MICRO_BATCH} x {opts.seq_len}",
    )
    pre = _job(
        opts, "finetune-pretrain", pretrain_steps,
        "--checkpoint.enabled", "true", "--checkpoint.interval", "0",
    )  # fmt: skip
    pre_rows = _train(pre)
    curves: dict[str, list[float]] = {}
    table = []
    for mode in contenders():
        cfg = _job(
            opts, f"finetune-{mode}", steps,
            "--checkpoint.init_from", str(pre.job.run_dir), "--optimizer.offload", mode,
            *(("--optimizer.lsp_dim", str(lsp_dim)) if mode == "lsp" and lsp_dim else ()),
        )  # fmt: skip
        rows = _train(cfg)
        losses = [float(r["loss"]) for r in rows]
        curves[mode] = losses
        final = statistics.fmean(losses[-TAIL:])
        moved = [int(r["offload_bytes_moved"]) for r in rows]
        want = expected_runtime_metrics(cfg, options=memory_options(opts)).get(
            "offload_bytes_moved"
        )
        step_s = statistics.median(float(r["step_time_s"]) for r in rows[1:] or rows)
        res.rows.append(Row("finetune", mode, f"final loss (last {TAIL})", "", final))
        res.rows.append(Row("finetune", mode, "bytes moved per step", "B", moved[-1], want))
        res.rows.append(Row("finetune", mode, "step time (median)", "s", step_s))
        table.append(
            [mode, f"{losses[0]:.4f}", f"{final:.4f}", f"{moved[-1]:,}", f"{1e3 * step_s:.0f}"]
        )
    base = statistics.fmean(curves["optimizer"][-TAIL:]) if "optimizer" in curves else None
    for row in table:
        final = float(row[2])
        row.append(f"{final / base - 1:+.2%}" if base else "-")
    res.tables["fine-tuning: every mode from the same pretrained weights"] = (
        ["offload", "first loss", "final loss", "bytes moved / step", "step ms", "vs optimizer"],
        table,
    )
    res.notes.append(
        f"Pretraining: {pretrain_steps} steps, final loss {float(pre_rows[-1]['loss']):.4f}; "
        "each fine-tune starts from its checkpoint (checkpoint.init_from) with a fresh optimizer."
    )
    out = png_path(opts, "finetune-loss.png")
    if out is not None:
        res.figures.append(plot_curves(curves, out, [float(r["loss"]) for r in pre_rows]))
    return res


def plot_curves(curves: dict[str, list[float]], out: Path, pretrain: list[float]) -> Path:
    """Every mode's loss against its fine-tuning step, after the pretraining curve; one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    n = len(pretrain)
    ax.plot(range(1, n + 1), pretrain, color="0.6", label="pretraining")
    styles = ["-", "--", ":", "-."]
    for i, (mode, losses) in enumerate(curves.items()):
        ax.plot(
            range(n + 1, n + 1 + len(losses)),
            losses,
            styles[i % len(styles)],
            label=f"fine-tune, offload = {mode}",
        )
    ax.axvline(n + 0.5, color="0.8", lw=1)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="Fine-tuning from the same weights")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS)
    ap.add_argument("--steps", type=int, default=FINETUNE_STEPS)
    ap.add_argument("--png", type=Path, help="folder for finetune-loss.png")
    ap.add_argument("--lsp-dim", type=int, help="optimizer.lsp_dim of the lsp run (default 512)")
    args = ap.parse_args(argv)
    opts = BenchOptions(model=args.model, seq_len=args.seq, png_dir=args.png)
    res = run(opts, args.pretrain_steps, args.steps, args.lsp_dim)
    print_suite(res)  # its figures' paths too


if __name__ == "__main__":
    main()
