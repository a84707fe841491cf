"""Measured pipeline timelines: when each rank ran each forward and backward chunk of a step.

Opt-in with `[metrics] pipeline_timeline = true` (pp > 1). `PipelineTimeline.watch` wraps the
`forward_one_chunk` / `backward_one_chunk` methods of this rank's torch `PipelineStage`s, the
single point through which every torch schedule (GPipe, 1F1B, the interleaved runtime) runs a
chunk's compute; the p2p waits happen outside them, so they count as idle, as in the simulator.
On the last stage the loss is computed right after the forward, outside `forward_one_chunk`:
`timed_loss` extends that forward's record to the loss's end, so an F op is what the simulator
calls one (forward, and the loss where there is one).

Times are `time.time()`, the clock every process on a machine shares (and NTP keeps close across
machines), so records of different ranks line up without a barrier; a step's makespan runs from
its first op's start to its last op's end. With the instrument off nothing is wrapped. On, each op
costs two clock reads and one tuple append (about a microsecond); on CUDA the wrappers also
synchronize the device at each op's end so that the time is the kernels', not their launch's.

The analysis below (`step_stats`, `stage_op_times`, ...) is plain Python over the records.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmscale.plan.schedule import Op, SimResult, TimedOp, simulate_orders

FILE_NAME = "pipeline_timeline.json"
KEEP_STEPS = 1000  # newest steps kept in memory; the instrument is meant for short runs


@dataclass(frozen=True)
class OpRecord:
    """One forward (F) or backward (B) of one microbatch through one stage, as it ran."""

    rank: int  # pipeline rank
    kind: str  # "F" | "B"
    stage: int  # global stage index (loop style: chunk * pp + rank)
    microbatch: int
    start: float  # seconds on the shared clock
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class PipelineTimeline:
    """This rank's recorder: wrap its stages once, then record inside `step()` blocks."""

    def __init__(self, pp_rank: int, sync: Callable[[], None] | None = None) -> None:
        self.pp_rank = pp_rank
        self._sync = sync
        self._ops: list[tuple[str, int, int, float, float]] | None = None  # None: not recording
        self.steps: deque[tuple[int, list[tuple[str, int, int, float, float]]]] = deque(
            maxlen=KEEP_STEPS
        )
        self._last_stage = -1

    # ---- recording ------------------------------------------------------------------------
    def watch(self, stages: Sequence[Any]) -> None:
        """Wrap each torch PipelineStage's per-chunk forward and backward (instance attributes).

        The wrappers reach their stage through a weak reference: a wrapper holding the stage's
        bound method, stored on that stage, would make every watched stage (and the process
        group it holds) a reference cycle that only the garbage collector frees.
        """
        for st in stages:
            if st.is_last:
                self._last_stage = st.stage_index
            for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
                setattr(st, name, self._timed(_unbound(st, name), kind, st.stage_index))

    def _timed(self, fn: Callable[..., Any], kind: str, stage: int) -> Callable[..., Any]:
        def wrapper(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if self._ops is None:
                return fn(chunk_id, *args, **kwargs)
            if self._sync is not None:
                # Work queued before this op (a NCCL receive's wait is on the stream, not the
                # host) belongs to the idle time before it, not to its compute.
                self._sync()
            t0 = time.time()
            out = fn(chunk_id, *args, **kwargs)
            if self._sync is not None:
                self._sync()
            self._ops.append((kind, stage, chunk_id, t0, time.time()))
            return out

        return wrapper

    def timed_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """`loss_fn`, extending the last stage's forward record to the end of the loss."""

        def wrapper(output: Any, target: Any, **kwargs: Any) -> Any:
            loss = loss_fn(output, target, **kwargs)
            ops = self._ops
            if ops and ops[-1][0] == "F" and ops[-1][1] == self._last_stage:
                if self._sync is not None:
                    self._sync()
                kind, stage, mb, t0, _ = ops[-1]
                ops[-1] = (kind, stage, mb, t0, time.time())
            return loss

        return wrapper

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Record the ops run inside the block as training step `step`."""
        self._ops = []
        try:
            yield
        finally:
            self.steps.append((step, self._ops))
            self._ops = None

    # ---- collecting -----------------------------------------------------------------------
    def gather(self, include: bool) -> list[dict[str, Any]] | None:
        """Every rank calls this (a collective over the world); rank 0 gets the included ranks'."""
        import torch.distributed as dist

        mine = {"pp_rank": self.pp_rank, "steps": list(self.steps)} if include else None
        if not dist.is_initialized():
            return [mine] if mine else []
        out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, out, dst=0)
        return None if out is None else [x for x in out if x is not None]


def _unbound(obj: Any, name: str) -> Callable[..., Any]:
    """`obj.name` as a callable that does not keep `obj` alive (a bound method would)."""
    method = getattr(obj, name)
    if not (inspect.ismethod(method) and method.__self__ is obj):
        return method  # type: ignore[no-any-return]
    func, ref = method.__func__, weakref.ref(obj)

    def call(*args: Any, **kwargs: Any) -> Any:
        return func(ref(), *args, **kwargs)

    return call


def write_timeline(path: Path, per_rank: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Merge the ranks' steps into one JSON file: meta, then per step every rank's ops."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for rank in per_rank:
        for step, ops in rank["steps"]:
            by_step.setdefault(step, []).extend(
                {"rank": rank["pp_rank"], "kind": k, "stage": s, "microbatch": m,
                 "start": a, "end": b}
                for k, s, m, a, b in ops
            )  # fmt: skip
    data = {
        **meta,
        "clock": "time.time() seconds, shared by the processes of one machine",
        "steps": [
            {"step": s, "ops": sorted(ops, key=lambda o: (o["start"], o["rank"]))}
            for s, ops in sorted(by_step.items())
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


# ---- analysis (no torch) ------------------------------------------------------------------


@dataclass(frozen=True)
class Timeline:
    """A pipeline_timeline.json: the layout and, per recorded step, every op."""

    schedule: str
    pp: int
    chunks: int
    microbatches: int
    steps: dict[int, list[OpRecord]]

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        d = json.loads(Path(path).read_text())
        steps = {
            s["step"]: [
                OpRecord(o["rank"], o["kind"], o["stage"], o["microbatch"], o["start"], o["end"])
                for o in s["ops"]
            ]
            for s in d["steps"]
        }
        return cls(d["schedule"], d["pp"], d["chunks"], d["microbatches"], steps)


@dataclass(frozen=True)
class StepStats:
    """One measured step, in the simulator's terms."""

    makespan: float  # first op start to last op end
    busy: tuple[float, ...]  # per rank: the sum of its op durations
    bubble_fraction: float  # 1 - sum(busy) / (pp * makespan)
    orders: tuple[tuple[str, ...], ...]  # per rank, its ops by start time ("1F3" spelling)


def step_stats(ops: Sequence[OpRecord], pp: int) -> StepStats:
    """Makespan, busy time, bubble and per-rank op order of one step's records."""
    if not ops:
        raise ValueError("no ops recorded in this step")
    t0 = min(o.start for o in ops)
    makespan = max(o.end for o in ops) - t0
    busy = [0.0] * pp
    orders: list[list[str]] = [[] for _ in range(pp)]
    for o in sorted(ops, key=lambda o: o.start):
        busy[o.rank] += o.duration
        orders[o.rank].append(f"{o.stage}{o.kind}{o.microbatch}")
    return StepStats(
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=1.0 - sum(busy) / (pp * makespan),
        orders=tuple(tuple(r) for r in orders),
    )


def stage_op_times(
    steps: Sequence[Sequence[OpRecord]], n_stages: int
) -> tuple[list[float], list[float]]:
    """Mean forward and backward op time of each global stage over the given steps."""
    f: list[list[float]] = [[] for _ in range(n_stages)]
    b: list[list[float]] = [[] for _ in range(n_stages)]
    for ops in steps:
        for o in ops:
            (f if o.kind == "F" else b)[o.stage].append(o.duration)
    return [statistics.fmean(x) for x in f], [statistics.fmean(x) for x in b]


@dataclass(frozen=True)
class OpWait:
    """When an op could have started: its rank free (`free`) and its inputs there (`ready`)."""

    op: OpRecord
    free: float  # end of the rank's previous op (the step's first start for its first op)
    ready: float  # end of the ops it depends on (`free` when it depends on none)
    cross_rank: bool  # its input came from another rank

    @property
    def slack(self) -> float:
        """Idle with the rank free and the inputs there: p2p, Python between ops, CPU sharing."""
        return self.op.start - max(self.free, self.ready)


def op_waits(ops: Sequence[OpRecord], pp: int) -> list[OpWait]:
    """Each op with what it waited for, by the simulator's dependency rules (F of stage s on
    F of s-1; B of s on its own F and B of s+1)."""
    n_stages = 1 + max(o.stage for o in ops)
    t0 = min(o.start for o in ops)
    end = {(o.kind, o.stage, o.microbatch): o.end for o in ops}
    out = []
    for r in range(pp):
        free = t0
        for o in sorted((o for o in ops if o.rank == r), key=lambda o: o.start):
            if o.kind == "F":
                deps = [("F", o.stage - 1, o.microbatch)] if o.stage > 0 else []
            else:
                deps = [("F", o.stage, o.microbatch)]
                if o.stage < n_stages - 1:
                    deps.append(("B", o.stage + 1, o.microbatch))
            ready = max((end[d] for d in deps), default=free)
            cross = any(d[1] % pp != r for d in deps)
            out.append(OpWait(o, free, ready, cross))
            free = o.end
    return out


def p2p_gaps(ops: Sequence[OpRecord], pp: int) -> list[float]:
    """For each op that sat waiting on another rank's output (its rank was free first), the
    time from that output's end to this op's start: send, receive and the bookkeeping between."""
    return [w.op.start - w.ready for w in op_waits(ops, pp) if w.cross_rank and w.free <= w.ready]


def slack_fraction(ops: Sequence[OpRecord], pp: int) -> float:
    """Share of rank-time (pp x makespan) spent idle while the next op could have run."""
    st = step_stats(ops, pp)
    return sum(max(0.0, w.slack) for w in op_waits(ops, pp)) / (pp * st.makespan)


def replay(ops: Sequence[OpRecord], pp: int, t_p2p: float = 0.0) -> SimResult:
    """The simulator run on a measured step: its per-rank orders, every op its measured time.

    What is left between this and the measured step is idle the dependency model does not hold
    (slack); between this and a simulation from per-stage means, the ops' spread in time.
    """
    orders = [
        [Op(o.kind, o.stage, r, o.stage // pp, o.microbatch)  # type: ignore[arg-type]
         for o in sorted((o for o in ops if o.rank == r), key=lambda o: o.start)]
        for r in range(pp)
    ]  # fmt: skip
    costs = {(o.kind, o.stage, o.microbatch): o.duration for o in ops}
    return simulate_orders(orders, t_p2p=t_p2p, schedule="replay", op_costs=costs)


def as_sim_result(
    ops: Sequence[OpRecord], schedule: str, pp: int, microbatches: int, chunks: int
) -> SimResult:
    """A measured step in the simulator's result type (time 0 = first op start), for plotting."""
    st = step_stats(ops, pp)
    t0 = min(o.start for o in ops)
    timeline = tuple(
        TimedOp(o.rank, Op(o.kind, o.stage, o.rank, o.stage // pp, o.microbatch),  # type: ignore[arg-type]
                o.start - t0, o.end - t0)
        for o in sorted(ops, key=lambda o: (o.start, o.rank))
    )  # fmt: skip
    return SimResult(
        schedule=schedule,
        pp=pp,
        microbatches=microbatches,
        chunks=chunks,
        makespan=st.makespan,
        bubble_fraction=st.bubble_fraction,
        busy=st.busy,
        idle=tuple(st.makespan - b for b in st.busy),
        peak_inflight=tuple(_peak_held(order) for order in st.orders),
        timeline=timeline,
    )


def _peak_held(order: Sequence[str]) -> int:
    held = peak = 0
    for name in order:
        held += 1 if "F" in name else -1
        peak = max(peak, held)
    return peak
