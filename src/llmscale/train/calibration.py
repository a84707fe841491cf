"""This machine as the planner's hardware: the runtime's own kernels, micro-benchmarked.

The planner's time model needs a device. A catalog GPU has its numbers from its data sheet and
its calibration; a CPU (or a GPU missing from the catalog) is measured here, by micro-benchmarks
that are not the training step, each for the model and micro-batch at hand:

- the model's own GEMM shapes run alone (forward and the two backward products of each linear):
  the dense rate per dtype (the measured device's "peak");
- causal SDPA forward and backward in the run's dtype: its achieved share of that dtype's GEMM
  rate is the device's attention efficiency (a CPU's bf16 flash kernel is far slower than its
  bf16 GEMMs);
- the block's element-wise ops as this runtime runs them (the model's norm, `apply_rope`, the
  attention output's copy, SwiGLU/GELU, residual adds, autocast casts; no matmuls): the bytes the
  planner counts for them (`plan.time.runtime_eager_block_parts`) over their time is the
  device's memory bandwidth, net of the same ops on one token (their fixed cost is the
  micro-batch's, below, counted once);
- the model's forward and backward on one token: the fixed cost of a micro-batch (per-op
  dispatch, autograd bookkeeping), `microbatch_overhead_ms`;
- the runtime's optimizer step (train/optim.py's foreach AdamW after the foreach gradient-norm
  clip) over the model's parameters: its achieved share of that bandwidth,
  `optimizer_efficiency`.

The first three are the device's rates (`cluster_from`: its `Calibration` and peaks); the last
two are what the llmscale stack costs on it (`device_costs`: `llmscale.stack.DeviceCosts`, which
the planner prices through `Stack.on_device`), not the bare device's.

`llmscale bench` measures with more trials (`BENCH`); a run's prediction (`cached_cluster`)
measures once per machine and shape and keeps the figures in the calibration cache
(instrument/calibrate.py: `$LLMSCALE_CACHE_DIR`, else `$XDG_CACHE_HOME/llmscale`, else
`~/.cache/llmscale`), in a file named by everything they depend on: host, device, threads, torch
version, the model's shape, micro-batch, sequence length and precision. With the figures it keeps
the time of a fixed probe workload (`probe_seconds`) measured alongside; a run that finds the
figures times the probe again, and measures again when the machine now runs it more than
`PROBE_TOLERANCE` times slower or faster (another engineer's load on a shared machine), saying so
in one line: figures from a quiet hour would otherwise predict a busy hour's run. What a
measurement and a probe cost on this machine: `python -m llmscale.bench.startup` (README,
"startup-calibration" and "startup-probe").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from llmscale.config import OptimizerSection, Precision
from llmscale.errors import ConfigError
from llmscale.hardware.spec import Sourced
from llmscale.instrument import calibrate
from llmscale.model.config import ModelConfig
from llmscale.model.transformer import (
    AttentionCore,
    apply_rope,
    build_model,
    build_norm,
    ffn_activation,
    rope_tables,
)
from llmscale.parallel.context_parallel import ring_attention
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.time import (
    RING_BWD_MATMULS,
    RING_FWD_MATMULS,
    ring_block_flops,
    ring_blocks,
    runtime_eager_block_parts,
)
from llmscale.stack import LLMSCALE, DeviceCosts
from llmscale.tensors import DTYPES
from llmscale.train.optim import build_optimizer

SOURCE = "measured by llmscale micro-benchmarks on this machine"
VERSION = 4  # 4: the probe's time kept with the figures; 3: element-wise bandwidth net of the ops' fixed cost


@dataclass(frozen=True)
class Effort:
    """How hard to time each figure: the fastest of `trials` runs of at least `min_seconds`."""

    trials: int
    min_seconds: float


# llmscale bench: steadier figures; trials of at least 50 ms each, so that the fastest is taken
# over a second or more (a burst of other work on a shared 2-core machine lasts about that).
BENCH = Effort(11, 0.05)
QUICK = Effort(3, 0.01)  # a run's prediction, once per machine and shape


def linear_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of one block, plus the output projection."""
    d, kv, f = model.dim, model.kv_dim, model.ffn_dim
    block = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (f, d)] + ([(d, f)] if model.gated else [])
    return block * model.n_layers + [(d, model.vocab_size)]


GEMM_OPERAND_BUDGET = 512 * 2**20  # bytes of distinct operands the GEMM benchmark cycles through


def gemm_flops_per_s(
    model: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device, effort: Effort
) -> float:
    """FLOP/s of the model's linears for `tokens` rows: x @ W, and both backward products.

    Each linear gets operands of its own, in the model's order (up to `GEMM_OPERAND_BUDGET`
    bytes, then cycled), so that as in a training step each GEMM reads operands that are not in
    the caches: the same GEMMs on operands kept hot run faster (about 20% on a 2-core CPU at
    2,048 tokens)."""
    size = torch.tensor([], dtype=dtype).element_size()
    mats: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    held = 0
    for fan_in, fan_out in linear_shapes(model):
        nbytes = size * (tokens * fan_in + fan_in * fan_out + tokens * fan_out)
        if mats and held + nbytes > GEMM_OPERAND_BUDGET:
            break
        x = torch.randn(tokens, fan_in, dtype=dtype, device=device)
        w = torch.randn(fan_in, fan_out, dtype=dtype, device=device)
        g = torch.randn(tokens, fan_out, dtype=dtype, device=device)
        mats.append((x, w, g))
        held += nbytes

    def run() -> None:
        for x, w, g in mats:
            x @ w  # forward
            g @ w.T  # input gradient
            x.T @ g  # weight gradient

    seconds = calibrate.time_call(run, device, effort.trials, effort.min_seconds)
    flops_once = sum(3 * 2 * x.shape[0] * x.shape[1] * w.shape[1] for x, w, _ in mats)
    return flops_once / seconds


def attention_flops_per_s(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    effort: Effort,
) -> float:
    """FLOP/s of the runtime's attention core (`AttentionCore`: causal SDPA on the heads-second
    views of the projections, grouped-query K and V as the model has them), forward + backward,
    counted as plan/time.py counts them: half of the s x s products of QK^T and AV, the
    backward 2.5x the forward."""
    hd = model.head_dim

    def leaf(heads: int) -> torch.Tensor:
        return torch.randn(
            micro_batch, seq_len, heads, hd, dtype=dtype, device=device, requires_grad=True
        )

    q, k, v = leaf(model.n_heads), leaf(model.n_kv_heads), leaf(model.n_kv_heads)
    core = AttentionCore()
    g = torch.randn(micro_batch, model.n_heads, seq_len, hd, dtype=dtype, device=device)

    def run() -> None:
        out = core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out.backward(g)

    seconds = calibrate.time_call(run, device, effort.trials, effort.min_seconds)
    fwd = 0.5 * 4 * micro_batch * seq_len * seq_len * model.dim
    return 3.5 * fwd / seconds


def elementwise_bandwidth_bytes_per_s(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
    effort: Effort,
) -> float:
    """Bytes/s this runtime's element-wise ops of one block achieve, forward and backward, at
    one micro-batch's size, fed random tensors of the matmuls' output shapes. The bytes are the
    planner's count for the same ops (`runtime_eager_block_parts`: forward, backward twice).

    The rate is the slope between that size and one token: each op's fixed cost (dispatch,
    autograd bookkeeping) is the micro-batch's fixed cost (`fixed_seconds`, a one-token forward
    and backward), and would be counted twice if it stayed in the bandwidth too (it is a tenth
    of these ops' time at 512 tokens on a 2-core CPU)."""
    seconds = _elementwise_seconds(model, micro_batch, seq_len, precision, device, effort)
    nbytes = _elementwise_bytes(model, micro_batch, seq_len, precision, device)
    if micro_batch * seq_len > 1:
        fixed = _elementwise_seconds(model, 1, 1, precision, device, effort)
        extra = nbytes - _elementwise_bytes(model, 1, 1, precision, device)
        if seconds > fixed and extra > 0:
            return extra / (seconds - fixed)
    return nbytes / seconds


def _elementwise_bytes(
    model: ModelConfig, micro_batch: int, seq_len: int, precision: str, device: torch.device
) -> float:
    """The planner's bytes of one block's element-wise ops, forward and backward."""
    plan = Plan(model=model, seq_len=seq_len, micro_batch_size=micro_batch,
                global_batch_size=micro_batch, precision=cast(Precision, precision))  # fmt: skip
    activations, _ = runtime_eager_block_parts(plan, act.Kernels.for_runtime(model, 1, device.type))
    return 3 * activations


def _elementwise_seconds(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
    effort: Effort,
) -> float:
    """Seconds of one block's element-wise ops, forward and backward (see
    `elementwise_bandwidth_bytes_per_s`)."""
    dt = DTYPES[precision]
    b, s, d, f, hd = micro_batch, seq_len, model.dim, model.ffn_dim, model.head_dim
    rope = rope_tables(hd, s, model.rope_theta, device) if model.pos_emb == "rope" else None
    norms = [build_norm(model).to(device) for _ in range(2)]
    x = torch.randn(b, s, d, device=device, requires_grad=True)  # the fp32 residual stream

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dt, requires_grad=True)

    q, k = leaf(b, s, model.n_heads, hd), leaf(b, s, model.n_kv_heads, hd)
    attn_out, branch = leaf(b, model.n_heads, s, hd), leaf(b, s, d)
    up = [leaf(b, s, f) for _ in range(2 if model.gated else 1)]
    # Autocast over fp32 weights: each linear reading a norm's fp32 output casts it.
    casts = (3 + len(up)) if dt != torch.float32 else 0

    def run() -> None:
        outs = [norms[1](x)]
        h = norms[0](x)
        outs += [h.to(dt) for _ in range(casts)]
        if rope is not None:
            outs += [apply_rope(q, rope), apply_rope(k, rope)]
        h1 = x + attn_out.transpose(1, 2).reshape(b, s, -1)
        ff = ffn_activation(model.mlp, up[0], up[1] if model.gated else None)
        outs += [ff, h1 + branch]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return calibrate.time_call(run, device, effort.trials, effort.min_seconds)


def optimizer_seconds(model: ModelConfig, device: torch.device, effort: Effort) -> float:
    """Seconds of one optimizer step as the runtime takes it (train/optim.py's foreach AdamW,
    after the foreach gradient-norm clip) over the model's parameters, gradients in place."""
    net = build_model(model, device)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    opt = build_optimizer(net, OptimizerSection())
    params = list(net.parameters())

    def run() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return calibrate.time_call(run, device, effort.trials, effort.min_seconds)


def fixed_seconds(model: ModelConfig, device: torch.device, effort: Effort) -> float:
    """Seconds of a forward and backward of the whole model on one token: what a micro-batch
    costs beyond its FLOPs and bytes (op dispatch, autograd bookkeeping, allocator)."""
    net = build_model(model, device)
    tokens = torch.zeros((1, 1), dtype=torch.long, device=device)

    def run() -> None:
        net(tokens).float().sum().backward()

    return calibrate.time_call(run, device, effort.trials, effort.min_seconds)


def measure(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
    dtypes: tuple[str, ...] = (),
    effort: Effort = BENCH,
) -> dict[str, float]:
    """Every figure for `model` at `micro_batch` x `seq_len` in `precision` (GEMM rates also
    for `dtypes`): gemm_{dtype}_flops, attention_flops, bandwidth_bytes, fixed_s,
    optimizer_s."""
    tokens = micro_batch * seq_len
    figures = {
        f"gemm_{dt}_flops": gemm_flops_per_s(model, tokens, DTYPES[dt], device, effort)
        for dt in dict.fromkeys((precision, *dtypes))
    }
    figures["attention_flops"] = attention_flops_per_s(
        model, micro_batch, seq_len, DTYPES[precision], device, effort
    )
    figures["bandwidth_bytes"] = elementwise_bandwidth_bytes_per_s(
        model, micro_batch, seq_len, precision, device, effort
    )
    figures["fixed_s"] = fixed_seconds(model, device, effort)
    figures["optimizer_s"] = optimizer_seconds(model, device, effort)
    return figures


def cluster_from(figures: dict[str, float], precision: str, display: str) -> Cluster:
    """A one-device Cluster whose GPU is the measured device: dense rates per dtype measured,
    bandwidth measured, and the calibration the figures imply (the device's rates only: what
    the stack costs on it is `device_costs`)."""
    rates = {k[5:-6]: v for k, v in figures.items() if k.startswith("gemm_")}
    cluster = calibrate.measured_cluster(display, rates, figures["bandwidth_bytes"])
    gpu = cluster.gpu
    achieved = dataclasses.replace(
        gpu.calibration,
        attention_efficiency=Sourced(
            figures["attention_flops"] / figures[f"gemm_{precision}_flops"], SOURCE
        ),
    )
    return dataclasses.replace(cluster, gpu=dataclasses.replace(gpu, calibration=achieved))


# The calibration times a micro-batch's fixed cost and the optimizer step, not the rest of a
# step (zeroing, the loss's item, logging): priced as none, as the measured device always was.
STEP_OVERHEAD_NOT_MEASURED = (
    "not measured: on a device measured with the runtime, a micro-batch's fixed cost and the "
    "optimizer step are measured (microbatch_overhead_ms, optimizer_efficiency); the rest of a "
    "step's fixed cost is taken as none"
)


# A CPU rank sends and receives over gloo on the core it computes on: the ring's passes and the
# gradient all-reduce take the time of the compute they run beside (bench/cp.py measures it).
CPU_COMM_OVERLAP = Sourced(0.0, "a CPU rank copies its gloo traffic on its compute core")


def device_costs(
    figures: dict[str, float],
    model: ModelConfig,
    display: str,
    when: Measured | None = None,
    device_type: str = "cpu",
) -> DeviceCosts:
    """What the llmscale stack costs on the measured device `display` (of `device_type`, cpu or
    cuda), from its figures: the one-token forward and backward (a micro-batch's fixed cost)
    and the optimizer step's share of the measured element-wise bandwidth; each sourced to this
    calibration (and, `when` given, to when and under what load it was measured); on a CPU no
    communication hidden behind compute (`CPU_COMM_OVERLAP`)."""
    source = SOURCE if when is None else f"{SOURCE}, {when.describe()}"
    streamed = LLMSCALE.optimizer_bytes_per_param * model.num_params()
    optimizer_share = streamed / figures["bandwidth_bytes"] / figures["optimizer_s"]
    return DeviceCosts(
        device=display,
        step_overhead_ms=Sourced(0.0, STEP_OVERHEAD_NOT_MEASURED),
        microbatch_overhead_ms=Sourced(1000 * figures["fixed_s"], source),
        optimizer_efficiency=Sourced(min(1.0, optimizer_share), source),
        comm_overlap=CPU_COMM_OVERLAP if device_type == "cpu" else None,
    )


class MeasuredDevice(NamedTuple):
    """This machine measured for one shape: its rates (`cluster`), what the llmscale stack
    costs on it (`costs`), and the raw figures both come from."""

    cluster: Cluster
    costs: DeviceCosts
    figures: dict[str, float]


def display_name(device: torch.device) -> str:
    key = calibrate.machine_key(device)
    threads = f"{key['threads']} thread" + ("" if key["threads"] == "1" else "s")
    return f"{key['device_name']} ({threads}, measured)"


def measured_cluster(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    device: torch.device,
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
    precision: str = "fp32",
) -> MeasuredDevice:
    """`llmscale bench`'s device: measured now (BENCH effort) at the run's shape, `micro_batch`
    sequences of `seq_len` tokens (attention's cost per token grows with the sequence, so the
    shape, not only the token count); the attention efficiency is `precision`'s. Also the
    stack's costs on it and the raw figures."""
    figures = measure(model, micro_batch, seq_len, precision, device, dtypes, BENCH)
    display = display_name(device)
    return MeasuredDevice(
        cluster_from(figures, precision, display),
        device_costs(figures, model, display, device_type=device.type),
        figures,
    )


# ---- is a cached measurement still this machine's? -------------------------------------------

PROBE_GEMM = 160  # n of the probe's n x n fp32 GEMM
PROBE_NUMEL = 2**17  # elements of the probe's element-wise add
PROBE_REPEATS = 64  # GEMM + add per pass: about 10 ms on one core of a quiet 2-core EPYC
PROBE_PASSES = 5  # passes timed; the median
# A machine that now runs the probe more than this many times slower or faster than when the
# cached figures were measured is measured again: a step predicted from figures that far off
# is off by about as much (the demo's step time is ~90% compute and per-op dispatch, both
# scaling with the CPU share a rank gets).
PROBE_TOLERANCE = 1.25
# `$LLMSCALE_PROBE_TOLERANCE` replaces it for cached figures (a number >= 1; "inf": reuse the
# cache whatever the machine's speed, as the test suite does so that a run's stderr does not
# depend on other processes' load).
PROBE_TOLERANCE_ENV = "LLMSCALE_PROBE_TOLERANCE"


def probe_tolerance() -> float:
    """`PROBE_TOLERANCE`, or `$LLMSCALE_PROBE_TOLERANCE` when set (one line, exit 2 if bad)."""
    text = os.environ.get(PROBE_TOLERANCE_ENV)
    if text is None:
        return PROBE_TOLERANCE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 1:  # NaN too
        raise ConfigError(PROBE_TOLERANCE_ENV, text, "a number >= 1, or inf")
    return value


def probe_seconds(device: torch.device) -> float:
    """Seconds of a fixed small workload (GEMMs, element-wise adds and their dispatch), the
    median of `PROBE_PASSES` passes of about 10 ms each: how fast this process runs now, at
    whatever share of the cores the machine's other processes leave it. Timed alongside every
    measurement and again whenever cached figures are used (`python -m llmscale.bench.startup`);
    each pass is long enough to span the scheduler's time slices, so that it sees the share,
    and the median passes over a single burst of others' work."""
    a = torch.randn(PROBE_GEMM, PROBE_GEMM, device=device)
    b = torch.randn(PROBE_GEMM, PROBE_GEMM, device=device)
    x = torch.randn(PROBE_NUMEL, device=device)
    y = torch.randn(PROBE_NUMEL, device=device)
    out = torch.empty_like(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)

    def one_pass() -> float:
        start = time.perf_counter()
        for _ in range(PROBE_REPEATS):
            a @ b
            torch.add(x, y, out=out)
        sync(device)
        return time.perf_counter() - start

    one_pass()  # warm: allocations, kernels' first-call set-up
    passes = sorted(one_pass() for _ in range(PROBE_PASSES))
    return passes[len(passes) // 2]


def probe_change(then: float, now: float, what: str) -> str:
    """'' when the probe's time `now` is within `PROBE_TOLERANCE` of `then` (when `what` was
    measured); else the one line that says the machine's speed changed and `what` is measured
    again (also when `then` is unknown: a record without a probe cannot tell)."""
    if not (math.isfinite(then) and then > 0):
        return f"calibration: the cached {what} carry no probe time to compare: measuring again"
    ratio = now / then
    tolerance = probe_tolerance()
    if 1 / tolerance <= ratio <= tolerance:
        return ""
    pace = f"{ratio:.2f}x slower" if ratio > 1 else f"{1 / ratio:.2f}x faster"
    return (
        f"calibration: this machine runs a fixed probe {pace} than when its cached {what} were "
        f"measured ({1e3 * now:.1f} ms, then {1e3 * then:.1f} ms; beyond the tolerance, "
        f"{tolerance}x): measuring again"
    )


def say(line: str) -> None:
    """A calibration's one line to the user (stderr: stdout is the run's table)."""
    print(line, file=sys.stderr, flush=True)


# ---- the per-machine cache of a run's figures -------------------------------------------------


def cache_key(
    device: torch.device, model: ModelConfig, micro_batch: int, seq_len: int, precision: str
) -> dict[str, str]:
    """What a run's figures depend on: the machine, and the shape of the work."""
    shape = json.dumps(dataclasses.asdict(model), sort_keys=True)
    return {
        **calibrate.machine_key(device),
        "version": str(VERSION),
        "model": shape,
        "micro_batch": str(micro_batch),
        "seq_len": str(seq_len),
        "precision": precision,
    }


def read_figures(path: Path, key: dict[str, str]) -> tuple[dict[str, float] | None, str]:
    """The cached figures for `key`, or None and why the file cannot be used ("" when there is
    nothing to say: no file yet; see `calibrate.read_record`)."""
    data, problem = calibrate.read_record(path, key, "figures")
    if data is None:
        return None, problem
    figures: dict[str, float] = {}
    for name, value in data["figures"].items():
        try:
            figure = float(value)
        except (TypeError, ValueError):
            figure = math.nan
        if not (math.isfinite(figure) and figure > 0):
            return None, f"holds an invalid figure ({name} = {json.dumps(value)})"
        figures[str(name)] = figure
    if not figures:
        return None, "holds no figures"
    return figures, ""


def read_probe(path: Path) -> float:
    """The probe's seconds stored with a cache record; NaN when it has none."""
    try:
        return float(json.loads(path.read_text())["probe_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return math.nan


def contending_load(other_cores: float, threads: int, cores: int | None = None) -> float:
    """Of the cores other processes used on average while this process measured with `threads`
    threads (`other_cores`), those beyond the ones its threads left idle (`cores` - `threads`,
    the machine's cores by default): the load that contended with the measurement.

    A measurement on fewer threads than cores leaves cores idle, and other processes fill them
    without slowing it: on the 2-core machine a rank of the demo (one thread under torchrun)
    measured while other engineers' jobs used 1.20-1.34 cores, of which 0.26 CPU-s of 0.31 s was
    its own, the job's three waiting ranks 0.02-0.05 CPU-s, while its four ranks together
    measured 0.75 at the same time: counted in full, that load was over `calibrate.BUSY_CORES`
    in every demo run, and the figures were measured twice with a busy-machine warning."""
    idle = max(0, (calibrate.cpu_cores() if cores is None else cores) - threads)
    return max(0.0, other_cores - idle) if math.isfinite(other_cores) else other_cores


@dataclass(frozen=True)
class Measured:
    """When the cached figures were measured, and the load other processes put meanwhile on
    the cores the measurement used (`contending_load`, cores on average;
    `calibrate.BUSY_CORES` and above is a busy machine)."""

    measured_at: float  # unix time
    other_load_cores: float
    warning: str = ""  # a machine that stayed busy through a second measurement
    refreshed: str = ""  # why cached figures were measured again (`probe_change`)
    probe_s: float = math.nan  # the probe's time alongside the measurement

    def describe(self) -> str:
        """When and under what load, for a source: '2026-12-05 06:20 UTC, other processes'
        load 0.12 cores' (a part unknown: left out)."""
        parts = []
        if math.isfinite(self.measured_at):
            stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.measured_at))
            parts.append(stamp)
        if math.isfinite(self.other_load_cores):
            parts.append(f"other processes' load {self.other_load_cores:.2f} cores")
        return ", ".join(parts) or "when and under what load unknown"


def cached_figures(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
    folder: Path | None = None,
) -> tuple[dict[str, float], bool]:
    """This machine's figures for the shape: from the cache, or measured (QUICK) and cached.
    Also whether they were measured now."""
    figures, measured_now, _ = cached_record(model, micro_batch, seq_len, precision, device, folder)
    return figures, measured_now


def cached_record(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
    folder: Path | None = None,
) -> tuple[dict[str, float], bool, Measured]:
    """`cached_figures`, with when and under what load they were measured. Cached figures are
    used while the probe runs within `PROBE_TOLERANCE` of its time when they were measured;
    else they are measured again, and a line says so. A measurement taken while other
    processes used more than `calibrate.BUSY_CORES` is taken again, once; if the machine stays
    busy the quieter one is kept, with a warning."""
    key = cache_key(device, model, micro_batch, seq_len, precision)
    path = calibrate.cache_path(key, folder)
    found, problem = read_figures(path, key)
    refreshed = ""
    if found is not None:
        refreshed = probe_change(read_probe(path), probe_seconds(device), "figures")
        if not refreshed:
            return found, False, _read_measured(path)
        say(refreshed)

    def once() -> tuple[dict[str, float], Measured]:
        meter = calibrate.LoadMeter()
        figures = measure(model, micro_batch, seq_len, precision, device, effort=QUICK)
        probe = probe_seconds(device)
        load = contending_load(meter.other_load_cores(), torch.get_num_threads())
        return figures, Measured(time.time(), load, probe_s=probe)

    figures, when = once()
    if when.other_load_cores > calibrate.BUSY_CORES:
        figures, when = min((figures, when), once(), key=lambda fw: fw[1].other_load_cores)
        if when.other_load_cores > calibrate.BUSY_CORES:
            when = dataclasses.replace(
                when,
                warning=f"the calibration ran while other processes used "
                f"{when.other_load_cores:.2f} cores (twice measured): its rates carry that load",
            )
    payload: dict[str, Any] = {
        "version": VERSION,
        "key": key,
        "source": SOURCE,
        "figures": figures,
        "measured_at": when.measured_at,
        "other_load_cores": when.other_load_cores,
        "probe_s": when.probe_s,
    }
    unwritten = calibrate.write_json(path, payload)
    calibrate.notice_cache_problems(path, problem, unwritten)
    return figures, True, dataclasses.replace(when, refreshed=refreshed)


def _read_measured(path: Path) -> Measured:
    """The record's time and load; a file written before they were kept: its mtime, load NaN."""
    try:
        data = json.loads(path.read_text())
        return Measured(
            float(data["measured_at"]),
            float(data["other_load_cores"]),
            probe_s=float(data.get("probe_s", math.nan)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return Measured(path.stat().st_mtime, math.nan)
        except OSError:
            return Measured(math.nan, math.nan)


def cached_cluster(plan: Plan, device: torch.device) -> tuple[MeasuredDevice, Measured]:
    """The measured device for a run of `plan` (one tensor-parallel rank's micro-batch), the
    stack's costs on it, its figures, and when they were measured."""
    figures, _, when = cached_record(
        plan.model, plan.micro_batch_size, plan.seq_len, plan.precision, device
    )
    display = display_name(device)
    cluster = cluster_from(figures, plan.precision, display)
    costs = device_costs(figures, plan.model, display, when, device.type)
    return MeasuredDevice(cluster, costs, figures), when


# ---- context parallelism: the runtime's ring blocks -------------------------------------------


def ring_attention_flops_per_s(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    cp: int,
    device: torch.device,
    effort: Effort,
    group: Any,
) -> float:
    """FLOP/s of the runtime's ring attention blocks (parallel/context_parallel.py's
    `ring_attention`, forward + backward) at the chunk size of `cp` ranks (c = seq_len / 2cp),
    counted as plan/time.py counts them (`ring_block_flops`, `RING_FWD_MATMULS` +
    `RING_BWD_MATMULS` matmuls per block). Run over `group`, a group of this rank alone: the
    rank's s / cp tokens as one ring step of `ring_blocks(1)` = 3 blocks (the two causal
    diagonals and one full), without passes, so that what is timed is the blocks' own matmuls,
    element-wise passes over the scores and eager ops; the passes are the link's
    (`instrument.calibrate.measured_link`)."""
    local = seq_len // cp
    hd = model.head_dim

    def leaf(heads: int) -> torch.Tensor:
        return torch.randn(micro_batch, heads, local, hd, device=device, requires_grad=True)

    q, k, v = leaf(model.n_heads), leaf(model.n_kv_heads), leaf(model.n_kv_heads)
    g = torch.randn(micro_batch, model.n_heads, local, hd, device=device)

    def run() -> None:
        torch.autograd.backward(ring_attention(q, k, v, group), g)

    seconds = calibrate.time_call(run, device, effort.trials, effort.min_seconds)
    plan = Plan(model=model, seq_len=seq_len, micro_batch_size=micro_batch,
                global_batch_size=micro_batch, cp=cp)  # fmt: skip
    flops = ring_blocks(1) * (RING_FWD_MATMULS + RING_BWD_MATMULS) * ring_block_flops(plan)
    return flops / seconds


def with_ring_attention(cluster: Cluster, ring_flops: float) -> Cluster:
    """`cluster` whose calibration has the ring blocks' measured rate, as a share of its fp32
    rate (`Calibration.ring_attention_efficiency`)."""
    gpu = cluster.gpu
    eff = Sourced(ring_flops / gpu.peak_flops("fp32"), SOURCE)
    calibration = dataclasses.replace(gpu.calibration, ring_attention_efficiency=eff)
    return dataclasses.replace(cluster, gpu=dataclasses.replace(gpu, calibration=calibration))
