"""One rank of tests/parallel/test_fsdp_pipeline_memory.py: what FSDP2 holds under a pipeline.

    torchrun --nproc-per-node 4 tests/parallel/fsdp_pp_worker.py OUT.json LAYOUT ...

LAYOUT is PRECISION:ZERO[:SCHEDULE[:tied][:replicate][:v2][:m4]] (schedule 1f1b unless given;
`v2`: two chunks per rank; `m4`: four micro-batches per step, else two; `tied`:
tied embeddings, which in a V put the one tied tensor in the last stage's root unit, gathered by
the first stage's embedding; `replicate`: pp=2 x dp_replicate=2, else pp=2 x dp_shard=2). Trains
two steps per layout. Right before each stage's end-of-step reduction (`perform_reduce_grad`,
called by torch's schedules after the last micro-batch's backward) it adds up, over every stage
of the rank (a V holds two), the unsharded gradients FSDP2 holds (fp32 accumulated, and
param_dtype ones not yet added to them) and the unsharded parameters; it also keeps the most
parameter bytes the rank held at any point of the step (`peak_params`: gathered units plus
issued all-gathers' output buffers, after every unshard and every wait). dp rank 0 of each pp
rank writes the most seen against the planner's prediction for that rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from parallel_harness import BASE
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.pipelining import stage as stage_mod

from llmscale.config import load_config
from llmscale.plan.memory import rank_states
from llmscale.plan.predict import as_plan
from llmscale.train.trainer import Trainer

RECORDS: list[dict[str, int]] = []
PARTS: list[nn.Module] = []  # this rank's stages (set once the trainer is built)
PEAK = {"params": 0}


def _held() -> dict[str, int]:
    grads = params = 0
    for part in PARTS:
        for state in part._get_fsdp_state()._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)
                    # fp32 accumulated gradients, and param_dtype ones not yet added to them
                    pending = None if unsharded is None else unsharded.grad
                    for grad in (fp.unsharded_accumulated_grad, pending):
                        if grad is not None:
                            grads += grad.numel() * grad.element_size()
                    if fp.sharded_state.name == "UNSHARDED" and unsharded is not None:
                        params += unsharded.numel() * unsharded.element_size()
                pending = group._all_gather_result
                if pending is not None:  # issued, not yet copied out: its flat output buffer
                    out = pending.all_gather_output
                    params += out.numel() * out.element_size()
    return {"grads": grads, "params": params}


def main() -> None:
    out = Path(sys.argv[1])
    reduce_grad = stage_mod._PipelineStageBase.perform_reduce_grad
    wait = FSDPParamGroup.wait_for_unshard
    unshard = FSDPParamGroup.unshard

    def recorded(self, grad_scale_factor):  # type: ignore[no-untyped-def]
        RECORDS.append(_held())
        return reduce_grad(self, grad_scale_factor)

    def waited(self):  # type: ignore[no-untyped-def]
        wait(self)
        if PARTS:
            PEAK["params"] = max(PEAK["params"], _held()["params"])

    stage_mod._PipelineStageBase.perform_reduce_grad = recorded  # type: ignore[method-assign]

    def issued(self, async_op=False):  # type: ignore[no-untyped-def]
        unshard(self, async_op)
        if PARTS:
            PEAK["params"] = max(PEAK["params"], _held()["params"])

    FSDPParamGroup.wait_for_unshard = waited  # type: ignore[method-assign]
    FSDPParamGroup.unshard = issued  # type: ignore[method-assign]
    results = []
    for layout in sys.argv[2:]:
        precision, zero, *rest = layout.split(":")
        schedule = rest[0] if rest else "1f1b"
        tied, replicate = "tied" in rest[1:], "replicate" in rest[1:]
        more = ["--parallel.pp_chunks", "2"] if "v2" in rest[1:] else []
        if "m4" in rest[1:]:  # four micro-batches per step (dualpipev needs 2 x pp)
            more += ["--train.global_batch_size", "16"]
        dp = ["--parallel.dp_replicate", "2"] if replicate else ["--parallel.dp_shard", "2"]
        args = [
            *BASE, "--job.run_dir", str(out.parent / f"run_{layout.replace(':', '_')}"),
            "--train.steps", "2", "--parallel.pp", "2", *dp,
            "--precision.mode", precision, "--parallel.zero_stage", zero,
            "--parallel.pp_schedule", schedule, "--model.tie_embeddings", str(tied).lower(),
            *more,
        ]  # fmt: skip
        cfg = load_config(None, args)
        RECORDS.clear()
        PARTS.clear()
        PEAK["params"] = 0
        t = Trainer(cfg)
        PARTS.extend(t.model_parts)
        t.fit()
        if t.dims.dp_rank == 0:
            st = rank_states(as_plan(cfg), t.dims.pp_rank)
            measured = max(RECORDS, key=lambda r: r["grads"])  # (eval calls it with none)
            results.append(
                {
                    "layout": layout,
                    "pp_rank": t.dims.pp_rank,
                    "measured": {**measured, "peak_params": PEAK["params"]},
                    "predicted": {"grads": st.grads, "params": st.working_params},
                }
            )
        t.close()
        dist.barrier()
    if results:
        Path(f"{out}.rank{dist.get_rank()}").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
