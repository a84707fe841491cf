"""The loss's short-lived logits memory: the planner's bytes per logit
(`plan.activations.loss_transient_bytes`) against what torch allocates when the runtime's loss
(`train.trainer.lm_loss`) runs forward and backward, counted by torch's MemTracker.

Plain logits: the fp32 gradients of the log-softmax output and of its input (8 B per logit).
Vocabulary shards under torch's `loss_parallel` (a DTensor, as tensor parallelism gives the
loss): its composite backward adds one more fp32 temporary (12 B per logit of the shard),
beside a few bytes per token of target masks and indices."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from llmscale.model.config import get_preset
from llmscale.plan.activations import loss_transient_bytes
from llmscale.stack.kernels import Kernels

B, S = 2, 128


def _loss_temporaries(logits: torch.Tensor, targets: torch.Tensor, split: bool) -> float:
    """Peak bytes of temporaries (neither inputs, gradients nor saved tensors) of one loss."""
    from llmscale.train.trainer import lm_loss

    tracker = MemTracker()
    tracker.track_external(logits, targets)
    with tracker:
        if split:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                lm_loss(logits, targets).backward()
        else:
            lm_loss(logits, targets).backward()
    peak = tracker.get_tracker_snapshot("peak")
    return float(sum(dev.get(_MemRefType.TEMP, 0) for dev in peak.values()))


def test_plain_loss_temporaries_are_the_planners() -> None:
    cfg = get_preset("tiny")
    torch.manual_seed(0)
    logits = torch.randn(B, S, cfg.vocab_size, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (B, S))
    measured = _loss_temporaries(logits, targets, split=False)
    assert measured == loss_transient_bytes(cfg, B, S, "bf16", tp=1, kernels=Kernels())


def test_loss_parallel_temporaries_are_the_planners(tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        cfg = get_preset("tiny")
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        full = torch.randn(B, S, cfg.vocab_size, dtype=torch.bfloat16)
        logits = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
        targets = distribute_tensor(torch.randint(0, cfg.vocab_size, (B, S)), mesh, [Replicate()])
        measured = _loss_temporaries(logits, targets, split=True)
    finally:
        dist.destroy_process_group()
    # One rank holds the whole vocabulary here; at tp ranks each holds 1/tp of it.
    tp = 2
    kernels = Kernels(vocab_parallel=True, loss_parallel=True)
    predicted = tp * loss_transient_bytes(cfg, B, S, "bf16", tp=tp, kernels=kernels)
    assert predicted == 12 * B * S * cfg.vocab_size
    # beside them, per token: the targets' masks and indices (int64, bool), left out
    assert predicted <= measured <= predicted + 40 * B * S
