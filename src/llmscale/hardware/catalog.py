"""The hardware catalog: accelerators, links, node shapes, topologies, switches and optics.

Numbers live in `hardware/data/*.toml`, each with its source (see `hardware/spec.py`); this
module turns them into frozen dataclasses in SI units and looks them up by name. Unknown names
raise ConfigError listing the known ones.
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, cast

from llmscale.errors import ConfigError
from llmscale.hardware.spec import Entry, Sourced, entries, read_sources

_T = TypeVar("_T")
DATA_DIR = Path(__file__).parent / "data"
GiB = 2**30
LINK_KINDS = ("scale-up", "scale-out", "host", "optical-io")
TOPOLOGY_KINDS = ("fat-tree", "rail-only", "single-switch", "scale-up-domain")
_TOP_LEVEL = ("sources", "gpu", "link", "node", "topology", "switch", "optic")


CALIBRATION_FIELDS = (
    "gemm_efficiency",
    "gemm_half_dim",
    "attention_efficiency",
    "hbm_efficiency",
)
# Software costs (per-step and per-micro-batch overheads, the optimizer's efficiency, values
# fitted on a published run) are not a GPU's: they belong to the stack that ran
# (`llmscale.stack.Stack.step_overhead_ms`, `Stack.microbatch_overhead_ms`,
# `Stack.optimizer_efficiency`, `Stack.fitted`; a device measured with the runtime:
# `llmscale.stack.DeviceCosts`).
# Required of a GPU with a dense FP8 peak (and only allowed then); likewise FP4.
FP8_CALIBRATION_FIELD = "fp8_gemm_efficiency"
FP4_CALIBRATION_FIELD = "fp4_gemm_efficiency"
# The low-precision peaks and the calibration field each requires.
LOWP_CALIBRATION_FIELDS = {"fp8": FP8_CALIBRATION_FIELD, "fp4": FP4_CALIBRATION_FIELD}


@dataclass(frozen=True)
class Calibration:
    """What one GPU achieves, as opposed to its datasheet peaks (plan/time.py uses each): rates
    of the bare GPU (its GEMM, attention kernel family and HBM), never a value fitted on a
    published training run (those are the stack's: `llmscale.stack.Fit`).

    - gemm_efficiency: achieved / dense peak of a large GEMM (cuBLAS, the model's dtype);
    - gemm_half_dim: the GEMM size (geometric mean of M, N, K) at which half of that is reached:
      a GEMM of size d runs at gemm_efficiency * d / (d + gemm_half_dim) (wave quantisation,
      tile under-fill and launch cost, lumped in one saturating curve);
    - attention_efficiency: a flash-attention kernel's achieved / dense peak over the FLOPs it
      executes (causal masking skips half the tiles; backward recomputes QK^T);
    - hbm_efficiency: achieved / datasheet HBM bandwidth of streaming kernels (norms,
      activations, casts, softmax/cross-entropy, the optimizer);
    - fp8_gemm_efficiency: achieved / dense FP8 peak of a large FP8 GEMM (scaled e4m3 inputs,
      bf16 output), on the same size curve; None for a GPU without FP8 tensor cores;
    - fp4_gemm_efficiency: achieved / dense FP4 peak of a large block-scaled FP4 GEMM (NVFP4:
      E2M1 inputs with an E4M3 scale per 16 elements, bf16 output), on the same size curve;
      None for a GPU without FP4 tensor cores;
    - ring_attention_efficiency: achieved / fp32 dense peak of the llmscale runtime's ring
      attention blocks (parallel/context_parallel.py: fp32 matmuls, materialised scores, one
      eager op at a time) over the FLOPs they execute; None: not measured, and context
      parallelism is priced as flash-attention blocks (torch's `context_parallel`).

    What a training stack costs on the GPU (fixed costs per step and per micro-batch, its
    optimizer's share of the bandwidth) is the stack's (`llmscale.stack.Stack`), also on a device
    measured with the llmscale runtime (`llmscale.stack.DeviceCosts`).
    """

    gemm_efficiency: Sourced
    gemm_half_dim: Sourced
    attention_efficiency: Sourced
    hbm_efficiency: Sourced
    fp8_gemm_efficiency: Sourced | None = None
    fp4_gemm_efficiency: Sourced | None = None
    ring_attention_efficiency: Sourced | None = None

    def gemm_efficiency_at(self, m: float, n: float, k: float) -> float:
        """Achieved / peak for an (m x k) @ (k x n) GEMM."""
        if min(m, n, k) <= 0:
            return self.gemm_efficiency.value
        d: float = math.cbrt(float(m) * float(n) * float(k))
        return self.gemm_efficiency.value * d / (d + self.gemm_half_dim.value)

    def lowp_gemm_efficiency(self, dtype: str) -> Sourced | None:
        """The calibrated share of the FP8 or FP4 (`dtype`) dense peak; None without one."""
        share: Sourced | None = getattr(self, LOWP_CALIBRATION_FIELDS[dtype])
        return share

    def lowp_gemm_efficiency_at(self, dtype: str, m: float, n: float, k: float) -> float:
        """Achieved / FP8 or FP4 (`dtype`) peak for a low-precision (m x k) @ (k x n) GEMM (the
        bf16 curve, rescaled)."""
        share = self.lowp_gemm_efficiency(dtype)
        if share is None:
            raise ConfigError(
                f"calibration.{LOWP_CALIBRATION_FIELDS[dtype]}", None,
                f"a value ({dtype.upper()} GPUs)",
            )  # fmt: skip
        return share.value / self.gemm_efficiency.value * self.gemm_efficiency_at(m, n, k)

    def fp8_gemm_efficiency_at(self, m: float, n: float, k: float) -> float:
        """Achieved / FP8 peak for an FP8 (m x k) @ (k x n) GEMM (the bf16 curve, rescaled)."""
        return self.lowp_gemm_efficiency_at("fp8", m, n, k)


_PEAK = "a measured rate: the peaks themselves are what this device achieved"
MEASURED = Calibration(
    gemm_efficiency=Sourced(1.0, _PEAK),
    gemm_half_dim=Sourced(0.0, _PEAK),
    attention_efficiency=Sourced(1.0, _PEAK),
    hbm_efficiency=Sourced(1.0, _PEAK),
)


@dataclass(frozen=True)
class GPU:
    """One accelerator: HBM capacity and bandwidth, dense peak FLOP/s per dtype, and what it
    achieves (`calibration`)."""

    name: str
    display: str
    vendor: str
    device_names: tuple[str, ...]
    scale_up: str  # link name of its NVLink / Infinity Fabric
    host_link: str  # link name to the host (offload traffic)
    memory_GiB: Sourced
    hbm_TBps: Sourced
    dense_TFLOPS: Mapping[str, Sourced]
    calibration: Calibration = MEASURED

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_GiB.value * GiB)

    @property
    def hbm_bandwidth(self) -> float:
        """Bytes per second."""
        return self.hbm_TBps.value * 1e12

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(self.dense_TFLOPS)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` (fp32 | tf32 | bf16 | fp16 | fp8 | fp4 where
        supported)."""
        if dtype not in self.dense_TFLOPS:
            raise ConfigError("dtype", dtype, f"one of {self.name}'s: " + " | ".join(self.dtypes))
        return self.dense_TFLOPS[dtype].value * 1e12

    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte of HBM traffic at which compute and memory take equal time."""
        return self.peak_flops(dtype) / self.hbm_bandwidth


@dataclass(frozen=True)
class Link:
    """A link in the alpha-beta model: per-direction bandwidth and per-step latency."""

    name: str
    display: str
    kind: str  # scale-up | scale-out | host
    bandwidth_GBps: Sourced
    latency_us: Sourced
    pair_GBps: Sourced | None = None
    # Physical links (or optical channels) that make up bandwidth_GBps, where published.
    links_per_gpu: Sourced | None = None
    # Energy per bit moved, where published (optical I/O).
    energy_pJ_per_bit: Sourced | None = None
    # What NCCL's collectives achieve on this link each direction per GPU, where published
    # (NCCL's own topology model: its per-link rate times the links); None: the datasheet's.
    achieved_GBps: Sourced | None = None

    @property
    def bandwidth(self) -> float:
        """Bytes per second, each direction, per GPU (or per NIC port): the datasheet's."""
        return self.bandwidth_GBps.value * 1e9

    @property
    def bus_bandwidth(self) -> float:
        """Bytes per second each direction per GPU that collectives achieve (`achieved_GBps`,
        else the datasheet's `bandwidth`): what plan/collectives.py costs them at."""
        sourced = self.achieved_GBps or self.bandwidth_GBps
        return sourced.value * 1e9

    @property
    def latency(self) -> float:
        """Seconds (alpha)."""
        return self.latency_us.value * 1e-6

    @property
    def pair_bandwidth(self) -> float:
        """Bytes per second from one GPU to one other GPU (a mesh splits the aggregate)."""
        return (self.pair_GBps.value if self.pair_GBps else self.bandwidth_GBps.value) * 1e9

    @property
    def per_link_bandwidth(self) -> float | None:
        """Bytes per second each direction of one physical link (None when not published)."""
        if self.links_per_gpu is None or self.links_per_gpu.value <= 0:
            return None
        return self.bandwidth / self.links_per_gpu.value


@dataclass(frozen=True)
class Node:
    """A node shape: GPUs in one scale-up domain, and its NIC ports on the compute network."""

    name: str
    display: str
    gpu: str
    scale_up: str
    nic: str
    gpus: Sourced
    nics: Sourced
    host_memory_GiB: Sourced

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_GiB.value * GiB)

    @property
    def gpus_per_node(self) -> int:
        return int(self.gpus.value)

    @property
    def nics_per_node(self) -> int:
        return int(self.nics.value)


@dataclass(frozen=True)
class Topology:
    name: str
    display: str
    kind: str
    oversubscription: Sourced


@dataclass(frozen=True)
class Switch:
    name: str
    display: str
    link: str
    ports: Sourced
    price_usd: Sourced
    co_packaged_optics: bool
    # Co-packaged optics: optical bandwidth per unit of chip edge, relative to pluggables.
    bandwidth_density_vs_pluggable: Sourced | None = None

    @property
    def radix(self) -> int:
        return int(self.ports.value)


@dataclass(frozen=True)
class Optic:
    """A pluggable transceiver (one per cable end that is not co-packaged) and its cable."""

    name: str  # the link it serves
    display: str
    price_usd: Sourced
    cable_usd: Sourced
    energy_pJ_per_bit: Sourced | None = None


@dataclass(frozen=True)
class Catalog:
    gpus: Mapping[str, GPU]
    links: Mapping[str, Link]
    nodes: Mapping[str, Node]
    topologies: Mapping[str, Topology]
    switches: Mapping[str, Switch]
    optics: Mapping[str, Optic]
    files: tuple[str, ...] = field(default=())

    def gpu(self, name: str) -> GPU:
        return _lookup("gpu", self.gpus, name)

    def link(self, name: str) -> Link:
        return _lookup("link", self.links, name)

    def node(self, name: str) -> Node:
        return _lookup("node", self.nodes, name)

    def topology(self, name: str) -> Topology:
        return _lookup("topology", self.topologies, name)

    def switch(self, name: str) -> Switch:
        return _lookup("switch", self.switches, name)

    def optic(self, name: str) -> Optic:
        return _lookup("optic", self.optics, name)

    def node_for_gpu(self, gpu: str) -> Node:
        """The first node shape built from `gpu` (the catalog lists one per GPU)."""
        self.gpu(gpu)
        for node in self.nodes.values():
            if node.gpu == gpu:
                return node
        raise ConfigError(
            "gpu",
            gpu,
            "a GPU with a node shape: " + ", ".join(sorted({n.gpu for n in self.nodes.values()})),
        )

    def switch_for_link(self, link: str) -> Switch:
        for sw in self.switches.values():
            if sw.link == link:
                return sw
        raise ConfigError(
            "nic",
            link,
            "a link with a switch: " + ", ".join(sorted(s.link for s in self.switches.values())),
        )

    def gpu_for_device_name(self, device_name: str) -> GPU | None:
        want = _normalise(device_name)
        for gpu in self.gpus.values():
            if any(_normalise(n) == want for n in gpu.device_names):
                return gpu
        return None


def _normalise(name: str) -> str:
    return " ".join(name.lower().split())


def _lookup(kind: str, table: Mapping[str, _T], name: str) -> _T:
    try:
        return table[name]
    except KeyError:
        raise ConfigError(kind, name, " | ".join(table)) from None


# ---- loading ------------------------------------------------------------------------------


def _calibration(e: Entry, table_key: str) -> Calibration:
    """A GPU's `calibration` table: every field of `Calibration`, each sourced."""
    table = e.numbers(table_key)
    peaks = e.table.get("dense_TFLOPS") or {}
    lowp = tuple(f for dtype, f in LOWP_CALIBRATION_FIELDS.items() if dtype in peaks)
    required = CALIBRATION_FIELDS + lowp
    for key in table:
        if key not in required:
            raise ConfigError(f"{e.where}.calibration.{key}", key, " | ".join(required))
    for key in required:
        if key not in table:
            dtype = next((d for d, f in LOWP_CALIBRATION_FIELDS.items() if f == key), None)
            why = f"a value (a GPU with an {dtype.upper()} peak has one)" if dtype else ""
            raise ConfigError(
                f"{e.where}.calibration.{key}", None, why or "a value (every GPU has one)"
            )
    shares: tuple[str, ...] = ("gemm_efficiency", "attention_efficiency", "hbm_efficiency")
    shares += tuple(LOWP_CALIBRATION_FIELDS.values())
    for key in shares:
        if key in table and not 0 < table[key].value <= 1:
            raise ConfigError(f"{e.where}.calibration.{key}", table[key].value, "in (0, 1]")
    return Calibration(**{k: table[k] for k in required})


# How each field type of the catalog's dataclasses is read from its TOML entry (the
# annotations are strings: `from __future__ import annotations`).
_FIELD_READERS: dict[str, Callable[[Entry, str], object]] = {
    "str": Entry.text,
    "tuple[str, ...]": Entry.texts,
    "bool": Entry.flag,
    "Sourced": Entry.number,
    "Sourced | None": Entry.optional_number,
    "Mapping[str, Sourced]": Entry.numbers,
    "Calibration": _calibration,
}


def _reader(
    cls: type[_T], what: str, check: Callable[[_T, Entry], None] | None = None
) -> Callable[[str, Entry], _T]:
    """Read entry `name` into a `cls`: every field but `name`, by its type; then `check` it;
    then refuse any other key."""
    keys = [f for f in fields(cast(Any, cls)) if f.name != "name"]
    allowed = f"{what} field: " + ", ".join(f.name for f in keys)
    make: Callable[..., _T] = cls

    def read(name: str, e: Entry) -> _T:
        obj = make(name=name, **{f.name: _FIELD_READERS[str(f.type)](e, f.name) for f in keys})
        if check is not None:
            check(obj, e)
        e.done(allowed)
        return obj

    return read


def _fail(e: Entry, key: str, value: object, expected: str) -> None:
    raise ConfigError(f"{e.where}.{key}", value, expected)


def _check_link(link: Link, e: Entry) -> None:
    if link.kind not in LINK_KINDS:
        _fail(e, "kind", link.kind, " | ".join(LINK_KINDS))
    if link.bandwidth_GBps.value <= 0:
        _fail(e, "bandwidth_GBps", link.bandwidth_GBps.value, "> 0")


def _check_node(node: Node, e: Entry) -> None:
    if node.gpus.value < 1 or node.gpus.value != int(node.gpus.value):
        _fail(e, "gpus", node.gpus.value, "a whole number >= 1")


def _check_topology(t: Topology, e: Entry) -> None:
    if t.kind not in TOPOLOGY_KINDS:
        _fail(e, "kind", t.kind, " | ".join(TOPOLOGY_KINDS))


_READERS: dict[str, Any] = {
    "gpu": _reader(GPU, "a GPU"),
    "link": _reader(Link, "a link", _check_link),
    "node": _reader(Node, "a node", _check_node),
    "topology": _reader(Topology, "a topology", _check_topology),
    "switch": _reader(Switch, "a switch"),
    "optic": _reader(Optic, "an optic"),
}


def load_catalog(folder: str | Path | None = None) -> Catalog:
    """Read every `*.toml` in `folder` (default: the packaged data) into a checked Catalog."""
    root = Path(folder) if folder is not None else DATA_DIR
    files = sorted(root.glob("*.toml"))
    if not files:
        raise ConfigError("hardware catalog", str(root), "a folder with *.toml files")
    tables: dict[str, dict[str, Any]] = {k: {} for k in _READERS}
    for path in files:
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(path.name, "(file)", f"valid TOML ({e})") from None
        for key in raw:
            if key not in _TOP_LEVEL:
                raise ConfigError(f"{path.name}: {key}", "(table)", " | ".join(_TOP_LEVEL))
        sources = read_sources(path.name, raw)
        for kind, reader in _READERS.items():
            for name, table in entries(path.name, raw, kind).items():
                if name in tables[kind]:
                    raise ConfigError(f"{path.name}: {kind}.{name}", name, "a name used once")
                tables[kind][name] = reader(
                    name, Entry(f"{path.name}: {kind}.{name}", table, sources)
                )
    cat = Catalog(
        gpus=tables["gpu"],
        links=tables["link"],
        nodes=tables["node"],
        topologies=tables["topology"],
        switches=tables["switch"],
        optics=tables["optic"],
        files=tuple(p.name for p in files),
    )
    _check_references(cat)
    return cat


def _check_references(cat: Catalog) -> None:
    """Every name one entry uses must exist: a typo fails at load, not mid-plan."""
    for g in cat.gpus.values():
        for attr in ("scale_up", "host_link"):
            if getattr(g, attr) not in cat.links:
                raise ConfigError(f"gpu.{g.name}.{attr}", getattr(g, attr), " | ".join(cat.links))
    for n in cat.nodes.values():
        if n.gpu not in cat.gpus:
            raise ConfigError(f"node.{n.name}.gpu", n.gpu, " | ".join(cat.gpus))
        for attr in ("scale_up", "nic"):
            if getattr(n, attr) not in cat.links:
                raise ConfigError(f"node.{n.name}.{attr}", getattr(n, attr), " | ".join(cat.links))
    for s in cat.switches.values():
        if s.link not in cat.links:
            raise ConfigError(f"switch.{s.name}.link", s.link, " | ".join(cat.links))
    for o in cat.optics.values():
        if o.name not in cat.links:
            raise ConfigError(f"optic.{o.name}", o.name, "a link name: " + " | ".join(cat.links))


@functools.cache
def default_catalog() -> Catalog:
    """The packaged catalog, read once per process."""
    return load_catalog()


def get_gpu(name: str) -> GPU:
    return default_catalog().gpu(name)


def get_link(name: str) -> Link:
    return default_catalog().link(name)


def gpu_for_device_name(cuda_name: str) -> GPU | None:
    """The catalog GPU for a `torch.cuda.get_device_name()` string, or None when unknown."""
    return default_catalog().gpu_for_device_name(cuda_name)
