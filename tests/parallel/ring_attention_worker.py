"""One rank of the ring-attention test: ring attention against full causal attention.

    torchrun --nproc-per-node 4 tests/parallel/ring_attention_worker.py OUT.json

Every rank draws the same full q, k, v (and output gradient) from one seed, computes the full
causal attention and its gradients with `F.scaled_dot_product_attention`, then ring attention on
its load-balanced share, over the whole world (cp = 4) and over pairs of ranks (cp = 2). Rank 0
writes the largest relative errors of the output and of dq, dk, dv (each rank's share compared
with the same columns of the full result), per case.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmscale.parallel.context_parallel import load_balanced_indices, ring_attention


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm() / b.norm()).item())


def case(group, cp: int, rank: int, heads: int, kv_heads: int, dtype: torch.dtype) -> float:
    g = torch.Generator().manual_seed(1234 + heads + kv_heads)
    b, s, d = 2, 32, 16
    q = torch.randn(b, heads, s, d, generator=g)
    k = torch.randn(b, kv_heads, s, d, generator=g)
    v = torch.randn(b, kv_heads, s, d, generator=g)
    dout = torch.randn(b, heads, s, d, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=kv_heads < heads)
    out.backward(dout)
    idx = load_balanced_indices(s, cp, rank)
    local = [t[:, :, idx].to(dtype).clone().requires_grad_() for t in (q, k, v)]
    lout = ring_attention(*local, group)
    lout.backward(dout[:, :, idx].to(dtype))
    errs = [rel(lout.float(), out[:, :, idx].detach())]
    errs += [rel(t.grad.float(), f.grad[:, :, idx]) for t, f in zip(local, full, strict=True)]
    return max(errs)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
    results = {}
    for heads, kv_heads in ((4, 4), (4, 2)):
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"h{heads}_kv{kv_heads}_{str(dtype).split('.')[-1]}"
            results[f"cp{world}_{tag}"] = case(
                dist.group.WORLD, world, rank, heads, kv_heads, dtype
            )
            if pairs:
                group = pairs[rank // 2]
                results[f"cp2_{tag}"] = case(group, 2, rank % 2, heads, kv_heads, dtype)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        worst = {k: max(r[k] for r in gathered) for k in results}
        with open(sys.argv[1], "w") as f:
            json.dump(worst, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
