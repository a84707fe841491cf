"""This machine as the planner's hardware: GEMM FLOP/s and memory bandwidth, micro-benchmarked.

The planner's time model needs a device: a dense matmul rate per dtype and a memory bandwidth.
A catalog GPU has them from its data sheet; a CPU (or a GPU missing from the catalog) is measured
here, by micro-benchmarks that are not the training step: square GEMMs of a few sizes (forward
and the two backward products; `GEMM_SIZES`), and an element-wise add over tensors larger than
the caches. Each figure is the fastest of a few timed runs, within about `MAX_SECONDS`.

`cached_calibration(device, dtype)` measures once per machine and keeps the figures in
`cache_dir()` (`$LLMSCALE_CACHE_DIR`, else `$XDG_CACHE_HOME/llmscale`, else
`~/.cache/llmscale`), in a file named by what they depend on: host name, CPU model (or GPU name),
torch version and threads. A later call reads the file; a missing dtype is measured and added; a
file that cannot be read (corrupt, another version) is measured again and replaced. Writes are
atomic (a temporary file, then a rename), so concurrent ranks or runs never read half a file.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmscale.hardware.catalog import GPU
from llmscale.hardware.spec import Sourced
from llmscale.plan.cluster import Cluster
from llmscale.tensors import DTYPES

SOURCE = "measured by llmscale micro-benchmarks on this machine"
VERSION = 1
# Square GEMM sizes measured per device type (n x n by n x n); a model's rate is interpolated
# between them.
GEMM_SIZES = {"cpu": (64, 256, 768), "cuda": (512, 2048, 8192)}
MAX_SECONDS = 0.3  # per figure: fewer timed runs where one call is slow (fp16 GEMMs on a CPU)
BANDWIDTH_NUMEL = 1 << 22  # fp32 elements per operand: 16 MiB, past the caches


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


def square_gemm_flops_per_s(n: int, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of x @ w and both backward products (g @ w.T, x.T @ g) for n x n operands."""
    x, w, g = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(3))

    def run() -> None:
        x @ w
        g @ w.T
        x.T @ g

    return 3 * 2 * n**3 / time_call(run, device, max_seconds=MAX_SECONDS)


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


@dataclass(frozen=True)
class Calibration:
    """Measured rates of one machine: GEMM FLOP/s per dtype and size, and memory bandwidth."""

    key: dict[str, str]
    bandwidth_bytes: float
    gemm_flops: dict[str, dict[int, float]] = field(default_factory=dict)  # dtype -> n -> FLOP/s
    seconds: float = field(default=0.0, compare=False)  # spent measuring (0: read from cache)

    @property
    def display(self) -> str:
        k = self.key
        threads = f"{k['threads']} thread" + ("" if k["threads"] == "1" else "s")
        return f"{k['device_name']} ({threads}, measured)"

    def gemm_rate(self, dtype: str, n: float) -> float:
        """FLOP/s of GEMMs of size about `n`: log-linear between the measured sizes."""
        table = sorted(self.gemm_flops[dtype].items())
        if n <= table[0][0]:
            return table[0][1]
        for (n0, r0), (n1, r1) in zip(table, table[1:], strict=False):
            if n <= n1:
                t = math.log(n / n0) / math.log(n1 / n0)
                return r0 + t * (r1 - r0)
        return table[-1][1]

    def cluster(self, gemm_size: float, dtypes: tuple[str, ...] | None = None) -> Cluster:
        """A one-device Cluster whose GPU is this machine at GEMMs of size about `gemm_size`.

        Links and node shape are the h100 node's: they stand in, not measured (a one-device
        plan uses none of them).
        """
        rates = {dt: self.gemm_rate(dt, gemm_size) for dt in dtypes or tuple(self.gemm_flops)}
        return measured_cluster(self.display, rates, self.bandwidth_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "key": self.key,
            "source": SOURCE,
            "bandwidth_bytes_per_s": self.bandwidth_bytes,
            "gemm_flops_per_s": {
                dt: {str(n): r for n, r in sizes.items()} for dt, sizes in self.gemm_flops.items()
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        """Raises (KeyError, TypeError, ValueError) on anything but a well-formed file."""
        if data["version"] != VERSION:
            raise ValueError(f"calibration version {data['version']!r}")
        gemm = {
            str(dt): {int(n): _positive(r) for n, r in sizes.items()}
            for dt, sizes in data["gemm_flops_per_s"].items()
        }
        key = {str(k): str(v) for k, v in data["key"].items()}
        if any(set(sizes) != set(GEMM_SIZES[key["device"]]) for sizes in gemm.values()):
            raise ValueError("calibration GEMM sizes differ")
        return cls(key, _positive(data["bandwidth_bytes_per_s"]), gemm)


def _positive(x: Any) -> float:
    v = float(x)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"not a positive rate: {x!r}")
    return v


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


# ---- the per-machine cache ------------------------------------------------------------------


def cache_dir() -> Path:
    explicit = os.environ.get("LLMSCALE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmscale"


def cache_path(key: Mapping[str, str], folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:16]
    return (folder or cache_dir()) / f"calibration-{digest}.json"


def measure(
    device: torch.device, dtypes: tuple[str, ...], base: Calibration | None = None
) -> Calibration:
    """Measure the GEMM rates of `dtypes` (and the bandwidth, unless `base` has it)."""
    start = time.perf_counter()
    gemm = dict(base.gemm_flops) if base is not None else {}
    for dt in dtypes:
        sizes = GEMM_SIZES[device.type]
        gemm[dt] = {n: square_gemm_flops_per_s(n, DTYPES[dt], device) for n in sizes}
    bandwidth = (
        base.bandwidth_bytes if base is not None else bandwidth_bytes_per_s(BANDWIDTH_NUMEL, device)
    )
    return Calibration(machine_key(device), bandwidth, gemm, time.perf_counter() - start)


def read_cache(path: Path, key: Mapping[str, str]) -> Calibration | None:
    """The cached calibration for `key`, or None (no file, or one that cannot be used)."""
    try:
        found = Calibration.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable: re-measure
        return None
    return found if found.key == dict(key) else None


def write_cache(path: Path, calibration: Calibration) -> None:
    """Atomically (temporary file, then rename); a cache that cannot be written is skipped."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(calibration.to_json(), f, indent=1)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def cached_calibration(
    device: torch.device, dtypes: tuple[str, ...], folder: Path | None = None
) -> Calibration:
    """This machine's calibration with `dtypes` measured: from the cache, measured if missing."""
    key = machine_key(device)
    path = cache_path(key, folder)
    found = read_cache(path, key)
    missing = tuple(dt for dt in dtypes if found is None or dt not in found.gemm_flops)
    if found is not None and not missing:
        return found
    calibration = measure(device, missing, base=found)
    write_cache(path, calibration)
    return calibration
