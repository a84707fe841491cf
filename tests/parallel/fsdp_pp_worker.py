"""One rank of tests/parallel/test_fsdp_pipeline_memory.py: what FSDP2 holds under a pipeline.

    torchrun --nproc-per-node 4 tests/parallel/fsdp_pp_worker.py OUT.json PRECISION:ZERO ...

Trains pp=2 x dp_shard=2 for two steps per layout. Right before each stage's end-of-step
reduce-scatter (`perform_reduce_grad`, called by torch's schedules after the last micro-batch's
backward) it adds up the unsharded gradients FSDP2 has accumulated and the unsharded parameters
it still holds; dp rank 0 of each stage writes the most seen against the planner's prediction.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from parallel_harness import BASE
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import stage as stage_mod

from llmscale.config import load_config
from llmscale.plan.memory import rank_states
from llmscale.plan.predict import as_plan
from llmscale.train.trainer import Trainer

RECORDS: list[dict[str, int]] = []


def _held(stage: stage_mod._PipelineStageBase) -> dict[str, int]:
    grads = params = 0
    for state in fully_shard.state(stage.submod)._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                unsharded = getattr(fp, "_unsharded_param", None)
                grad = fp.unsharded_accumulated_grad
                if grad is None and unsharded is not None:
                    grad = unsharded.grad
                if grad is not None:
                    grads += grad.numel() * grad.element_size()
                if fp.sharded_state.name == "UNSHARDED" and unsharded is not None:
                    params += unsharded.numel() * unsharded.element_size()
    return {"grads": grads, "params": params}


def main() -> None:
    out = Path(sys.argv[1])
    original = stage_mod._PipelineStageBase.perform_reduce_grad

    def recorded(self, grad_scale_factor):  # type: ignore[no-untyped-def]
        RECORDS.append(_held(self))
        return original(self, grad_scale_factor)

    stage_mod._PipelineStageBase.perform_reduce_grad = recorded  # type: ignore[method-assign]
    results = []
    for layout in sys.argv[2:]:
        precision, zero = layout.split(":")
        args = [
            *BASE, "--job.run_dir", str(out.parent / f"run_{precision}_{zero}"),
            "--train.steps", "2", "--parallel.pp", "2", "--parallel.dp_shard", "2",
            "--precision.mode", precision, "--parallel.zero_stage", zero,
        ]  # fmt: skip
        cfg = load_config(None, args)
        RECORDS.clear()
        t = Trainer(cfg)
        t.fit()
        if t.dims.dp_rank == 0:
            st = rank_states(as_plan(cfg), t.dims.pp_rank)
            measured = max(RECORDS, key=lambda r: r["grads"])  # (eval calls it with none)
            results.append(
                {
                    "layout": layout,
                    "pp_rank": t.dims.pp_rank,
                    "measured": measured,
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
