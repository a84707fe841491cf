"""Timing and caching for the micro-benchmarks that stand a machine in for a catalog GPU.

`time_call` times a callable robustly (the fastest of a few runs; CUDA synchronised);
`machine_key` names what measured figures depend on (host, CPU model or GPU name, torch version,
threads); `measured_cluster` makes a catalog-shaped one-device Cluster from measured rates; and
the cache (`cache_dir`: `$LLMSCALE_CACHE_DIR`, else `$XDG_CACHE_HOME/llmscale`, else
`~/.cache/llmscale`) keeps figures in files named by a digest of their key, written atomically (a
temporary file, then a rename) so that concurrent ranks or runs never read half a file. A cache
that cannot be read or written never fails a command: the figures are measured again, and one
notice line (`notice_cache_problems`) names the path and why, once per process. What is
measured, for which model, is train/calibration.py's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from llmscale.hardware.catalog import GPU, Link
from llmscale.hardware.spec import Sourced
from llmscale.paths import cache_dir, cache_notice, cache_write_problem, os_reason
from llmscale.plan.cluster import Cluster

SOURCE = "measured by llmscale micro-benchmarks on this machine"


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    trials: int = 3,
    min_seconds: float = 0.02,
    max_seconds: float | None = None,
) -> float:
    """Seconds per call: the fastest of `trials` timed runs of at least `min_seconds` each
    (robust to a busy machine); no further run starts once `max_seconds` have passed."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    begin = time.perf_counter()
    fn()
    sync(device)
    best = math.inf
    for _ in range(trials):
        spent = time.perf_counter() - begin
        if max_seconds is not None and best < math.inf and spent >= max_seconds:
            break
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / n)
    return best


def bandwidth_bytes_per_s(
    numel: int, device: torch.device, trials: int = 3, min_seconds: float = 0.02
) -> float:
    """Bytes/s of out = a + b over fp32 tensors of `numel` elements (2 reads and a write)."""
    a = torch.randn(numel, device=device)
    b = torch.randn(numel, device=device)
    out = torch.empty_like(a)
    seconds = time_call(lambda: torch.add(a, b, out=out), device, trials, min_seconds)
    return 3 * 4 * numel / seconds


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_key(device: torch.device) -> dict[str, str]:
    """What the figures depend on; the cache file is named by it."""
    return {
        "host": socket.gethostname(),
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
    }


def measured_gpu(display: str, gemm_flops: Mapping[str, float], bandwidth_bytes: float) -> GPU:
    """A catalog-shaped GPU whose dense peak per dtype and HBM bandwidth were measured."""
    template = Cluster.of("h100").gpu
    return GPU(
        name="measured",
        display=display,
        vendor="measured",
        device_names=(),
        scale_up=template.scale_up,
        host_link=template.host_link,
        memory_GiB=Sourced(1e6, "not modelled: the micro-benchmarks only time"),
        hbm_TBps=Sourced(bandwidth_bytes / 1e12, SOURCE),
        dense_TFLOPS={dt: Sourced(r / 1e12, SOURCE) for dt, r in gemm_flops.items()},
    )


def measured_cluster(
    display: str, gemm_flops: Mapping[str, float], bandwidth_bytes: float
) -> Cluster:
    """`measured_gpu` in the h100's node shape (links unused by a one-device plan)."""
    template = Cluster.of("h100")
    return dataclasses.replace(template, gpu=measured_gpu(display, gemm_flops, bandwidth_bytes))


# ---- the machine's load while measuring -------------------------------------------------------

# A calibration taken while other processes used more than this many cores on average is taken
# again (train/calibration.py, train/shared_cores.py): on a 2-core machine a quarter of a core
# is a tenth of it, enough to move the fastest-of-trials figures by that much.
BUSY_CORES = 0.25


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _busy_seconds() -> float | None:
    """Seconds every CPU of the machine spent busy since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


class LoadMeter:
    """Wall time, the machine's busy CPU time and this process's CPU time since it started:
    the others' load is (busy - ours) / wall, in cores (ours: the sum over a job's ranks)."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.busy = _busy_seconds()
        self.own = time.process_time()

    def stop(self) -> tuple[float, float, float]:
        """(wall s, machine busy s, this process's CPU s); busy is 0 where unknown."""
        busy = _busy_seconds()
        spent = busy - self.busy if busy is not None and self.busy is not None else 0.0
        return time.perf_counter() - self.wall, spent, time.process_time() - self.own

    def other_load_cores(self) -> float:
        """Cores other processes used on average since the start (this one process alone)."""
        return other_load_cores(*self.stop())


MIN_LOAD_WINDOW_S = 0.2  # the kernel counts CPU time in ticks of 10 ms: shorter says little


def other_load_cores(wall: float, busy: float, own: float) -> float:
    """Cores the machine's other processes used on average over `wall` seconds in which it was
    busy `busy` CPU-seconds, `own` of them ours; NaN (unknown) over too short a window."""
    if wall < MIN_LOAD_WINDOW_S:
        return math.nan
    return max(0.0, (busy - own) / wall)


# ---- the per-machine cache ------------------------------------------------------------------


def cache_path(key: Mapping[str, str], folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:16]
    return (folder or cache_dir()) / f"calibration-{digest}.json"


def write_json(path: Path, data: Mapping[str, Any]) -> str | None:
    """Atomically (temporary file, then rename); a cache that cannot be written is skipped.
    None when written, else why not (`paths.cache_write_problem`: names the folder)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(dict(data), f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return cache_write_problem(path.parent, e)
    return None


def read_record(
    path: Path, key: Mapping[str, str], field: str
) -> tuple[dict[str, Any] | None, str]:
    """The cache record at `path` written for `key`, whose `field` is a table; else None and
    why it cannot be used, in words that follow the path ("is unreadable (...)"), or "" when
    there is nothing to say (no file yet; a folder that is a file, which writing says)."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None, ""
    except OSError as e:
        return None, f"is unreadable ({os_reason(e)})"
    except UnicodeDecodeError as e:
        return (
            None,
            f"is unreadable (not UTF-8 text: byte {e.object[e.start]:#04x} at offset {e.start})",
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"is unreadable (invalid JSON at line {e.lineno}, column {e.colno})"
    except RecursionError:
        return None, "is unreadable (JSON nested too deeply)"
    if not isinstance(data, dict) or not isinstance(data.get(field), dict) or "key" not in data:
        return None, f"is unreadable (not a cache record: no {field!r} table)"
    if data["key"] != dict(key):
        return None, "is not the record its name stands for (another key: damaged or edited)"
    return data, ""


def notice_cache_problems(path: Path, unusable: str, unwritten: str | None) -> None:
    """The notices of a measurement taken because the record at `path` could not be used
    (`unusable`, from `read_record`; "" when there was simply none) or kept (`unwritten`, from
    `write_json`): each once per process."""
    if unusable:
        done = "re-measured" + ("" if unwritten else " and rewritten")
        cache_notice(f"calibration cache {path} {unusable}; {done}")
    if unwritten:
        cache_notice(f"calibration cache {unwritten}; re-measuring each run")


# ---- the link between two ranks (context parallelism's ring passes) ---------------------------

P2P_SIZES = (4 * 2**10, 4 * 2**20)  # bytes: latency-bound, bandwidth-bound


def p2p_exchange_seconds(group: Any, nbytes: int, trials: int = 5, iters: int = 20) -> float:
    """Seconds of one pass as the ring attention runs it (parallel/context_parallel.py): every
    rank of `group` sends `nbytes` to the next and receives as many from the previous
    (`batch_isend_irecv`), then waits for both. The fastest of `trials` means over `iters`
    passes; every rank runs the same passes (a fixed count, not a time: they pair up)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    send = torch.zeros(nbytes // 4)
    recv = torch.empty_like(send)

    def one() -> None:
        ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    one()
    best = math.inf
    for _ in range(trials):
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(iters):
            one()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def measured_link(group: Any, sizes: tuple[int, int] = P2P_SIZES) -> dict[str, float]:
    """The alpha-beta link between the ranks of `group` from two pass sizes: bandwidth from the
    difference of their times, latency what remains of the small one. Figures p2p_latency_s,
    p2p_bytes_per_s (each direction, both directions at once as the ring passes)."""
    small, large = sizes
    t_small = p2p_exchange_seconds(group, small)
    t_large = p2p_exchange_seconds(group, large)
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    return {
        "p2p_latency_s": max(t_small - small / bandwidth, 1e-7),
        "p2p_bytes_per_s": bandwidth,
    }


def with_link(cluster: Cluster, figures: Mapping[str, float], display: str) -> Cluster:
    """`cluster` with the link measured by `measured_link` in place of its node's links (the
    ranks of this machine talk over it, inside the node and, were there another, across)."""
    link = Link(
        name="measured",
        display=display,
        kind="scale-up",
        bandwidth_GBps=Sourced(figures["p2p_bytes_per_s"] / 1e9, SOURCE),
        latency_us=Sourced(1e6 * figures["p2p_latency_s"], SOURCE),
    )
    fabric = dataclasses.replace(cluster.fabric, intra=link, inter=link)
    return dataclasses.replace(cluster, fabric=fabric)
