"""A timeline of the offload pipeline: (step, unit, phase, lane, start, end) intervals.

Lanes are the resources that can work at the same time: `compute` (the training thread's forward
and backward, or on CUDA the compute stream), `d2h` and `h2d` (the two copy directions; on CUDA
the two copy engines, elsewhere one thread each) and `cpu` (the host worker that accumulates
gradients, takes norms and runs Adam); under optimizer+params `params` shows when each unit's
parameters are on the device (phase "resident", from their fetch to their release). An interval's ends are host clock readings
(`time.perf_counter`) or, on CUDA, events recorded on a stream; events are turned into seconds
when the timeline is written, against one reference event taken when the timeline was made.

`overlap_stats` answers the question the pipeline exists for: of the time the transfer and
update lanes were busy, how much was hidden under compute.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

COMPUTE_LANE = "compute"
OFFLOAD_LANES = ("d2h", "cpu", "h2d")
# optimizer+params: when each unit's device parameters exist (fetch to release). Not work, so
# not in OFFLOAD_LANES: the uploads themselves are on h2d.
PARAMS_LANE = "params"
LANES = (COMPUTE_LANE, *OFFLOAD_LANES, PARAMS_LANE)


@dataclass(frozen=True)
class Interval:
    """One bar of the timeline; times in seconds since the timeline's origin."""

    step: int
    unit: str
    phase: str
    lane: str
    start: float
    end: float


class TransferTimeline:
    """Thread-safe recorder of the last `keep_steps` optimizer steps' intervals."""

    def __init__(self, device: torch.device | None = None, keep_steps: int = 4) -> None:
        self.keep_steps = keep_steps
        self.cuda = device is not None and device.type == "cuda"
        self._lock = threading.Lock()
        self._raw: list[tuple[int, str, str, str, Any, Any]] = []
        self.origin = time.perf_counter()
        self._ref_event: Any = None
        if self.cuda:
            self._ref_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: cuda.Event unannotated
            self._ref_event.record(torch.cuda.current_stream(device))
            self._ref_event.synchronize()
            self.origin = time.perf_counter()

    def host_now(self) -> float:
        return time.perf_counter()

    def stream_now(self) -> Any:
        """A mark on the current stream (CUDA) or the host clock (elsewhere)."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: cuda.Event unannotated
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, step: int, unit: str, phase: str, lane: str, start: Any, end: Any) -> None:
        with self._lock:
            self._raw.append((step, unit, phase, lane, start, end))

    def prune(self, current_step: int) -> None:
        """Forget intervals of steps older than the last `keep_steps`."""
        oldest = current_step - self.keep_steps + 1
        with self._lock:
            self._raw = [r for r in self._raw if r[0] >= oldest]

    def _seconds(self, mark: Any) -> float:
        if isinstance(mark, float):
            return mark - self.origin
        mark.synchronize()
        ms: float = self._ref_event.elapsed_time(mark)
        return ms / 1e3

    def intervals(self) -> list[Interval]:
        with self._lock:
            raw = list(self._raw)
        out = [
            Interval(s, u, p, lane, self._seconds(a), self._seconds(b))
            for s, u, p, lane, a, b in raw
        ]
        return sorted(out, key=lambda iv: (iv.start, iv.end))

    def to_dict(self, **meta: Any) -> dict[str, Any]:
        return {
            "lanes": list(LANES),
            "clock": "cuda events" if self.cuda else "host perf_counter",
            **meta,
            "intervals": [asdict(iv) for iv in self.intervals()],
        }

    def write(self, path: str | Path, **meta: Any) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(**meta)))
        tmp.replace(p)
        return p


def read_timeline(path: str | Path) -> tuple[dict[str, Any], list[Interval]]:
    """The metadata and intervals of a timeline JSON file."""
    raw = json.loads(Path(path).read_text())
    ivs = [Interval(**d) for d in raw.pop("intervals")]
    return raw, ivs


# ---- interval arithmetic --------------------------------------------------------------------


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping [start, end) spans into disjoint sorted ones."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(spans: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def intersect(x: Sequence[tuple[float, float]], y: Sequence[tuple[float, float]]) -> float:
    """Total length of the intersection of two disjoint sorted span lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            total += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class OverlapStats:
    """How much of the offload work (transfers + CPU update) ran under compute."""

    compute_s: float  # union of compute-lane intervals
    offload_s: float  # union of d2h, cpu and h2d intervals
    hidden_s: float  # ... of which under compute
    per_lane_s: dict[str, float]  # busy time of each lane (its own union)

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_s / self.offload_s if self.offload_s > 0 else 0.0

    @property
    def exposed_s(self) -> float:
        return self.offload_s - self.hidden_s


def overlap_stats(
    intervals: Iterable[Interval], steps: Iterable[int] | None = None
) -> OverlapStats:
    """Hidden share of offload work, over the intervals of `steps` (all when None).

    A step's offload work (its uploads run into the next step's forward) is compared with all
    the compute that ran meanwhile, whichever step that compute belongs to. Time the compute
    lane spent waiting for an upload is not compute: what it waited for was exposed.
    """
    ivs = [iv for iv in intervals if not (iv.lane == COMPUTE_LANE and iv.phase == "wait")]
    wanted = None if steps is None else set(steps)
    compute = union((iv.start, iv.end) for iv in ivs if iv.lane == COMPUTE_LANE)
    mine = [iv for iv in ivs if iv.lane in OFFLOAD_LANES and (wanted is None or iv.step in wanted)]
    offload = union((iv.start, iv.end) for iv in mine)
    per_lane = {
        lane: length(union((iv.start, iv.end) for iv in mine if iv.lane == lane))
        for lane in OFFLOAD_LANES
    }
    if wanted is not None:
        own = [iv for iv in ivs if iv.lane == COMPUTE_LANE and iv.step in wanted]
        compute_s = length(union((iv.start, iv.end) for iv in own))
    else:
        compute_s = length(compute)
    return OverlapStats(compute_s, length(offload), intersect(offload, compute), per_lane)
