"""Gradient accumulation: k micro-steps of b vs one step of k*b, same global batch.

Time and activation memory of each split, measured vs predicted, and the proof that the
gradients are the same: one global batch through each split, gradients compared element-wise.
"""

from __future__ import annotations

import torch

from llmscale.bench.memory import memory_options
from llmscale.bench.report import Row, SuiteResult
from llmscale.bench.runner import BenchOptions, measure
from llmscale.bench.timing import calibrated, predicted_seconds
from llmscale.plan.predict import expected_runtime_metrics
from llmscale.train.trainer import Trainer

GLOBAL = 32
SPLITS = (32, 8, 2)  # micro-batch sizes; accumulation steps = GLOBAL / micro


def run(opts: BenchOptions) -> SuiteResult:
    res = SuiteResult(
        "accum",
        f"Gradient accumulation, model {opts.model}, global batch {GLOBAL} x seq {opts.seq_len}, fp32",
    )
    grads: dict[int, list[torch.Tensor]] = {}
    losses: dict[int, float] = {}
    batch = None
    for mbs in SPLITS:
        cluster, params, _ = calibrated(opts, mbs)
        cfg = opts.job(
            "--train.micro_batch_size", str(mbs), "--train.global_batch_size", str(GLOBAL),
            "--train.max_grad_norm", "0", run=f"accum-{mbs}",
        )  # fmt: skip
        label = f"b={mbs} k={GLOBAL // mbs}"
        trainer = Trainer(cfg)
        if batch is None:
            batch = trainer.train_stream.next_batch(GLOBAL)
        loss, _ = trainer.forward_backward(batch)
        grads[mbs] = []
        for p in trainer.parameters():
            assert p.grad is not None  # forward_backward gave every parameter its gradient
            grads[mbs].append(p.grad.detach().clone())
        losses[mbs] = loss.item()
        trainer.optimizer.zero_grad(set_to_none=True)
        m = measure(cfg, opts.warmup, trainer=trainer)
        want = expected_runtime_metrics(cfg, options=memory_options(opts))
        res.rows.append(
            Row(
                "accum",
                label,
                "step time",
                "s",
                m.min_step_time_s,
                predicted_seconds(cfg, cluster, params),
            )
        )
        res.rows.append(
            Row("accum", label, "activations", "B", m["activation_bytes"], want["activation_bytes"])
        )
    ref = grads[SPLITS[0]]
    table = []
    for mbs in SPLITS[1:]:
        rel = max(
            ((g - r).norm() / r.norm()).item()
            for g, r in zip(grads[mbs], ref, strict=True)
            if r.norm() > 0
        )
        dl = abs(losses[mbs] - losses[SPLITS[0]]) / losses[SPLITS[0]]
        table.append([f"b={mbs} k={GLOBAL // mbs} vs b={SPLITS[0]} k=1", f"{rel:.2e}", f"{dl:.2e}"])
    res.tables["gradient equivalence (same global batch, fp32)"] = (
        ["pair", "max tensor rel. diff of gradients", "loss rel. diff"],
        table,
    )
    res.notes.append(
        "Activations are per micro-batch (what one forward keeps): accumulation trades them for more, smaller steps."
    )
    return res
