"""Precision: throughput and memory of fp32 / bf16 / fp16, and how many fp16 gradients vanish.

The underflow report trains the model in fp32 for a while (gradients shrink as the loss falls),
then measures, on one batch, the fraction of gradient elements that are non-zero in fp32 but
zero in fp16, without a loss scale and with scales 2^3 .. 2^15, two ways: casting the finished
fp32 gradients (`underflow_report`), and running the whole backward in fp16 autocast with the
scaled loss (`fp16_backward_underflow`), where activation gradients can vanish on the way too.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from llmscale.bench.memory import memory_options
from llmscale.bench.report import Row, SuiteResult
from llmscale.bench.runner import BenchOptions, measure, png_path
from llmscale.bench.timing import calibrated
from llmscale.plan.predict import expected_runtime_metrics, predict_step_time
from llmscale.train.precision import UnderflowRow, fp16_backward_underflow, underflow_report
from llmscale.train.trainer import Trainer, lm_loss

MODES = ("fp32", "bf16", "fp16")
MICRO_BATCH = 8
SCALES = (1.0, *(2.0**k for k in range(3, 16)))
TRAIN_STEPS = 30
UNDERFLOW_BATCH = 2


def run(opts: BenchOptions) -> SuiteResult:
    res = SuiteResult(
        "precision", f"Precision, model {opts.model}, mbs {MICRO_BATCH} x seq {opts.seq_len}"
    )
    for mode in MODES:
        cluster, params, _ = calibrated(opts, MICRO_BATCH, mode)
        cfg = opts.job(
            "--precision.mode", mode, "--train.micro_batch_size", str(MICRO_BATCH),
            "--train.global_batch_size", str(MICRO_BATCH), run=f"prec-{mode}",
        )  # fmt: skip
        m = measure(cfg, opts.warmup)
        want = expected_runtime_metrics(cfg, options=memory_options(opts))
        pred = predict_step_time(cfg, cluster, params)
        fastest = cfg.train.global_batch_size * cfg.data.seq_len / m.min_step_time_s
        res.rows.append(Row("precision", mode, "tokens/s", "tok/s", fastest, pred.tokens_per_s))
        res.rows.append(
            Row(
                "precision",
                mode,
                "activations",
                "B",
                m["activation_bytes"],
                want["activation_bytes"],
            )
        )
        states = sum(m[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        res.rows.append(
            Row(
                "precision",
                mode,
                "states",
                "B",
                states,
                sum(want[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")),
            )
        )
    # The share is a property of the run, not only of the model: it moved from 0.2% to 3% over
    # seeds here. So `opts.seeds` runs, each its own init and data order; median and range.
    runs = [underflow_after_training(opts, seed) for seed in range(opts.seeds)]
    cast = [[c[i].underflow_fraction for c, _, _ in runs] for i in range(len(SCALES))]
    e2e = [[e[i].underflow_fraction for _, e, _ in runs] for i in range(len(SCALES))]
    over = [max(e[i].overflow_fraction for _, e, _ in runs) for i in range(len(SCALES))]
    losses = [loss for _, _, loss in runs]
    header = [
        "loss scale",
        "cast: underflow",
        "cast: range",
        "fp16 backward: underflow",
        "fp16 backward: range",
        "fp16 backward: overflow (max)",
    ]
    table = [
        [f"2^{int(s).bit_length() - 1}", _pct(statistics.median(c)), _span(c),
         _pct(statistics.median(e)), _span(e), f"{100 * o:.3f}%"]
        for s, c, e, o in zip(SCALES, cast, e2e, over, strict=True)
    ]  # fmt: skip
    seeds = f"seed{'s' if opts.seeds > 1 else ''} 0..{opts.seeds - 1}"
    res.tables[
        f"fp16 gradient underflow after {TRAIN_STEPS} fp32 steps ({seeds}, losses "
        f"{', '.join(f'{x:.3f}' for x in losses)}), share of non-zero fp32 gradient elements: "
        "median over the runs, and their range"
    ] = (header, table)
    res.notes.append(
        f"Without scaling, {100 * statistics.median(cast[0]):.1f}% of the non-zero gradient values "
        f"vanish when cast to fp16 (runs: {_span(cast[0])}) and "
        f"{100 * statistics.median(e2e[0]):.1f}% when the backward itself runs in fp16 "
        f'({_span(e2e[0])}); arXiv:2209.04881 (cited by the article "Distributed Solutions: '
        'Practical Approaches to Scale LLM Compute, Part 2") reports ~31%. At 2^15: '
        f"{100 * max(cast[-1]):.2f}% / {100 * max(e2e[-1]):.2f}% at most."
    )
    path = png_path(opts, "fp16_underflow.png")
    if path is not None:
        _plot(
            cast, e2e, over, path,
            f"fp16 underflow vs loss scale, {opts.model} after {TRAIN_STEPS} steps ({seeds})",
        )  # fmt: skip
        res.figures.append(path)
    return res


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _span(xs: list[float]) -> str:
    return f"{100 * min(xs):.2f}-{100 * max(xs):.2f}%"


def underflow_after_training(
    opts: BenchOptions, seed: int = 0
) -> tuple[list[UnderflowRow], list[UnderflowRow], float]:
    """Train in fp32 from `seed`, then measure both underflow reports on the next batch."""
    cfg = opts.job(
        "--train.micro_batch_size", str(MICRO_BATCH), "--train.global_batch_size", str(MICRO_BATCH),
        "--train.steps", str(TRAIN_STEPS), "--job.seed", str(seed), run=f"underflow-{seed}",
    )  # fmt: skip
    t = Trainer(cfg)
    loss = 0.0
    for _ in range(TRAIN_STEPS):
        loss = t.train_step()["loss"]
    batch = t.train_stream.next_batch(MICRO_BATCH)[:UNDERFLOW_BATCH].to(t.device)
    params = [p for p in t.parameters() if p.requires_grad]

    def loss_fn() -> torch.Tensor:
        return lm_loss(t.model(batch[:, :-1]), batch[:, 1:])

    loss_fn().backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward unannotated
    grads = []
    for p in params:
        assert p.grad is not None  # every trainable parameter of the model is in the loss
        grads.append(p.grad)
    cast = underflow_report(grads, SCALES)
    t.optimizer.zero_grad(set_to_none=True)
    e2e = fp16_backward_underflow(loss_fn, params, SCALES, t.device.type)
    return cast, e2e, loss


def _plot(
    cast: list[list[float]], e2e: list[list[float]], over: list[float], path: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [int(s).bit_length() - 1 for s in SCALES]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for runs, style, label in ((cast, "o-", "cast fp32 grads to fp16"),
                               (e2e, "s-", "backward in fp16 autocast")):  # fmt: skip
        mid = [100 * statistics.median(r) for r in runs]
        (line,) = ax.plot(xs, mid, style, label=f"{label} (median)")
        ax.fill_between(xs, [100 * min(r) for r in runs], [100 * max(r) for r in runs],
                        color=line.get_color(), alpha=0.2)  # fmt: skip
    ax.plot(xs, [100 * o for o in over], "x--", label="overflow (fp16 backward, max)")
    ax.set_xlabel("loss scale (log2)")
    ax.set_ylabel("% of non-zero gradient elements")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_title(title + "; band: range over the runs", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
