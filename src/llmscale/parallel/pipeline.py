"""Pipeline parallelism: split the model by layers into stages, run them with a torch schedule.

Stages are contiguous runs of blocks: `parallel.pp_layers` of them each, or automatically as even
as the layer count allows with the first and last stages the lighter ones (the first also carries
the embedding, the last the output projection and the loss): `model.config.stage_layer_counts`,
which the planner reads too. Stage 0 keeps the
embeddings, the last stage the final norm and output; the model's forward already handles each
of them being absent, and blocks keep their names (`layers.5...`), so a checkpoint saved under
one split loads under another. A tied model's last stage keeps a copy of the embedding as its
`output`, or in a V without data parallelism the one tensor the first stage's embedding reads
(parallel/tied_embeddings.py).

With `pp_chunks` = v > 1 (interleaved 1F1B, zero bubble) there are pp x v stages and rank r
holds stages r, r + pp, r + 2 pp, ... (loop style, as `ScheduleInterleaved1F1B` and
`ScheduleInterleavedZeroBubble` expect). The V schedules (zbv, dualpipev) run two chunks per rank
placed in a V: rank r holds stages r and 2 pp - 1 - r (`ScheduleZBVZeroBubble`,
`ScheduleDualPipeV`), so the first and the last stage share rank 0. zero_bubble, zbv and
dualpipev split a backward into its input-gradient part (B, `backward_one_chunk(full_backward=
False)`) and its weight-gradient part (W, `backward_weight_one_chunk`), run later to fill the
bubble.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmscale.config import SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, pipeline_chunks
from llmscale.instrument.activations import storage_bytes
from llmscale.instrument.pipeline import PipelineRecorder
from llmscale.model.config import split_layers, stage_ids, tied_copy
from llmscale.model.transformer import Transformer
from llmscale.parallel.tied_embeddings import SharedEmbedding, share_tied_head

__all__ = [
    "PipelineMemory",
    "build_pipeline_schedule",
    "build_stage_module",
    "pending_weight_grad_bytes",
    "pipeline_split",
    "receive_buffers",
    "schedule_op_order",
    "schedule_stage_ids",
    "split_layers",
    "stage_ids",
]


def build_stage_module(
    model: Transformer, stage: int, n_stages: int, pp_layers: list[int] | tuple[int, ...] = ()
) -> Transformer:
    """A copy of `model` with only stage `stage`'s layers (and embeddings/head where they live)."""
    part = copy.deepcopy(model)
    keep = split_layers(model.cfg.n_layers, n_stages, pp_layers)[stage]
    for name in list(part.layers.keys()):
        if int(name) not in keep:
            del part.layers[name]
    tied = model.cfg.tie_embeddings and n_stages > 1
    if stage == n_stages - 1 and tied and part.tok_embeddings is not None:
        # The last stage's copy of the tied embedding, its output projection (same device and
        # dtype: meta while the trainer builds; `initial_value` gives it the embedding's value);
        # in a V without data parallelism the one tensor (`pipeline_split`).
        w = part.tok_embeddings.weight
        cfg = model.cfg
        part.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=w.device, dtype=w.dtype)
        if w.device.type != "meta":  # a materialized model: the copy starts as the embedding
            with torch.no_grad():
                part.output.weight.copy_(w)
    if stage != 0:
        part.tok_embeddings = None
        part.pos_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def schedule_stage_ids(schedule: str, pp_rank: int, pp: int, pp_chunks: int) -> list[int]:
    """Stages pipeline rank `pp_rank` holds under `schedule` (loop style, or a V for zbv and
    dualpipev), from the config's `pp_chunks`."""
    chunks = pipeline_chunks(schedule, pp_chunks)
    return stage_ids(pp_rank, pp, chunks, v_shape=schedule in V_SCHEDULES)


def pipeline_split(
    model: Transformer,
    pp_rank: int,
    pp: int,
    chunks: int,
    pp_layers: list[int] | tuple[int, ...] = (),
    schedule: str = "1f1b",
) -> tuple[list[Transformer], list[int]]:
    """This pipeline rank's model chunks and their stage indices (`pp_layers`: layers per stage,
    empty for the automatic split). `chunks` is the config's `pp_chunks`; `schedule` decides
    how many chunks a rank really holds and where (`schedule_stage_ids`). A tied model whose
    first and last stage share this rank (a V) keeps one tensor for both
    (`tied_embeddings.share_tied_head`), with or without data parallelism."""
    ids = schedule_stage_ids(schedule, pp_rank, pp, chunks)
    n_stages = pp * pipeline_chunks(schedule, chunks)
    parts = [build_stage_module(model, s, n_stages, pp_layers) for s in ids]
    both = 0 in ids and n_stages - 1 in ids  # first and last stage here: a V
    tied = model.cfg.tie_embeddings and pp > 1
    if tied and both and not tied_copy(model.cfg, pp, v_shape=both):
        share_tied_head(parts, ids, n_stages)
    return parts, ids


def build_pipeline_schedule(
    parts: list[nn.Module],
    ids: list[int],
    n_stages: int,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    group: torch.distributed.ProcessGroup,
    timeline: PipelineRecorder | None = None,
    memory: PipelineMemory | None = None,
) -> object:
    """A torch.distributed.pipelining schedule over this rank's stages.

    `loss_fn` must already divide by the number of micro-batches (the schedule is built with
    scale_grads=False), so accumulated gradients equal those of one pass over the whole batch.
    With `timeline`, the stages' per-chunk forward, backward (and, for the split-backward
    schedules, backward-weight) ops and the loss are timed. `ids` must be the schedule's own
    placement (`schedule_stage_ids`): torch's V schedules assume rank r holds stages r and
    2 pp - 1 - r and route their p2p by that, unchecked. With `memory`, what the stages hold
    besides saved activations is sampled before each of their ops (`PipelineMemory`).
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    stages: list[Any] = [
        PipelineStage(part, stage_index=s, num_stages=n_stages, device=device, group=group)
        for part, s in zip(parts, ids, strict=True)
    ]
    if schedule in V_SCHEDULES:
        for st in stages:
            _skip_local_grad_handoff_without_backward(st)
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        for st in stages:
            _gather_before_split_backward(st)
    if timeline is not None:
        timeline.watch(stages)
        loss_fn = timeline.timed_loss(loss_fn)
    if memory is not None:  # outside the timeline's wrappers: the sampling is not op time
        memory.watch(stages)
    multi = {
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zero_bubble": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
        "dualpipev": ScheduleDualPipeV,
    }
    if schedule in multi:
        sched = multi[schedule](stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        if 0 in ids and isinstance(parts[ids.index(0)].tok_embeddings, SharedEmbedding):
            reduce_shared_tied_weight_last(sched, n_stages)
        return sched
    (stage,) = stages
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)


def _skip_local_grad_handoff_without_backward(stage: Any) -> None:
    """Let a V schedule run forward-only (`schedule.eval`, the evaluation).

    In a V two adjacent stages share a rank (stages pp - 1 and pp on the last rank), and
    torch 2.13's runtime hands the input gradient of one to the other in place of a p2p after
    every backward action, even in eval mode, where the stage refuses (`AssertionError: can't
    steal_bwd_input if this stage doesn't have backward`). Without a backward there is no
    gradient to hand over: both ends do nothing then. The wrappers hold their stage weakly.
    """
    ref = weakref.ref(stage)
    get_out = type(stage).get_local_bwd_output
    set_in = type(stage).set_local_bwd_input

    def get_local_bwd_output(mb_index: int) -> Any:
        st: Any = ref()
        return get_out(st, mb_index) if st.has_backward else ()

    def set_local_bwd_input(grads: Any, mb_index: int) -> None:
        st: Any = ref()
        if st.has_backward:
            set_in(st, grads, mb_index)

    stage.get_local_bwd_output = get_local_bwd_output
    stage.set_local_bwd_input = set_local_bwd_input


def _gather_before_split_backward(stage: Any) -> None:
    """Gather an FSDP stage's parameters before each split-backward op that reads them.

    torch 2.13's B (`stage_backward_input`) takes `submod.parameters()` before it runs
    autograd, to find which graph nodes lead to which weights, and W
    (`stage_backward_weight`) maps what it computes back through `submod.parameters()` again.
    FSDP2 swaps the module's registered parameters: the unsharded ones (the autograd graph's
    leaves) while gathered, the sharded DTensors (in no graph) once resharded. Under zero 3
    (`reshard_after_forward=True`) every F reshards its stage, and the pre-backward all-gather
    only fires inside B's autograd call, too late: a B after an F saw sharded parameters, found
    no weights in the graph and its micro-batch's weight gradients were dropped, silently (the
    schedule's own UNSHARD actions gather a stage once, unaware of FSDP's resharding).
    Gathering first (as torch's UNSHARD action does: every FSDP module of the stage, `unshard`,
    a no-op where already gathered) lets B and W see the graph's parameters. Stage 0 needs none
    of it: its B is empty and its W a full backward through FSDP's own hooks.
    """
    ref = weakref.ref(stage)
    backward = type(stage).backward_one_chunk
    backward_weight = type(stage).backward_weight_one_chunk

    def backward_one_chunk(
        bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> Any:
        st: Any = ref()
        if not full_backward and not st.is_first:
            _unshard(st.submod)
        return backward(
            st, bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
        )

    def backward_weight_one_chunk(bwd_chunk_id: int, last_backward: bool = False) -> Any:
        st: Any = ref()
        if not st.is_first:
            _unshard(st.submod)
        return backward_weight(st, bwd_chunk_id, last_backward=last_backward)

    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def _unshard(module: nn.Module) -> None:
    """All-gather every FSDP unit of `module` that is sharded now (all at once, then wait)."""
    from torch.distributed.fsdp import FSDPModule

    handles = [m.unshard(async_op=True) for m in module.modules() if isinstance(m, FSDPModule)]
    for h in handles:
        if h is not None:
            h.wait()


class PipelineMemory:
    """What a rank's pipeline stages hold besides saved activations and the model's states.

    torch 2.13's `PipelineStage` keeps, per stage and micro-batch:

    - receive buffers (`pipeline_buffer_bytes`): one for the activations received (every stage
      but the first) and one for the output gradient received (every stage but the last), per
      micro-batch, allocated at the first step and kept (in a V the two stages sharing the
      last rank hand each other their tensors instead: the same count);
    - from a split backward's B until its W (`pending_weight_grad_bytes`, the step's peak):
      `backward_state` keeps the gradients at the ops W starts from (every linear's output
      gradient, every norm weight's: torch's intermediates) and the stage's output; and B puts
      the input gradient on the received activation's `.grad`, where it stays until the next
      step begins (`clear_runtime_states`). A whole backward (gpipe, 1f1b, interleaved,
      dualpipev's full backwards) keeps none of it.

    The two are counted apart (a storage that is a receive buffer is not pending), storages
    once, parameters never. `watch` wraps each stage's forward, backward and weight-gradient
    calls to sample the pending bytes before each op runs (so after a B the next op sees what
    B left, after the local hand-offs of a V); `end_step` samples once more and reads the
    buffers. Costs a walk over a few tensors per op; nothing runs outside `begin_step` /
    `end_step`.
    """

    def __init__(self) -> None:
        self._stages: list[weakref.ref[Any]] = []  # weakly: the schedule owns its stages
        self.active = False
        self.pending_bytes = 0
        self.pending_peak_bytes = 0
        self.buffer_bytes = 0

    @property
    def stages(self) -> list[Any]:
        return [st for ref in self._stages if (st := ref()) is not None]

    def watch(self, stages: list[Any]) -> None:
        self._stages = [weakref.ref(st) for st in stages]
        for st in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(st, name, self._sampled(st, name))

    def _sampled(self, stage: Any, name: str) -> Callable[..., Any]:
        """`stage.name`, sampling first; holds neither the stage nor this meter (a bound
        method stored on its own stage would make the stage, and its process group, a cycle)."""
        me, st_ref = weakref.ref(self), weakref.ref(stage)
        inner = stage.__dict__.get(name)  # an earlier wrapper (the timeline's, the gather's)
        func = getattr(type(stage), name)

        def run(*args: Any, **kwargs: Any) -> Any:
            m = me()
            if m is not None and m.active:
                m.sample()
            if inner is not None:
                return inner(*args, **kwargs)
            return func(st_ref(), *args, **kwargs)

        return run

    def begin_step(self) -> None:
        self.active = True
        self.pending_peak_bytes = 0
        self.sample()

    def end_step(self) -> None:
        self.sample()
        self.buffer_bytes = self.receive_buffer_bytes()
        self.active = False

    def sample(self) -> None:
        self.pending_bytes = pending_weight_grad_bytes(self.stages)
        self.pending_peak_bytes = max(self.pending_peak_bytes, self.pending_bytes)

    def receive_buffer_bytes(self) -> int:
        return sum(receive_buffers(self.stages).values())


def receive_buffers(stages: list[Any]) -> dict[tuple[int, int], int]:
    """The storages of the stages' receive buffers (activations and output gradients), bytes."""
    out: dict[tuple[int, int], int] = {}
    for st in stages:
        for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
            for info in infos:
                if not info.is_root_arg and isinstance(info.buffer, torch.Tensor):
                    out.update(storage_bytes(info.buffer))
    return out


def pending_weight_grad_bytes(stages: list[Any]) -> int:
    """Bytes the stages keep for their pending Ws and from their split Bs (`PipelineMemory`):
    `backward_state`'s gradients at the intermediates and stage outputs, and the input
    gradients left on the received activations; receive buffers and parameters excluded."""
    skip = set(receive_buffers(stages))  # (`storage_bytes` never counts a parameter)
    seen: dict[tuple[int, int], int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            for key, n in storage_bytes(t):
                if key not in skip:
                    seen[key] = n

    for st in stages:
        for input_values, param_groups, stage_output, _output_grads in st.backward_state.values():
            for group in param_groups or ():
                for grads in group.get("grads") or ():
                    for g in grads or ():
                        add(g)
            for t in stage_output if isinstance(stage_output, (list, tuple)) else (stage_output,):
                add(t)
            for t in input_values:
                if isinstance(t, torch.Tensor):
                    add(t.grad)
        for infos in st.args_recv_info.values():
            for info in infos:
                if not info.is_root_arg and isinstance(info.buffer, torch.Tensor):
                    add(info.buffer.grad)
    return sum(seen.values())


# torch's action kinds as the simulator and the pipeline timeline name them: its
# BACKWARD_INPUT ("I") is our B, its FULL_BACKWARD ("B") a B with no W after it.
_TORCH_KINDS = {"F": "F", "I": "B", "B": "B", "W": "W"}


def schedule_op_order(schedule: Any) -> list[list[tuple[str, int, int]]]:
    """Each pp rank's compute ops in the order torch's schedule object runs them: (kind,
    stage, microbatch) tuples with kind F, B or W, read from its `pipeline_order` (multi-stage
    schedules: interleaved_1f1b, zero_bubble, zbv, dualpipev). Idle slots are dropped and
    dualpipev's overlapped F+B pairs unfold into their F and B, the order the runtime runs them.
    """
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        raise ValueError(f"{type(schedule).__name__} has no pipeline_order")
    out: list[list[tuple[str, int, int]]] = []
    for rank in sorted(order):
        ops: list[tuple[str, int, int]] = []
        for action in order[rank]:
            if action is None:
                continue
            for a in action.sub_actions or (action,):
                kind = _TORCH_KINDS.get(str(a.computation_type.value))
                if kind is not None and a.microbatch_index is not None:
                    ops.append((kind, a.stage_index, a.microbatch_index))
        out.append(ops)
    return out


def reduce_shared_tied_weight_last(schedule: Any, n_stages: int) -> None:
    """In a V whose tied weight is one tensor (`tied_embeddings.SharedEmbedding`), reduce the
    last stage's gradients after the first stage's backward.

    torch 2.13's runtime reduces each stage's gradients (REDUCE_GRAD: FSDP2's post-backward,
    the reduce-scatter and the reshard) right after that stage's last backward op
    (`schedules._add_reduce_grad`). The tied weight is the last stage's, but the first stage's
    embedding lookups add to its gradient too, in backward ops that run after the last stage's
    final one: reduced there, those additions would be left in the unsharded gradient, missed
    by the step (measured: tied ZB-V x dp_shard 2, zero 1, losses off by 6e-4 at step 2, weights
    by 3%). Moving the last stage's REDUCE_GRAD just after the first stage's makes it reduce the
    whole sum; no other op moves.
    """
    from torch.distributed.pipelining.schedules import REDUCE_GRAD

    def reduce_at(order: list[Any], stage: int) -> int | None:
        for i, a in enumerate(order):
            if a is not None and a.computation_type == REDUCE_GRAD and a.stage_index == stage:
                return i
        return None

    for order in schedule.pipeline_order_with_comms.values():
        last = reduce_at(order, n_stages - 1)
        if last is None or reduce_at(order, 0) is None:
            continue
        action = order.pop(last)
        first = reduce_at(order, 0)
        assert first is not None
        order.insert(first + 1, action)
