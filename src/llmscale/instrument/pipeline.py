"""Pipeline timelines, recorded: when each rank ran each forward and backward chunk of a step.

Opt-in with `[metrics] pipeline_timeline = true` (pp > 1). `PipelineRecorder.watch` wraps the
`forward_one_chunk` / `backward_one_chunk` / `backward_weight_one_chunk` methods of this rank's
torch `PipelineStage`s, the single point through which every torch schedule (GPipe, 1F1B, the
interleaved and zero-bubble runtimes) runs a chunk's compute; the p2p waits happen outside them,
so they count as idle, as in the simulator. Each op is recorded with its kind, stage, chunk (the
stage's place among this rank's stages), microbatch, start and end. Kinds are the simulator's:
F (forward), B (backward: the input-gradient part under the split-backward schedules zero_bubble,
zbv and dualpipev, the whole backward otherwise and for dualpipev's unsplit ones) and W (the
weight-gradient part). torch runs stage 0's split backward all in its W (its input needs no
gradient), so there B is near zero.
On the last stage the loss is computed right after the forward, outside `forward_one_chunk`:
`timed_loss` extends that forward's record to the loss's end, so an F op is what the simulator
calls one (forward, and the loss where there is one).

Times are `time.time()`, the clock every process on a machine shares (and NTP keeps close across
machines), so records of different ranks line up without a barrier; a step's makespan runs from
its first op's start to its last op's end. With the instrument off nothing is wrapped. On, each op
costs two clock reads and one tuple append (about a microsecond); on CUDA the wrappers also
synchronize the device at each op's end so that the time is the kernels', not their launch's.

The file written here is read and analysed by `parallel/timeline.py`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

FILE_NAME = "pipeline_timeline.json"
KEEP_STEPS = 1000  # newest steps kept in memory; the instrument is meant for short runs
# One op: kind ("F" | "B" | "W"), stage, chunk, microbatch, start, end.
OpTuple = tuple[str, int, int, int, float, float]
_WRAPPED = (
    ("forward_one_chunk", "F"),
    ("backward_one_chunk", "B"),
    ("backward_weight_one_chunk", "W"),
)


class PipelineRecorder:
    """This rank's recorder: wrap its stages once, then record inside `step()` blocks."""

    def __init__(self, pp_rank: int, sync: Callable[[], None] | None = None) -> None:
        self.pp_rank = pp_rank
        self._sync = sync
        self._ops: list[OpTuple] | None = None  # None: not recording
        self.steps: deque[tuple[int, list[OpTuple]]] = deque(maxlen=KEEP_STEPS)
        self._last_stage = -1

    # ---- recording ------------------------------------------------------------------------
    def watch(self, stages: Sequence[Any]) -> None:
        """Wrap each torch PipelineStage's per-chunk forward and backward (instance attributes).

        The wrappers reach their stage through a weak reference: a wrapper holding the stage's
        bound method, stored on that stage, would make every watched stage (and the process
        group it holds) a reference cycle that only the garbage collector frees.
        """
        for chunk, st in enumerate(stages):
            if st.is_last:
                self._last_stage = st.stage_index
            for name, kind in _WRAPPED:
                if hasattr(st, name):
                    fn = _unbound(st, name)
                    setattr(st, name, self._timed(fn, kind, st.stage_index, chunk))

    def _timed(
        self, fn: Callable[..., Any], kind: str, stage: int, chunk: int
    ) -> Callable[..., Any]:
        def wrapper(mb: int, *args: Any, **kwargs: Any) -> Any:
            if self._ops is None:
                return fn(mb, *args, **kwargs)
            if self._sync is not None:
                # Work queued before this op (a NCCL receive's wait is on the stream, not the
                # host) belongs to the idle time before it, not to its compute.
                self._sync()
            t0 = time.time()
            out = fn(mb, *args, **kwargs)
            if self._sync is not None:
                self._sync()
            self._ops.append((kind, stage, chunk, mb, t0, time.time()))
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
                kind, stage, chunk, mb, t0, _ = ops[-1]
                ops[-1] = (kind, stage, chunk, mb, t0, time.time())
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
                {"rank": rank["pp_rank"], "kind": k, "stage": s, "chunk": c,
                 "microbatch": m, "start": a, "end": b}
                for k, s, c, m, a, b in ops
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
