"""Fine-tuning comparison: one pretrained model continued with each way of running AdamW.

    llmscale bench --what finetune [--model small]
    python -m llmscale.bench.finetune [--model small] [--seq 128] [--pretrain-steps 40]
                                      [--steps 30] [--lsp-dim D] [--link-gbps 0 1 0.1]
                                      [--rounds 8] [--block 3]

The model is first pretrained briefly on the embedded corpus (`checkpoint.enabled`, one
checkpoint at the end). Each contender then starts from those weights (`checkpoint.init_from
RUN_DIR`: the weights only, a fresh optimizer) and trains the same steps on the same batches:
- `none`: torch AdamW on the device;
- `optimizer`: ZeRO-Offload, AdamW on the host with the layer-wise pipeline;
- every further mode of `config.OFFLOAD_MODES` that runs in one process (e.g. `lsp`, once the
  config accepts it), except `optimizer+params`, whose numerics are those of `optimizer`.

Reported per mode: the final loss (mean of the last 5 steps), the bytes moved between device
and host per step (`offload_bytes_moved`, measured, next to the planner's
`plan/offload_traffic.py`), the median step time of its run; one plot holds every loss curve.

Then the step time of the offloaded modes (`TIMED`: ZeRO-Offload and LSP-Offload, with `none`
as the reference) on the same job from the same weights, overlapped (the layer-wise pipeline),
at the native copy speed and at each simulated link (`--link-gbps`: `bench.offload`'s
`simulate_link`, on a CPU host only): one trainer per (mode, link), in rounds of one block of
consecutive steps each (`bench.offload.interleaved_blocks`); per round the block's fastest step,
then the median over rounds, and the process's CPU time per step (all threads; the median over
rounds of each block's mean). The machine's load average is printed with them.

The shape is a fine-tuning one, fixed before any timing: micro-batches of MICRO_BATCH sequences,
GLOBAL_BATCH // MICRO_BATCH micro-steps per step (the offload path accumulates on the host),
`--seq` tokens each: 1,024 tokens per optimizer step at the default 128. That is the regime of
fine-tuning a model that does not fit a commodity GPU: the micro-batch is what the memory left
by the weights allows (a few sequences), and the optimizer step is small, so per step the
device computes about 6 x tokens FLOPs per parameter while offload moves 8 bytes per parameter
(gradient down, weight up, fp32 here): few tokens per step is where the transfers and the host
update weigh most, the case offload methods are built for.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from llmscale.bench.memory import memory_options
from llmscale.bench.offload import interleaved_blocks, simulate_link
from llmscale.bench.report import Row, SuiteResult, half_iqr, print_suite
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
TIMED = ("none", "optimizer", "lsp")  # the step-time comparison's modes (none: the reference)
LINKS_GBPS = (0.0, 1.0, 0.1)  # simulated links of the step-time comparison (0: native copies)
ROUNDS, BLOCK, WARMUP = 8, 3, 2  # its rounds, consecutive steps per block, warm-up steps


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


def _contender(
    opts: BenchOptions, pre: JobConfig, mode: str, run: str, steps: int, lsp_dim: int | None
) -> JobConfig:
    """The fine-tuning job of offload `mode`, from the pretraining run's weights."""
    return _job(
        opts, run, steps,
        "--checkpoint.init_from", str(pre.job.run_dir), "--optimizer.offload", mode,
        *(("--optimizer.lsp_dim", str(lsp_dim)) if mode == "lsp" and lsp_dim else ()),
    )  # fmt: skip


def _time_modes(
    res: SuiteResult,
    opts: BenchOptions,
    pre: JobConfig,
    lsp_dim: int | None,
    links_gbps: tuple[float, ...],
    rounds: int,
    block: int,
) -> None:
    """The step time of `TIMED` at each link, overlapped, from interleaved blocks of steps."""
    modes = [m for m in TIMED if m in contenders()]
    trainers: dict[tuple[str, float], Trainer] = {}
    for mode in modes:
        for g in links_gbps if mode != "none" else (0.0,):
            cfg = _contender(
                opts, pre, mode, f"finetune-time-{mode}-{g:g}",
                WARMUP + rounds * max(2, block), lsp_dim,
            )  # fmt: skip
            t = trainers[(mode, g)] = Trainer(cfg)
            if g > 0 and t.device.type == "cpu":
                simulate_link(t, g)
    named = {f"{mode} @ {g:g}": t for (mode, g), t in trainers.items()}
    load0 = os.getloadavg()
    try:
        for t in trainers.values():
            for _ in range(WARMUP):  # (lsp: the first step fits the projectors)
                t.train_step()
        wall: dict[str, list[float]] = {k: [] for k in named}
        cpu: dict[str, list[float]] = {k: [] for k in named}
        for b in interleaved_blocks(named, rounds, block):
            wall[b.name].append(min(b.step_s))
            cpu[b.name].append(statistics.fmean(b.cpu_s))
    finally:
        for t in trainers.values():
            t.close()
    load1 = os.getloadavg()
    dev = next(iter(trainers.values())).device.type
    med = {k: statistics.median(v) for k, v in wall.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    table = []
    for g in links_gbps:
        link = "native" if g <= 0 or dev != "cpu" else f"{g:g} GB/s"
        cells = [link]
        for mode in modes:
            key = f"{mode} @ {g if mode != 'none' else 0.0:g}"
            cells.append(f"{1e3 * med[key]:.0f} ({1e3 * cpu_med[key]:.0f})")
            if mode == "none" and g != links_gbps[0]:
                continue  # (one row: no link)
            res.rows.append(
                Row(
                    "finetune-time", f"{mode} @ {link}", "step time (median)", "s", med[key],
                    spread=half_iqr(wall[key]),
                )
            )  # fmt: skip
            res.rows.append(
                Row("finetune-time", f"{mode} @ {link}", "CPU time per step", "s", cpu_med[key])
            )
        if {"optimizer", "lsp"} <= set(modes):
            ratio = med[f"lsp @ {g:g}"] / med[f"optimizer @ {g:g}"]
            cells.append(f"{ratio:.2f}")
        table.append(cells)
    res.tables[
        f"step time, overlapped: ms wall (ms CPU, all threads), median of {rounds} interleaved "
        f"rounds, {GLOBAL_BATCH * opts.seq_len:,} tokens per step"
    ] = (
        ["link", *modes, *(["lsp / optimizer"] if {"optimizer", "lsp"} <= set(modes) else [])],
        table,
    )
    res.notes.append(
        f"Step times: {torch.get_num_threads()} torch threads on {dev}; load average "
        f"{load0[0]:.2f} before the timed steps, {load1[0]:.2f} after (1 min). A link is "
        "simulated on a CPU host only (each copy sleeps as long as over the link)."
    )


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
    links_gbps: tuple[float, ...] = LINKS_GBPS,
    rounds: int = ROUNDS,
    block: int = BLOCK,
) -> SuiteResult:
    """`lsp_dim`: the lsp contender's `optimizer.lsp_dim` (None: the config's). `links_gbps`,
    `rounds`, `block`: the step-time comparison's (no links: none)."""
    res = SuiteResult(
        "finetune",
        f"Fine-tuning from a pretrained {opts.model} ({pretrain_steps} steps): {steps} steps per "
        f"optimizer mode, batch {MICRO_BATCH} x {GLOBAL_BATCH // MICRO_BATCH} micro-steps x "
        f"{opts.seq_len} tokens = {GLOBAL_BATCH * opts.seq_len:,} tokens per step",
    )
    pre = _job(
        opts, "finetune-pretrain", pretrain_steps,
        "--checkpoint.enabled", "true", "--checkpoint.interval", "0",
    )  # fmt: skip
    pre_rows = _train(pre)
    curves: dict[str, list[float]] = {}
    table = []
    for mode in contenders():
        cfg = _contender(opts, pre, mode, f"finetune-{mode}", steps, lsp_dim)
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
    if links_gbps:
        _time_modes(res, opts, pre, lsp_dim, links_gbps, rounds, block)
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
    ap.add_argument(
        "--link-gbps",
        type=float,
        nargs="*",
        default=list(LINKS_GBPS),
        help="links of the step-time comparison, GB/s; 0 = native copies; none: no timing "
        "(default: 0 1 0.1)",
    )
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of the step-time blocks")
    ap.add_argument("--block", type=int, default=BLOCK, help="consecutive steps per block (>= 2)")
    args = ap.parse_args(argv)
    opts = BenchOptions(model=args.model, seq_len=args.seq, png_dir=args.png)
    res = run(
        opts, args.pretrain_steps, args.steps, args.lsp_dim, tuple(args.link_gbps),
        args.rounds, args.block,
    )  # fmt: skip
    print_suite(res)  # its figures' paths too


if __name__ == "__main__":
    main()
