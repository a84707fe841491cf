"""The GPU check: trainer MFU, the largest micro-batch that fits, offload step time — vs the planner.

    bench/gpu.sh [--out DIR]        # on an H100/H200 host; under 8 minutes
    python -m llmscale.bench.gpu --out DIR [--model llama3.2-1b] [--seq 2048] [--budget-s 420]

On a machine without CUDA it says so, skips the GPU parts and still writes its JSON and Markdown
(so CI runs it). `--allow-cpu` runs the same measurements on the CPU instead, against a device
calibrated by micro-benchmarks (what the tests use, on the tiny model); the largest-micro-batch
search needs a memory limit and runs on CUDA only.

Parts:
0. (CUDA only) the catalog GPU's calibration (`gpus.toml`) next to the same quantities measured
   on the device by the runtime's micro-benchmarks (`train.calibration.measure`, at the run's
   shape in bf16): the model's GEMM rate, attention's share of the bf16 peak, the element-wise
   bandwidth, the fixed cost of a micro-batch, the optimizer step;
1. MFU of `llmscale train` in bf16 for recompute none / selective / full at one micro-batch size,
   measured (the trainer's own metric, against the catalog's dense bf16 peak) vs predicted
   (`plan.predict.predict_step_time` on the catalog GPU, and on the device as part 0 measured
   it);
2. the largest micro-batch that fits (recompute none and full): the planner's answer vs a search
   that trains 2 steps per size until CUDA runs out of memory;
3. step time with the optimizer offloaded to the CPU (serial and overlapped) vs on the device.

Results are written after every part (a part that fails records its error and the rest go on).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmscale.bench.jobs import short_job
from llmscale.bench.timing import calibrated
from llmscale.config import JobConfig, load_config
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import get_gpu, gpu_for_device_name
from llmscale.model.config import get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.predict import predict_memory, predict_step_time
from llmscale.plan.time import DEFAULT_TIME, TimeParams, gemm_seconds
from llmscale.stack import LLMSCALE
from llmscale.train.calibration import BENCH, cluster_from, device_costs, linear_shapes, measure
from llmscale.train.trainer import Trainer

SKIP = (
    "no CUDA device: skipping the GPU parts (MFU per recompute mode, largest micro-batch that "
    "fits, offload step time); run bench/gpu.sh on an H100/H200 host, or pass --allow-cpu"
)


class Budget:
    """Wall-clock budget: parts check it before starting more work."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return self.deadline - time.monotonic()


def _job(args: argparse.Namespace, run_dir: Path, *overrides: str) -> JobConfig:
    base = short_job(
        model__name=args.model,
        job__device=args.device,
        job__run_dir=run_dir,
        data__seq_len=args.seq,
        data__max_files=args.data_files,
        precision__mode="bf16",
        train__steps=args.steps,
        lr_scheduler__warmup_steps=0,
        # The largest-micro-batch search measures where the planner's limit really is.
        job__memory_check="off",
    )
    return load_config(None, [*base, *overrides])


def _run(cfg: JobConfig, steps: int, warmup: int = 2) -> dict[str, float]:
    """Train `steps` steps; medians of the timed ones, and the peak CUDA memory."""
    # What an earlier run left: the first model built in a process waits for the collector
    # (torch._dynamo, imported under its build, keeps those frames in a cycle; Trainer.close).
    _free()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = Trainer(cfg)
    try:
        rows = [t.train_step() for _ in range(steps)]
    finally:
        del t
        _free()
    timed = rows[warmup:] or rows
    out = {
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
    }
    if all("mfu" in r for r in timed):
        out["mfu"] = statistics.median(r["mfu"] for r in timed)
    if "cuda_peak_bytes" in rows[-1]:
        out["cuda_peak_bytes"] = max(r["cuda_peak_bytes"] for r in rows)
    return out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _hardware(args: argparse.Namespace) -> tuple[Cluster, TimeParams, str, float | None]:
    """The cluster to predict on, its time parameters, a label, and the peak for MFU."""
    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        gpu = get_gpu(args.gpu) if args.gpu else gpu_for_device_name(name)
        if gpu is None:
            raise ConfigError(
                "device",
                name,
                "a GPU whose name the hardware catalog knows (llmscale hw), or pass --gpu NAME",
            )
        return Cluster.of(gpu.name), DEFAULT_TIME, gpu.name, gpu.peak_flops("bf16")
    from llmscale.bench.runner import BenchOptions

    opts = BenchOptions(model=args.model, seq_len=args.seq, device="cpu")
    cluster, params, figures = calibrated(opts, args.micro_batch)
    return cluster, params, "cpu (measured)", figures["gemm_bf16_flops"]


def calibration_part(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    """The catalog's calibration of `cluster.gpu` (and the runtime stack's fixed cost of a
    micro-batch on a catalog GPU) vs the runtime's micro-benchmarks on the device at the run's
    shape (bf16). Also the raw figures (`figures`), for `cluster_from` and `device_costs`."""
    model = get_preset(args.model)
    device = torch.device(args.device)
    figures = measure(model, args.micro_batch, args.seq, "bf16", device, (), BENCH)
    gpu, cal = cluster.gpu, cluster.gpu.calibration
    peak, tokens = gpu.peak_flops("bf16"), args.micro_batch * args.seq
    shapes = [(tokens, fan_out, fan_in) for fan_in, fan_out in linear_shapes(model)]
    flops = sum(2.0 * m * n * k for m, n, k in shapes)
    catalog_rate = flops / gemm_seconds(shapes, peak, cal, None)
    rows = [
        ("GEMM rate, the model's linears", "TFLOP/s", catalog_rate / 1e12,
         figures["gemm_bf16_flops"] / 1e12),
        ("GEMM share of the bf16 peak", "", catalog_rate / peak,
         figures["gemm_bf16_flops"] / peak),
        ("attention (causal SDPA fwd+bwd) share of the bf16 peak", "",
         cal.attention_efficiency.value, figures["attention_flops"] / peak),
        ("element-wise bandwidth", "TB/s", gpu.hbm_bandwidth * cal.hbm_efficiency.value / 1e12,
         figures["bandwidth_bytes"] / 1e12),
        ("fixed cost of a micro-batch", "ms", LLMSCALE.microbatch_overhead_ms.value,
         1000 * figures["fixed_s"]),
        ("optimizer step (AdamW, all parameters)", "ms", None, 1000 * figures["optimizer_s"]),
    ]  # fmt: skip
    return {
        "figures": figures,
        "rows": [{"quantity": q, "unit": u, "catalog": c, "measured": m} for q, u, c, m in rows],
    }


def mfu_part(
    args: argparse.Namespace,
    work: Path,
    cluster: Cluster,
    params: TimeParams,
    peak: float | None,
    budget: Budget,
    measured: tuple[Cluster, TimeParams] | None = None,
) -> list[dict[str, Any]]:
    """`measured`: the device as its micro-benchmarks describe it, with the time parameters of
    the runtime's stack at the costs measured there (a second prediction)."""
    rows: list[dict[str, Any]] = []
    for mode in ("none", "selective", "full"):
        if budget.left < 30:
            rows.append({"recompute": mode, "skipped": "time budget spent"})
            continue
        extra = ["--train.recompute", mode, "--train.micro_batch_size", str(args.micro_batch),
                 "--train.global_batch_size", str(args.micro_batch)]  # fmt: skip
        if peak is not None:
            extra += ["--metrics.peak_tflops", str(peak / 1e12)]
        cfg = _job(args, work / f"mfu-{mode}", *extra)
        got = _run(cfg, args.steps)
        pred = predict_step_time(cfg, cluster, params)
        rows.append(
            {
                "recompute": mode,
                "micro_batch_size": args.micro_batch,
                "measured_mfu": got.get("mfu"),
                "predicted_mfu": pred.mfu,
                "measured_step_time_s": got["step_time_s"],
                "predicted_step_time_s": pred.seconds,
                "predicted_step_time_measured_cal_s": (
                    predict_step_time(cfg, *measured).seconds if measured else None
                ),
                "tokens_per_s": got["tokens_per_s"],
                "cuda_peak_bytes": got.get("cuda_peak_bytes"),
                "predicted_peak_bytes": predict_memory(cfg).total,
            }
        )
        print(f"mfu {mode}: {rows[-1]}", flush=True)
    return rows


def max_micro_batch_part(
    args: argparse.Namespace, work: Path, cluster: Cluster, budget: Budget
) -> list[dict[str, Any]]:
    """Largest micro-batch that trains without CUDA OOM, vs the planner's largest that fits."""
    return [_largest_micro_batch(args, work, cluster, budget, mode) for mode in ("none", "full")]


def _largest_micro_batch(
    args: argparse.Namespace, work: Path, cluster: Cluster, budget: Budget, mode: str
) -> dict[str, Any]:
    def cfg_for(b: int) -> JobConfig:
        return _job(args, work / f"fit-{mode}-{b}", "--train.recompute", mode,
                    "--train.micro_batch_size", str(b), "--train.global_batch_size", str(b))  # fmt: skip

    predicted = 0
    for b in range(1, args.max_search + 1):
        if not predict_memory(cfg_for(b)).fits(cluster.gpu):
            break
        predicted = b

    def trains(b: int) -> bool:
        ok = True
        try:
            _run(cfg_for(b), steps=2, warmup=0)
        except torch.cuda.OutOfMemoryError:
            ok = False
        # Freed only here: inside `except` the traceback still holds the failed trainer's frames.
        _free()
        return ok

    # Start at the prediction; double while it trains, then bisect between the last size that
    # trained (lo) and the first that did not (hi).
    lo, hi = 0, None
    b = max(1, predicted)
    while budget.left > 30 and b <= args.max_search:
        if trains(b):
            lo = b
            if lo == args.max_search:
                break
            b = min(2 * b, args.max_search) if hi is None else (lo + hi) // 2
        else:
            hi = b
            b = (lo + hi) // 2
        if hi is not None and hi - lo <= 1:
            break
    return {
        "recompute": mode,
        "predicted": predicted,
        "measured": lo,
        "first_oom": hi,
        "searched_up_to": args.max_search,
    }


def offload_part(
    args: argparse.Namespace, work: Path, cluster: Cluster, params: TimeParams, budget: Budget
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, extra in (
        ("on device", ["--optimizer.offload", "none"]),
        (
            "offload, serial",
            ["--optimizer.offload", "optimizer", "--optimizer.offload_overlap", "false"],
        ),
        (
            "offload, overlapped",
            ["--optimizer.offload", "optimizer", "--optimizer.offload_overlap", "true"],
        ),
    ):
        if budget.left < 30:
            rows.append({"optimizer": label, "skipped": "time budget spent"})
            continue
        cfg = _job(args, work / f"offload-{label.replace(' ', '').replace(',', '-')}", *extra,
                   "--train.micro_batch_size", str(args.micro_batch), "--train.global_batch_size", str(args.micro_batch))  # fmt: skip
        got = _run(cfg, args.steps)
        rows.append(
            {
                "optimizer": label,
                "measured_step_time_s": got["step_time_s"],
                "predicted_step_time_s": predict_step_time(cfg, cluster, params).seconds,
                "cuda_peak_bytes": got.get("cuda_peak_bytes"),
            }
        )
    return rows


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# GPU check: {results['model']} on {results['device']}", ""]
    if "skipped" in results:
        return "\n".join([*lines, results["skipped"], ""])

    def f(v: Any, pct: bool = False) -> str:
        if v is None:
            return "-"
        if pct:
            return f"{100 * v:.1f}%"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    if "torch" in results:
        lines += [f"{results.get('cuda_device_name')}, torch {results['torch']}", ""]
    cal = results.get("calibration")
    if isinstance(cal, dict) and "rows" in cal:
        lines += [
            "## Calibration: the catalog vs micro-benchmarks on this device (bf16)",
            "",
            "| quantity | unit | catalog | measured | measured / catalog |",
            "|---|---|---:|---:|---:|",
        ]
        for r in cal["rows"]:
            c, m = r["catalog"], r["measured"]
            ratio = f"{m / c:.2f}" if c else "-"
            lines.append(f"| {r['quantity']} | {r['unit']} | {f(c)} | {f(m)} | {ratio} |")
        lines.append("")
    lines += [
        "## MFU, bf16",
        "",
        "| recompute | mbs | MFU measured | MFU predicted | step s measured | step s predicted "
        "| step s predicted (measured calibration) | peak GiB measured | peak GiB predicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gib = 2.0**30
    for r in _part_rows(results, "mfu", lines):
        mp, pp = r.get("cuda_peak_bytes"), r.get("predicted_peak_bytes")
        lines.append(
            f"| {r['recompute']} | {r.get('micro_batch_size', '-')} | {f(r.get('measured_mfu'), True)} | {f(r.get('predicted_mfu'), True)} | {f(r.get('measured_step_time_s'))} | {f(r.get('predicted_step_time_s'))} | {f(r.get('predicted_step_time_measured_cal_s'))} | {f(mp / gib if mp else None)} | {f(pp / gib if pp else None)} |"
        )
    if results.get("max_micro_batch"):
        lines += [
            "",
            "## Largest micro-batch that fits",
            "",
            "| recompute | predicted | measured | first OOM |",
            "|---|---:|---:|---:|",
        ]
        for r in _part_rows(results, "max_micro_batch", lines):
            lines.append(
                f"| {r['recompute']} | {r['predicted']} | {r['measured']} | {f(r['first_oom'])} |"
            )
    lines += [
        "",
        "## Optimizer offload",
        "",
        "| optimizer | step s measured | step s predicted | CUDA peak GiB |",
        "|---|---:|---:|---:|",
    ]
    for r in _part_rows(results, "offload", lines):
        peak = r.get("cuda_peak_bytes")
        lines.append(
            f"| {r['optimizer']} | {f(r.get('measured_step_time_s'))} | {f(r.get('predicted_step_time_s'))} | {f(peak / 2**30 if peak else None)} |"
        )
    return "\n".join(lines) + "\n"


def _part_rows(results: dict[str, Any], key: str, lines: list[str]) -> list[dict[str, Any]]:
    """A part's rows; a failed part's error goes into `lines` instead."""
    got = results.get(key, [])
    if isinstance(got, dict):
        lines.append(f"| {key} failed: {got.get('error')} |")
        return []
    return list(got)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench/gpu.sh",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="runs/gpu-check", help="folder for gpu_results.json and .md")
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument(
        "--micro-batch", type=int, default=4, help="micro-batch for the MFU and offload parts"
    )
    ap.add_argument(
        "--steps", type=int, default=8, help="steps per configuration (first 2 untimed)"
    )
    ap.add_argument("--data-files", type=int, default=400)
    ap.add_argument("--max-search", type=int, default=64, help="largest micro-batch tried")
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="stop starting new work after this"
    )
    ap.add_argument(
        "--allow-cpu", action="store_true", help="without CUDA, measure on the CPU instead"
    )
    ap.add_argument(
        "--gpu",
        help="catalog GPU to predict for (default: matched from torch.cuda.get_device_name(); "
        "e.g. h200 for an 'NVIDIA H200 NVL' the catalog does not list)",
    )
    args = ap.parse_args(argv)
    get_preset(args.model)
    if args.gpu:
        get_gpu(args.gpu)  # a bad name fails here, before any work
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"model": args.model, "seq_len": args.seq}
    if torch.cuda.is_available():
        args.device = "cuda"
    elif args.allow_cpu:
        args.device = "cpu"
    else:
        print(SKIP)
        results.update(device="none", skipped=SKIP)
        _write(out, results)
        return 0
    budget = Budget(args.budget_s)
    cluster, params, label, peak = _hardware(args)
    results["device"] = label
    if args.device == "cuda":
        results["cuda_device_name"] = torch.cuda.get_device_name()
        results["torch"] = torch.__version__
    work = Path(tempfile.mkdtemp(prefix="llmscale-gpu-"))

    def run_part(key: str, part: Callable[[], Any]) -> None:
        """Run one part, keep its result (or its error: the other parts still run), write."""
        t0 = time.monotonic()
        print(f"{key}: starting ({budget.left:.0f} s of the budget left)", flush=True)
        try:
            results[key] = part()
        except Exception as e:  # noqa: BLE001 - one part's failure must not lose the others
            results[key] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{key}: failed: {results[key]['error']}", flush=True)
        results.setdefault("part_seconds", {})[key] = round(time.monotonic() - t0, 1)
        _write(out, results)

    measured = None
    if args.device == "cuda":
        run_part("calibration", lambda: calibration_part(args, cluster))
        figures = results["calibration"].get("figures")
        if figures is not None:
            name = f"{label} (measured)"
            model = get_preset(args.model)
            costs = device_costs(figures, model, name, device_type="cuda")
            measured = (
                cluster_from(figures, "bf16", name),
                params.with_stack(params.stack.on_device(costs)),
            )
    run_part("mfu", lambda: mfu_part(args, work, cluster, params, peak, budget, measured))
    if args.device == "cuda":
        run_part("max_micro_batch", lambda: max_micro_batch_part(args, work, cluster, budget))
    else:
        results["max_micro_batch"] = []
    run_part("offload", lambda: offload_part(args, work, cluster, params, budget))
    print(markdown(results))
    return 0


def _write(out: Path, results: dict[str, Any]) -> None:
    (out / "gpu_results.json").write_text(json.dumps(results, indent=2))
    (out / "gpu_results.md").write_text(markdown(results))
    print(f"wrote {out / 'gpu_results.json'} and {out / 'gpu_results.md'}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        sys.stderr.write(f"bench/gpu.sh: error: {e}\n")
        sys.exit(2)
