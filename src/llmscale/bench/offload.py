"""Step time with the optimizer on the device, offloaded serially, and offloaded with overlap.

    python bench/offload.py [--model small] [--rounds 4] [--block 3] [--seq 128] [--batch 4]
                            [--accum 2] [--precision fp32] [--clip 1.0] [--link-gbps 0 1 0.1]
                            [--offload MODE ...] [--lsp-dim D] [--save-timeline DIR]
    python -m llmscale.bench.offload [same flags]

Three trainers on the same batches, in rounds of one block of consecutive steps each:
- off:     torch AdamW on the device (the trainer's default path);
- serial:  `optimizer.offload = MODE` (each of `--offload`), `offload_overlap = false`: every
           copy and the CPU update run inline, one after the other (the cost to hide);
- overlap: the layer-wise pipeline (side streams on CUDA; worker threads on a CPU host).
With `optimizer+params` the offload work also holds the parameter uploads before each unit's
forward and backward; the device-resident parameter bytes are reported for each trainer (the
ledger's `param_bytes` between steps, and under optimizer+params `device_param_peak_bytes`).

Reported: step times (per round the block's fastest step, then the median over rounds); the
bytes moved between device and host per step (the metrics row's `offload_bytes_moved`, next to
the planner's prediction, plan/offload_traffic.py); the host Adam time per step (the `update`
bars of the serial run's timeline: the host AdamW arithmetic, casts excluded); the
offload work per step (download + host accumulate/norm/Adam/cast + upload: the union of those
lanes in the serial run's timeline); the share of it hidden by overlap, two ways: by wall time,
(serial - overlap) / offload work, per round then the median, and by the overlap run's own
timeline, the part of its offload lanes that ran while compute ran; and where the update starts
and the last upload ends relative to the end of backward (the clipping/fp16 barrier).

On a CPU host the "device" is the CPU: copies are memcpy and compete with compute for the same
cores and memory bandwidth, so little can hide. `--link-gbps G` makes each CPU-host copy last as
long as over a G GB/s link (sleeping, cores free): how a PCIe-like transfer time hides behind
compute. On a CUDA host copies are real PCIe transfers and the flag is ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from llmscale.bench.jobs import short_job
from llmscale.config import OFFLOAD_MODES, load_config
from llmscale.offload import overlap_stats
from llmscale.offload.engine import Link
from llmscale.offload.timeline import OFFLOAD_LANES, length, union
from llmscale.plan import activations as act
from llmscale.plan.memory import MemoryOptions
from llmscale.plan.predict import expected_runtime_metrics
from llmscale.train.trainer import Trainer


def _trainer(args: argparse.Namespace, mode: str, link_gbps: float, offload: str) -> Trainer:
    extra: dict[str, object] = {}
    if mode != "off":
        extra = {"optimizer__offload": offload, "optimizer__offload_overlap": mode == "overlap"}
        if offload == "lsp" and args.lsp_dim is not None:
            extra["optimizer__lsp_dim"] = args.lsp_dim
    overrides = short_job(
        model__name=args.model,
        job__run_dir=tempfile.mkdtemp(prefix=f"bench-{mode}-"),
        data__seq_len=args.seq,
        data__max_files=200,
        train__micro_batch_size=args.batch,
        train__global_batch_size=args.batch * args.accum,
        train__steps=args.rounds * args.block + args.warmup,
        train__max_grad_norm=args.clip,
        precision__mode=args.precision,
        metrics__activation_memory=False,
        **extra,
    )
    t = Trainer(load_config(None, overrides))
    if mode != "off" and link_gbps > 0 and t.device.type == "cpu":
        simulate_link(t, link_gbps)
    return t


def simulate_link(trainer: Trainer, link_gbps: float) -> None:
    """Make each of the offloaded optimizer's CPU-host copies last as long as over a link.

    The one place this benchmark reaches into the optimizer's internals: it replaces the `link`
    of its device-to-host and host-to-device copiers. The optimizer's constructor takes
    `link_bytes_per_s`, but no config key reaches it (a simulated link is for benchmarks only).
    """
    opt = trainer.optimizer
    for copier in (opt.d2h, opt.h2d):
        copier.link = Link(link_gbps * 1e9)


def _offload_work_s(trainer: Trainer, steps: list[int]) -> list[float]:
    ivs = trainer.optimizer.timeline.intervals()
    return [
        length(union((iv.start, iv.end) for iv in ivs if iv.step == s and iv.lane in OFFLOAD_LANES))
        for s in steps
    ]


def _phase_s(trainer: Trainer, steps: list[int], phase: str) -> list[float]:
    """Per step, the summed length of the timeline's `phase` bars (e.g. the host "update")."""
    ivs = trainer.optimizer.timeline.intervals()
    return [
        sum(iv.end - iv.start for iv in ivs if iv.step == s and iv.phase == phase) for s in steps
    ]


def predicted_bytes_moved(trainer: Trainer) -> float | None:
    """The planner's `offload_bytes_moved` for the trainer's job (None: not modelled)."""
    cfg = trainer.cfg
    options = MemoryOptions(kernels=act.Kernels.for_runtime(cfg.model, 1, trainer.device.type))
    return expected_runtime_metrics(cfg, options=options).get("offload_bytes_moved")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Block(NamedTuple):
    """One trainer's block of consecutive steps in `interleaved_blocks`."""

    name: str
    step_s: list[float]  # wall time of each timed step (the block's first is not timed)
    cpu_s: list[float]  # the process's CPU time (all threads) over each timed step
    steps: list[int]  # the timed steps' indices (as the optimizer's timeline numbers them)
    last: dict[str, Any]  # the block's last metrics row


def interleaved_blocks(trainers: Mapping[str, Trainer], rounds: int, block: int) -> Iterator[Block]:
    """Rounds of one block of `block` consecutive steps per trainer, in `trainers`' order.

    Each trainer runs blocks of consecutive steps, so a step's uploads overlap its own next
    forward (interleaving single steps would hide them under another trainer's step). The
    blocks of a round run back to back, so they see about the same machine load; a figure is
    taken per round (e.g. the block's fastest step) and then the median over rounds. A block's
    first step, whose predecessor's tail ran under another block, is not timed.
    """
    for _ in range(rounds):
        for name, t in trainers.items():
            times, cpu, steps = [], [], []
            row: dict[str, Any] = {}
            for j in range(max(2, block)):
                c0 = time.process_time()
                row = t.train_step()
                if j > 0:
                    times.append(float(row["step_time_s"]))
                    cpu.append(time.process_time() - c0)
                    steps.append(t.step - 1)  # its index in the optimizer's timeline
            yield Block(name, times, cpu, steps, row)


def run(args: argparse.Namespace, link_gbps: float, offload: str) -> dict[str, Any]:
    """One offload mode at one link: the three trainers' figures, printed, and returned as a
    record's entry (`record`)."""
    trainers = {m: _trainer(args, m, link_gbps, offload) for m in ("off", "serial", "overlap")}
    last_row: dict[str, dict[str, Any]] = {}
    for t in trainers.values():
        if hasattr(t.optimizer, "timeline"):
            t.optimizer.timeline.keep_steps = 10_000
    for t in trainers.values():  # warm-up
        for _ in range(args.warmup):
            t.train_step()
    block = max(2, args.block)
    per_round: dict[str, list[float]] = {m: [] for m in trainers}
    work_round: list[float] = []
    adam_round: list[float] = []
    timed: list[int] = []
    for b in interleaved_blocks(trainers, args.rounds, block):
        last_row[b.name] = b.last
        per_round[b.name].append(min(b.step_s))
        if b.name == "serial":
            work_round.append(min(_offload_work_s(trainers[b.name], b.steps)))
            adam_round.append(min(_phase_s(trainers[b.name], b.steps, "update")))
        if b.name == "overlap":
            timed += b.steps
    trainers["overlap"].optimizer.synchronize()  # the last step's uploads, too
    ivs = trainers["overlap"].optimizer.timeline.intervals()
    done = set(timed)
    hidden_tl = [overlap_stats(ivs, [s]).hidden_fraction for s in timed if s + 1 in done]
    # The barrier: from the end of backward to the first update, and to the last upload
    # (optimizer+params: to the last update; its uploads are the next forward's fetches).
    last_phase = "update" if offload == "optimizer+params" else "upload"
    barrier, tail = [], []
    for s in timed:
        back_end = max(iv.end for iv in ivs if iv.step == s and iv.phase == "backward")
        first_update = min(iv.start for iv in ivs if iv.step == s and iv.phase == "update")
        last_up = max(iv.end for iv in ivs if iv.step == s and iv.phase == last_phase)
        barrier.append(first_update - back_end)
        tail.append(last_up - back_end)
    med = {m: statistics.median(v) for m, v in per_round.items()}
    hidden_wall = statistics.median(
        (per_round["serial"][r] - per_round["overlap"][r]) / work_round[r]
        for r in range(args.rounds)
    )
    w = statistics.median(work_round)
    t = trainers["off"]
    opt = trainers["overlap"].optimizer
    kernel = "fused" if getattr(opt, "fused", False) else "exact"
    print(
        f"offload {offload}: model {args.model} ({t.n_params:,} params), {args.precision}, "
        f"batch {args.batch} x "
        f"{args.seq} x {args.accum} accum, clip {args.clip}, {t.device}, "
        f"{torch.get_num_threads()} threads, kernel {kernel}, "
        f"update in backward {opt.update_in_backward}, "
        + (f"lsp_dim {opt.lsp.dim}, " if opt.lsp is not None else "")
        + "link "
        + (
            f"{link_gbps:g} GB/s (simulated)"
            if link_gbps > 0 and t.device.type == "cpu"
            else "native"
        )
    )
    for mode in trainers:
        print(f"  {mode:8s} step {1e3 * med[mode]:8.1f} ms")
    print(f"  offload work per step (serial run's timeline) {1e3 * w:8.1f} ms")
    print(f"  host Adam per step (serial run's update bars) {1e3 * _median(adam_round):8.1f} ms")
    want = predicted_bytes_moved(trainers["overlap"])
    for mode, row in last_row.items():
        print(
            f"  bytes moved per step {mode:8s} {row['offload_bytes_moved'] / 2**20:9.2f} MiB"
            + (f" (predicted {want / 2**20:.2f} MiB)" if want is not None and mode != "off" else "")
        )
    print(f"  hidden by overlap, wall time: (serial - overlap) / work = {hidden_wall:6.1%}")
    print(f"  hidden by overlap, timeline: under compute       = {_median(hidden_tl):6.1%}")
    print(
        f"  overhead vs off: serial {med['serial'] / med['off'] - 1:+.1%}, "
        f"overlap {med['overlap'] / med['off'] - 1:+.1%}"
    )
    print(
        f"  overlap run: first update {1e3 * statistics.median(barrier):+.1f} ms after backward "
        f"ends (negative: during backward), last {last_phase} "
        f"{1e3 * statistics.median(tail):+.1f} ms"
    )
    for mode, row in last_row.items():
        peak = row.get("device_param_peak_bytes")
        print(
            f"  device parameters {mode:8s} {row['param_bytes'] / 2**20:7.2f} MiB between steps"
            + (
                f", at most {peak / 2**20:.2f} MiB at once during a step"
                if peak is not None
                else ""
            )
        )
    if args.save_timeline:
        from llmscale.train.plot import plot_timeline, timeline_path

        for mode in ("serial", "overlap"):
            tag = {"optimizer": "", "optimizer+params": "params-"}.get(offload, f"{offload}-")
            folder = Path(args.save_timeline) / f"{tag}{mode}-link{link_gbps:g}"
            trainers[mode].optimizer.write_timeline(timeline_path(folder))
            print(f"  wrote {plot_timeline(folder)}")
    for tr in trainers.values():
        if hasattr(tr.optimizer, "close"):
            tr.optimizer.close()
    return {
        "offload": offload,
        "link_gbps": link_gbps if t.device.type == "cpu" else 0.0,
        "step_s": med,  # off, serial, overlap
        "offload_work_s": w,
        "host_adam_s": _median(adam_round),
        "bytes_moved": {m: row["offload_bytes_moved"] for m, row in last_row.items()},
        "bytes_moved_predicted": want,
        "hidden_wall": hidden_wall,
        "hidden_timeline": _median(hidden_tl),
        "n_params": t.n_params,
        # the overlap run: from the end of backward to the first update and to the last upload
        # (optimizer+params: the last update), medians over the timed steps
        "update_after_backward_s": statistics.median(barrier),
        "last_after_backward_s": statistics.median(tail),
        # the device's parameter bytes between steps (the ledger's param_bytes) and, under
        # optimizer+params, the most held at once during a step (device_param_peak_bytes)
        "param_bytes": {m: row["param_bytes"] for m, row in last_row.items()},
        "param_peak_bytes": {
            m: row["device_param_peak_bytes"]
            for m, row in last_row.items()
            if row.get("device_param_peak_bytes") is not None
        },
    }


SUITE = "offload_modes"


def record(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    argv: list[str],
    load: tuple[float, float],
) -> dict[str, Any]:
    """The runs as a record in results.json's suite schema (docs/results/offload.json): each
    run's figures (`runs`), the offloaded trainers' bytes moved per step as measured-vs-predicted
    rows, the command and the machine's load average around it."""
    from llmscale.bench.report import Row
    from llmscale.bench.timed import now_iso

    rows = [
        Row(SUITE, f"{r['offload']}, link {link_label(r['link_gbps'])}, {mode}",
            "offload_bytes_moved", "B", r["bytes_moved"][mode], r["bytes_moved_predicted"]
            ).to_dict()
        for r in runs for mode in ("serial", "overlap")
    ]  # fmt: skip
    return {
        SUITE: {
            "measured_at": now_iso(),
            "title": "Step time with the optimizer on the device, offloaded serially, and "
            "offloaded with overlap",
            "rows": rows,
            "tables": {},
            "figures": [],
            "notes": [
                f"model {args.model}, {args.precision}, batch {args.batch} x {args.seq} x "
                f"{args.accum} micro-steps, clip {args.clip}; {args.rounds} rounds of {args.block} "
                "steps per trainer; step times: per round the block's fastest, median over rounds",
            ],
            "command": "python -m llmscale.bench.offload " + " ".join(argv),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average": list(load),
            "runs": runs,
        }
    }


def link_label(gbps: float) -> str:
    """A run's link as the tables name it: memcpy (0, the CPU host's own copies) or its rate."""
    return "memcpy" if gbps <= 0 else f"{gbps:g} GB/s"


def offload_choices() -> list[str]:
    """`--offload`'s choices: every offload mode the config knows, but "none" (the `off` run)."""
    return [m for m in OFFLOAD_MODES if m != "none"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of one block per mode")
    ap.add_argument("--block", type=int, default=3, help="consecutive steps per block (>= 2)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0, help="max grad norm; 0 = no clipping")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument(
        "--link-gbps",
        type=float,
        nargs="+",
        default=[0.0, 1.0, 0.1],
        help="simulated link bandwidths on a CPU host; 0 = plain memcpy (default: 0 1 0.1)",
    )
    ap.add_argument(
        "--offload",
        nargs="+",
        default=["optimizer"],
        choices=offload_choices(),
        help="offload modes of the serial and overlap trainers (config.OFFLOAD_MODES; "
        "default: optimizer)",
    )
    ap.add_argument(
        "--lsp-dim",
        type=int,
        help="optimizer.lsp_dim of the lsp trainers (default: the config's, 512, capped per "
        "matrix at half its smaller dimension)",
    )
    ap.add_argument("--save-timeline", help="folder for the timelines (JSON + PNG) of both runs")
    ap.add_argument(
        "--json-out",
        type=Path,
        help="write the figures as a record (docs/results/offload.json: make docs renders "
        "docs/offload.md's table of the offload modes from it)",
    )
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    runs = [run(args, g, offload) for offload in args.offload for g in args.link_gbps]
    if args.json_out is not None:
        rec = record(args, runs, sys.argv[1:] if argv is None else argv, (load, os.getloadavg()[0]))
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
