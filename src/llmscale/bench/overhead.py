"""Trainer step time vs a plain hand-written PyTorch loop on the same model and data.

    python bench/overhead.py [--model small] [--steps 20] [--seq 256] [--batch 8]
    python -m llmscale.bench.overhead [same flags] [--json-out docs/results/overhead.json]

Both run one process, fp32, on the same batches; the trainer with its default metrics
(saved-activation counting, memory ledger, JSONL). Prints the median step times and their ratio
(goal: <= 1.03). Steps of the two are interleaved so that machine noise hits both alike.
--json-out writes the figures as one suite of results.json's schema (README renders its line
from docs/results/overhead.json, `make docs`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmscale.bench.jobs import short_job
from llmscale.bench.report import Row
from llmscale.bench.timed import now_iso
from llmscale.config import load_config
from llmscale.data.stream import PackedStream
from llmscale.model.transformer import build_model
from llmscale.train.trainer import Trainer

SUITE = "overhead"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json-out", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]

    run_dir = tempfile.mkdtemp(prefix="llmscale-overhead-")
    overrides = short_job(
        model__name=args.model,
        job__run_dir=run_dir,
        data__seq_len=args.seq,
        data__max_files=200,
        train__micro_batch_size=args.batch,
        train__global_batch_size=args.batch,
        train__steps=args.steps + args.warmup,
    )
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)

    # The plain loop: what one would write by hand.
    model = build_model(cfg.model, trainer.device, seed=cfg.job.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True
    )

    def plain_step(batch: torch.Tensor) -> float:
        t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward unannotated
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        return time.perf_counter() - t0

    stream = trainer.train_stream
    assert isinstance(stream, PackedStream)  # no data.dataset: the byte-level files of data.path
    plain_stream = type(stream)(stream.tokens, args.seq, cfg.job.seed)
    t_trainer, t_plain = [], []
    for i in range(args.steps + args.warmup):
        row = trainer.train_step()
        dt_plain = plain_step(plain_stream.next_batch(args.batch))
        if i >= args.warmup:
            t_trainer.append(row["step_time_s"])
            t_plain.append(dt_plain)
    mt, mp = statistics.median(t_trainer), statistics.median(t_plain)
    print(
        f"model {args.model} ({cfg.model.num_params():,} params), batch {args.batch} x {args.seq}, "
        f"{args.steps} timed steps, {torch.get_num_threads()} threads"
    )
    print(f"plain loop   median step {1000 * mp:8.1f} ms")
    print(f"llmscale     median step {1000 * mt:8.1f} ms")
    print(f"ratio trainer/plain = {mt / mp:.3f}  (goal <= 1.03)")
    if args.json_out:
        config = f"{args.model}, batch {args.batch} x {args.seq}, {torch.get_num_threads()} threads"
        note = (
            f"median of {args.steps} interleaved steps; {os.cpu_count()} CPU cores, load average "
            f"{load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
        )
        rows = [
            Row(SUITE, f"{config}, plain loop", "step time (median)", "s", mp, note=note),
            Row(SUITE, f"{config}, llmscale trainer", "step time (median)", "s", mt, note=note),
            Row(SUITE, config, "trainer / plain loop", "x", mt / mp, note=note),
        ]
        suite = {
            "measured_at": now_iso(),
            "title": "The trainer's step against a plain hand-written loop (bench/overhead.py)",
            "rows": [r.to_dict() for r in rows],
            "tables": {},
            "notes": [note],
            "figures": [],
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({SUITE: suite}, indent=1) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
