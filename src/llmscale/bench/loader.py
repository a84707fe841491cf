"""The memory-mapped shard loader: tokens/s delivered, and resident memory as the corpus grows.

    python bench/loader.py [--sizes-mb 100 1000 4000] [--seq 128] [--batch 32] [--batches 300]
    python -m llmscale.bench.loader [same flags]
    llmscale bench --what loader       (the same figures as a bench suite; sizes 100 MB to 4 GB)

For each size, synthetic uint16 token shards of that many bytes (shards of at most 200 MB, as
`data prepare` writes them) are written to a temporary folder, read through `ShardStream` for
`--batches` global batches of shuffled windows, then deleted. Reported per size: tokens/s
delivered, and the process's resident memory (VmRSS), split into anonymous memory (RssAnon;
"anon +" is its growth from before the stream was built to after the batches: what the loader
itself kept) and mapped file pages (RssFile: pages of the shards the batches
touched, which the kernel may drop at will), plus the peak (VmHWM, reset per size where the
kernel allows). Flat anonymous memory from 100 MB to 4 GB is the claim: no per-corpus index is
built. Next to it, one training step's demand: the tokens/s a short real training of `--model`
consumes on this machine, and what one data-parallel rank consumes in the planner's fastest plan
for Llama 3.2 1B on 8 H100s (the loader runs once per rank). The shards were just written, so they sit in the page cache: this
measures the loader's own cost, not the disk's.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmscale.bench.report import Row, SuiteResult
from llmscale.bench.runner import BenchOptions
from llmscale.data.shards import ShardStream

SHARD_BYTES = 200 << 20  # 100M uint16 tokens, the size `data prepare` caps shards at
BLOCK_BYTES = 32 << 20  # synthetic tokens are written in blocks of this many bytes


@dataclass
class LoaderFigure:
    size_bytes: int
    shards: int
    tokens_per_s: float
    rss_bytes: int
    anon_bytes: int
    anon_growth_bytes: int  # RssAnon after the batches minus before the stream was built
    file_bytes: int
    peak_bytes: int | None  # VmHWM over this size's run (None where it cannot be reset)
    write_s: float


def memory_status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of this process in bytes (Linux /proc; empty elsewhere)."""
    out: dict[str, int] = {}
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def write_synthetic_shards(folder: Path, size_bytes: int, vocab: int = 50_000) -> list[Path]:
    """uint16 token shards holding `size_bytes` in all, written block by block."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, vocab, BLOCK_BYTES // 2, dtype=np.uint16).tobytes()
    paths: list[Path] = []
    left = size_bytes - size_bytes % 2
    while left > 0:
        path = folder / f"train-{len(paths):05d}.bin"
        n = min(left, SHARD_BYTES)
        with open(path, "wb") as f:
            written = 0
            while written < n:
                k = min(len(block), n - written)
                f.write(block[:k])
                written += k
        paths.append(path)
        left -= n
    return paths


def measure_size(
    size_bytes: int, seq: int, batch: int, batches: int, work_dir: Path
) -> LoaderFigure:
    folder = Path(tempfile.mkdtemp(prefix="llmscale-loader-", dir=work_dir))
    try:
        t0 = time.perf_counter()
        paths = write_synthetic_shards(folder, size_bytes)
        write_s = time.perf_counter() - t0
        gc.collect()
        can_reset = _reset_peak()
        anon_before = memory_status().get("RssAnon", 0)
        stream = ShardStream(paths, "uint16", seq, seed=0)
        stream.next_batch(batch)  # the first batch pays for imports and first mappings
        t0 = time.perf_counter()
        for _ in range(batches):
            stream.next_batch(batch)
        dt = time.perf_counter() - t0
        mem = memory_status()
        del stream
        return LoaderFigure(
            size_bytes=size_bytes,
            shards=len(paths),
            tokens_per_s=batches * batch * seq / dt,
            rss_bytes=mem.get("VmRSS", 0),
            anon_bytes=mem.get("RssAnon", 0),
            anon_growth_bytes=mem.get("RssAnon", 0) - anon_before,
            file_bytes=mem.get("RssFile", 0),
            peak_bytes=mem.get("VmHWM") if can_reset else None,
            write_s=write_s,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def training_demand(model: str, seq: int, batch: int, steps: int = 5, warmup: int = 2) -> float:
    """Tokens/s one process's training of `model` consumes here (median of a few steps)."""
    from llmscale.bench.jobs import short_job
    from llmscale.bench.runner import measure
    from llmscale.config import load_config

    run_dir = tempfile.mkdtemp(prefix="llmscale-loader-train-")
    try:
        cfg = load_config(
            None,
            short_job(
                model__name=model,
                job__run_dir=run_dir,
                data__seq_len=seq,
                train__micro_batch_size=batch,
                train__global_batch_size=batch,
                train__steps=steps + warmup,
                metrics__activation_memory=False,
            ),
        )
        return measure(cfg, warmup=warmup).tokens_per_s
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def gpu_demand(
    model: str = "llama3.2-1b", gpu: str = "h100", gpus: int = 8, seq: int = 2048
) -> tuple[float, str]:
    """Tokens/s one data-parallel rank's loader must deliver in the planner's fastest plan for
    `model` on `gpus` x `gpu` (global batch 256 sequences), and the plan in words."""
    from llmscale.report.search_report import plan_report

    best = plan_report(model, gpus, gpu, seq=seq, global_batch=256, top=1).result.candidates[0]
    dp = best.plan.dp
    text = f"{model} on {gpus} x {gpu}, seq {seq}, dp={dp}: {best.time.tokens_per_s:,.0f} tokens/s"
    return best.time.tokens_per_s / dp, text


def figure_lines(figs: list[LoaderFigure], demand: float | None, model: str) -> list[str]:
    from llmscale.ui import human_bytes

    lines = [
        f"{'corpus':>10} {'shards':>6} {'tokens/s':>14} {'RSS':>10} {'anon':>10} "
        f"{'anon +':>8} {'file':>10} {'peak':>10} {'x demand':>9}"
    ]
    for f in figs:
        ratio = f"{f.tokens_per_s / demand:9.0f}" if demand else f"{'-':>9}"
        peak = human_bytes(f.peak_bytes) if f.peak_bytes is not None else "-"
        lines.append(
            f"{human_bytes(f.size_bytes):>10} {f.shards:>6} {f.tokens_per_s:>14,.0f} "
            f"{human_bytes(f.rss_bytes):>10} {human_bytes(f.anon_bytes):>10} "
            f"{human_bytes(f.anon_growth_bytes):>8} {human_bytes(f.file_bytes):>10} {peak:>10} "
            f"{ratio}"
        )
    if len(figs) > 1:
        grow = figs[-1].anon_bytes - figs[0].anon_bytes
        lines.append(
            f"anonymous memory from {human_bytes(figs[0].size_bytes)} to "
            f"{human_bytes(figs[-1].size_bytes)} of tokens: {grow / 2**20:+.1f} MiB; grown while "
            f"the loader ran (anon +): at most {max(f.anon_growth_bytes for f in figs) / 2**20:.1f}"
            " MiB"
        )
    if demand:
        lines.append(
            f"one training step's demand ({model}, one process here): {demand:,.0f} tokens/s"
        )
    per_rank, plan = gpu_demand()
    slowest = min((f.tokens_per_s for f in figs), default=0.0)
    lines.append(
        f"the planner's demand per data-parallel rank ({plan}): {per_rank:,.0f} tokens/s"
        + (f"; the slowest size above delivers x{slowest / per_rank:.1f} that" if slowest else "")
    )
    return lines


def run_figures(
    sizes_mb: list[int],
    seq: int,
    batch: int,
    batches: int,
    model: str | None,
    work_dir: Path | None = None,
) -> tuple[list[LoaderFigure], float | None]:
    work = work_dir or Path(tempfile.gettempdir())
    figs = [measure_size(mb << 20, seq, batch, batches, work) for mb in sizes_mb]
    demand = training_demand(model, seq, min(batch, 8)) if model else None
    return figs, demand


def run(opts: BenchOptions) -> SuiteResult:
    """The `llmscale bench --what loader` suite: opts.loader_sizes_mb (100 MB, 1 GB, 4 GB)."""
    sizes = list(opts.loader_sizes_mb)
    figs, _ = run_figures(sizes, opts.seq_len, 32, 300, None, opts.work_dir)
    demand = training_demand(opts.model, opts.seq_len, 8, opts.steps, opts.warmup)
    res = SuiteResult(name="loader", title="Memory-mapped shard loader (data.dataset)")
    for f in figs:
        cfg = f"{f.size_bytes >> 20} MB, {f.shards} shards"
        res.rows.append(Row("loader", cfg, "tokens/s delivered", "tok/s", f.tokens_per_s))
        res.rows.append(Row("loader", cfg, "RSS", "B", f.rss_bytes))
        res.rows.append(Row("loader", cfg, "RSS anonymous", "B", f.anon_bytes))
    if demand:
        res.rows.append(
            Row("loader", f"training {opts.model}", "tokens/s consumed", "tok/s", demand)
        )
    res.notes += figure_lines(figs, demand, opts.model)[len(figs) + 1 :]
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.bench.loader",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000, 4000])
    ap.add_argument("--seq", type=int, default=128, help="tokens per window (default 128)")
    ap.add_argument("--batch", type=int, default=32, help="windows per batch (default 32)")
    ap.add_argument("--batches", type=int, default=300, help="timed batches per size")
    ap.add_argument("--model", default="small", help="the training step to compare with; none")
    ap.add_argument("--dir", help="where the temporary shards go (default: the temp folder)")
    args = ap.parse_args(argv)
    model = None if args.model == "none" else args.model
    figs, demand = run_figures(
        args.sizes_mb, args.seq, args.batch, args.batches, model,
        Path(args.dir) if args.dir else None,
    )  # fmt: skip
    print(f"ShardStream: {args.batches} batches of {args.batch} x {args.seq + 1} tokens per size")
    for line in figure_lines(figs, demand, args.model):
        print(line)


if __name__ == "__main__":
    main()
