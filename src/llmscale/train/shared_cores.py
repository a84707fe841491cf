"""Ranks sharing a CPU's cores: what a multi-process CPU run costs beyond one process's kernels.

One process's kernels are micro-benchmarked by train/calibration.py (GEMM rate, element-wise
bandwidth, attention, one token's dispatch, the optimizer). `llmscale train` on a CPU with
several ranks (the demo: 4 ranks, dp_shard 2 x tp 2, over gloo on 2 cores) also pays for:

- *oversubscription*: the ranks' kernels share the cores. A fixed GEMM workload is timed on
  rank 0 alone, then on every rank at once; the ratio (`oversubscription`) scales the
  token-proportional compute (about world / cores when the ranks outnumber the cores);
- *gloo collectives over loopback*: all-reduces over the tensor-parallel group, every group at
  once as in a step, at a small and a large message (`allreduce_latency_s` and
  `allreduce_bytes_per_s`, alpha-beta): the link the planner prices tp's activation
  all-reduces on;
- *the per-step overhead*: a step of the run's own parallelized model (parallelize, the run's
  optimizer, the loss under tensor parallelism) on one token per micro-batch, every rank at
  once (`step_overhead_s`): dispatch, DTensor and FSDP2 bookkeeping, the parameter all-gathers
  and gradient reduce-scatters (their size does not depend on the tokens), the gradient-norm
  and loss reductions and the optimizer step, under the oversubscription they run in; the
  median of steps spanning `STEP_SPAN_S`, timed on while a burst of others' work fills most of
  either half (`enough_steps`).

plan/shared_cores.py composes them with the planner's step. The figures are cached next to the
single-process ones (instrument/calibrate.py's folder), with when they were measured and the
load other processes put on the machine meanwhile (`instrument.calibrate.LoadMeter`); a
measurement taken while others used more than a quarter of a core is taken again, once. With
them is the time of train/calibration.py's probe run on every rank at once; a run that finds
the costs runs it again and measures them again when it is more than `PROBE_TOLERANCE` slower
or faster (the machine's load changed), with a line that says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from llmscale.config import JobConfig
from llmscale.instrument import calibrate
from llmscale.parallel.dims import ParallelDims
from llmscale.plan.plan import Plan
from llmscale.plan.shared_cores import SharedCoreCosts, overhead_seq_len
from llmscale.train.calibration import PROBE_TOLERANCE, probe_change, probe_seconds, say

VERSION = 4  # 4: the probe's time kept with the costs; 3: a workload long enough to overlap; 2: the step's bookkeeping (activation meter, ledgers) in the overhead
MESSAGE_BYTES = (4 * 2**10, 8 * 2**20)  # all-reduce sizes: latency-bound, bandwidth-bound
OVERSUB_GEMM = 192  # n of the n x n fp32 GEMM timed alone and on every rank at once
OVERSUB_SECONDS = 0.1  # the GEMM workload's length alone
# One-token steps timed (after one untimed), the median (`overhead_estimate`): at least
# STEP_MIN_REPEATS of them and STEP_SPAN_S seconds, and on while a burst of other work fills
# most of either half (`enough_steps`), so that the burst stays a minority of the steps. Six
# steps (about 2 s at the demo's 0.25-0.35 s) read 529 ms instead of about 256 in one demo
# run, its predicted / measured 1.46: a burst of a second or two lengthened most of them. At
# the demo's shape the span costs 14 steps, about 2.5 s more than six (the ranks' whole
# measurement: about 8 s, was 5.5), up to STEP_MAX_SPAN_S under a burst.
STEP_MIN_REPEATS = 9
STEP_SPAN_S = 4.0
STEP_MAX_SPAN_S = 12.0
STEP_MAX_REPEATS = 40  # a fast machine's step: the span's limit in steps


def applies(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> bool:
    """A multi-process CPU run this module measures: one model part (no pipeline), no context
    parallelism, no host offload (their step is priced by the planner alone)."""
    return (
        device.type == "cpu"
        and dims.world_size > 1
        and dims.pp == 1
        and dims.cp == 1
        and cfg.optimizer.offload == "none"
        and not cfg.fsdp_cpu_offload
    )


def _agree(dims: ParallelDims, value: float, op: Any = None) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.MAX)
    return float(t[0])


def oversubscription(dims: ParallelDims) -> float:
    """Time of a fixed GEMM workload on every rank at once over rank 0's time alone. The
    workload lasts `OVERSUB_SECONDS` alone, so that the ranks' runs overlap (a shorter one
    finishes before the last rank leaves the barrier)."""
    a = torch.randn(OVERSUB_GEMM, OVERSUB_GEMM)
    b = torch.randn(OVERSUB_GEMM, OVERSUB_GEMM)

    def work(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            a @ b
        return time.perf_counter() - start

    n = 8
    if dims.rank == 0:
        while work(n) < OVERSUB_SECONDS:
            n *= 2
    n = int(_agree(dims, float(n)))
    alone = math.inf
    for _ in range(3):
        dist.barrier()
        if dims.rank == 0:
            alone = min(alone, work(n))
        dist.barrier()
    together = math.inf
    for _ in range(3):
        dist.barrier()
        together = min(together, _agree(dims, work(n)))  # the slowest rank of each round
    alone = _agree(dims, alone if dims.rank == 0 else 0.0)
    return max(1.0, together / alone)


def allreduce_alpha_beta(dims: ParallelDims) -> tuple[float, float]:
    """(latency s, bytes/s) of an all-reduce of fp32 over the tp group (else the whole world),
    all groups at once: t(S) = latency + S / rate from the two `MESSAGE_BYTES`."""
    group = dims.submesh("tp").get_group() if dims.tp > 1 else dist.group.WORLD
    times = []
    for nbytes in MESSAGE_BYTES:
        buf = torch.zeros(nbytes // 4)
        dist.all_reduce(buf, group=group)
        best = math.inf
        iters = 20 if nbytes < 2**20 else 5
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf, group=group)
            best = min(best, _agree(dims, (time.perf_counter() - start) / iters))
        times.append(best)
    (s0, s1), (t0, t1) = MESSAGE_BYTES, times
    if t1 <= 1.1 * t0:  # the machine's noise hid the bytes' time: all of the large one's, bytes
        return t0, s1 / t1
    rate = (s1 - s0) / (t1 - t0)
    return max(t0 - s0 / rate, 1e-7), rate


def step_overhead_seconds(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> float:
    """Median seconds of an optimizer step of the run's parallelized model on micro-batches of
    one-token sequences (`overhead_seq_len`), on every rank at once (the slowest rank's)."""
    from llmscale.instrument.activations import ActivationMeter
    from llmscale.model.transformer import build_model
    from llmscale.parallel.data_parallel import set_gradient_sync
    from llmscale.parallel.materialize import materialize
    from llmscale.parallel.parallelize import parallelize
    from llmscale.parallel.tensor_parallel import loss_context
    from llmscale.train.optim import build_optimizers
    from llmscale.train.trainer import lm_loss

    parts = parallelize(build_model(cfg.model, "meta"), dims, cfg).parts
    materialize(parts, device, cfg.job.seed)
    (model,) = parts
    opts = build_optimizers(parts, cfg, dims)
    seq = overhead_seq_len(Plan.from_job(cfg))
    tokens = torch.zeros((cfg.train.micro_batch_size, seq + 1), dtype=torch.long, device=device)
    n_mb = cfg.n_microbatches

    def step() -> None:  # the trainer's train_step, its per-step bookkeeping included
        opts.begin_step_traffic()
        meter = ActivationMeter(parts, pipelined=False) if cfg.metrics.activation_memory else None
        for i in range(n_mb):
            if dims.reduces_grads:
                set_gradient_sync(parts, i == n_mb - 1)
            counting = meter.counting() if meter is not None and i == 0 else None
            with loss_context(cfg.model, dims.tp):
                with counting or contextlib.nullcontext():
                    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
                (loss / n_mb).backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward unannotated
        loss_sum = dims.global_mean_loss(loss.detach())
        norm, _ = opts.grad_norm(None)
        opts.clip_(norm, cfg.train.max_grad_norm or math.inf)
        opts.grad_memory()
        opts.step()
        opts.zero_grad()
        opts.memory()
        opts.offload_bytes_moved()
        float(loss_sum)

    step()
    times: list[float] = []
    while not enough_steps(times):  # the slowest rank's times: every rank stops together
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(_agree(dims, time.perf_counter() - start))
    return overhead_estimate(times)


def enough_steps(times: list[float]) -> bool:
    """Whether the one-token steps timed so far (`times`, seconds, in the order they ran)
    suffice: at least `STEP_MIN_REPEATS` of them spanning at least `STEP_SPAN_S`, whose first
    and second halves' medians agree within `PROBE_TOLERANCE` (a burst over most of one half
    makes them disagree: timing on until it is a minority of the steps); else
    `STEP_MAX_SPAN_S` or `STEP_MAX_REPEATS`, whichever comes first."""
    n = len(times)
    if n >= STEP_MAX_REPEATS:
        return True
    if n < STEP_MIN_REPEATS:
        return False
    if sum(times) >= STEP_MAX_SPAN_S:
        return True
    if sum(times) < STEP_SPAN_S:
        return False
    first, second = overhead_estimate(times[: n // 2]), overhead_estimate(times[n // 2 :])
    return max(first, second) <= PROBE_TOLERANCE * min(first, second)


def overhead_estimate(times: list[float]) -> float:
    """The step overhead from the one-token steps' `times`: their median (the upper one of an
    even count). Steps that a burst of other work lengthens are consecutive; the median stays a
    quiet step's time while they are fewer than half, a burst shorter than half the
    `STEP_SPAN_S` the steps span. A load that lasts through all of them lengthens the median as
    it lengthens the run's own steps, which the median of the run's steps reports."""
    ordered = sorted(times)
    return ordered[len(ordered) // 2]


def probe_together(dims: ParallelDims, device: torch.device) -> float:
    """train/calibration.py's probe on every rank at once (the slowest rank's seconds): how fast
    the ranks run now, sharing the cores with each other and with the machine's other load."""
    dist.barrier()
    return _agree(dims, probe_seconds(device))


def measure(
    cfg: JobConfig, dims: ParallelDims, device: torch.device
) -> tuple[SharedCoreCosts, float]:
    """Every figure, on every rank at once (a collective call), with the machine's load; and
    the probe's seconds (`probe_together`) alongside."""
    meter = calibrate.LoadMeter()
    over = oversubscription(dims)
    latency, rate = allreduce_alpha_beta(dims)
    overhead = step_overhead_seconds(cfg, dims, device)
    probe = probe_together(dims, device)
    wall, busy, own = meter.stop()
    # every rank's own CPU time is ours: the rest of the machine's busy time is the others'
    own = _agree(dims, own, dist.ReduceOp.SUM)
    wall = _agree(dims, wall)
    costs = SharedCoreCosts(
        oversubscription=over,
        allreduce_latency_s=latency,
        allreduce_bytes_per_s=rate,
        step_overhead_s=overhead,
        other_load_cores=calibrate.other_load_cores(wall, busy, own),
        measured_at=time.time(),
    )
    return costs, probe


def cache_key(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> dict[str, str]:
    shape = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True)
    layout = {n: getattr(dims, n) for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    return {
        **calibrate.machine_key(device),
        "what": "shared cores",
        "version": str(VERSION),
        "cores": str(calibrate.cpu_cores()),
        "model": shape,
        "layout": json.dumps(layout, sort_keys=True),
        "n_microbatches": str(cfg.n_microbatches),
        "precision": cfg.precision.mode,
        "optimizer": json.dumps(dataclasses.asdict(cfg.optimizer), sort_keys=True),
    }


def _read(path: Any, key: dict[str, str]) -> tuple[SharedCoreCosts | None, float, str]:
    """The cached costs for `key` (None: no file, another key, unusable), their probe's
    seconds (NaN: none kept) and why the file cannot be used ("": nothing to say)."""
    data, problem = calibrate.read_record(path, key, "costs")
    if data is None:
        return None, math.nan, problem
    try:
        costs = SharedCoreCosts(**{k: float(v) for k, v in data["costs"].items()})
    except (ValueError, TypeError) as e:
        return None, math.nan, f"is unreadable (its costs: {type(e).__name__})"
    try:
        return costs, float(data["probe_s"]), ""
    except (KeyError, TypeError, ValueError):
        return costs, math.nan, ""


def cached_costs(
    cfg: JobConfig, dims: ParallelDims, device: torch.device
) -> tuple[SharedCoreCosts | None, list[str]]:
    """This run's costs on rank 0 (None elsewhere), from the cache or measured and cached: a
    collective call, every rank of a multi-process CPU run makes it. Cached costs are used
    while the probe, run on every rank at once, is within `PROBE_TOLERANCE` of its time when
    they were measured; else they are measured again, with a line saying so (printed, and the
    first of the warnings). A measurement taken while other processes used more than
    `calibrate.BUSY_CORES` is taken again, once; if the machine stays busy the quieter one is
    used, with a warning (the second item)."""
    key = cache_key(cfg, dims, device)
    path = calibrate.cache_path(key)
    found, then, problem = _read(path, key) if dims.rank == 0 else (None, math.nan, "")
    warnings: list[str] = []
    if _agree(dims, 1.0 if found is not None else 0.0):  # rank 0 has them: probe the machine
        now = probe_together(dims, device)
        change = probe_change(then, now, "costs of the ranks sharing cores")
        if not _agree(dims, 1.0 if change and dims.rank == 0 else 0.0):
            return found, []
        if dims.rank == 0:
            say(change)
            warnings.append(change)
    costs, probe = measure(cfg, dims, device)
    if costs.other_load_cores > calibrate.BUSY_CORES:
        again = measure(cfg, dims, device)
        costs, probe = min((costs, probe), again, key=lambda cp: cp[0].other_load_cores)
        if costs.other_load_cores > calibrate.BUSY_CORES:
            warnings.append(
                f"calibration of the ranks sharing cores: other processes used "
                f"{costs.other_load_cores:.2f} cores while it ran (twice measured): the "
                "predicted step time carries that load"
            )
    if dims.rank != 0:
        return None, []
    payload = {
        "version": VERSION,
        "key": key,
        "costs": dataclasses.asdict(costs),
        "probe_s": probe,
    }
    unwritten = calibrate.write_json(path, payload)
    calibrate.notice_cache_problems(path, problem, unwritten)
    return costs, warnings
