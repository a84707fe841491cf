"""Under FSDP2 each rank offloads its own shard: 2 processes, gloo, CPU.

The model is sharded here with `fully_shard` per block and at the root (as torchtitan does),
standing in for the parallel branch's `parallelize` until it lands.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from llmscale.config import OptimizerSection, PrecisionSection
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.offload import OffloadedAdamW, unscale_and_clip
from llmscale.train.optim import build_optimizer as torch_adamw
from llmscale.train.precision import DynamicLossScaler

CFG = get_preset("tiny").with_overrides(n_layers=2, max_seq_len=32)
WORLD = 2
HP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _sharded_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = build_model(CFG, seed=1)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batches(rank: int, steps: int, micro: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [
        [torch.randint(0, CFG.vocab_size, (2, 17), generator=g) for _ in range(micro)]
        for _ in range(steps)
    ]


def _run(model, opt, batches, offloaded: bool) -> list[float]:
    params = list(model.parameters())
    scaler = DynamicLossScaler(PrecisionSection(), enabled=False)
    losses = []
    for micro in batches:
        for mb in micro:
            loss = F.cross_entropy(model(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten())
            (loss / len(micro)).backward()
            losses.append(loss.item())
        if offloaded:
            found, _ = unscale_and_clip([opt], scaler, 0.5, stage_size=WORLD)
            assert not found
        else:
            torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if offloaded:
        opt.synchronize()
    return losses


def _offloaded(model) -> OffloadedAdamW:
    return OffloadedAdamW(model.named_parameters(), **HP, accum_steps=2, kernel="exact").attach(
        model
    )


def _local_params(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _worker(rank: int, init: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import llmscale.train.checkpoint as ck

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        batches = _batches(rank, 4, 2)
        ref = _sharded_model()
        ref_losses = _run(ref, torch_adamw(ref, OptimizerSection(**_section())), batches, False)

        model = _sharded_model()
        opt = _offloaded(model)
        wait_points = {u.name: [type(m).__name__ for m in u.modules] for u in opt.units}
        losses = _run(model, opt, batches[:2], True)
        saver = ck.Checkpointer(Path(out) / "ckpt")
        model_sd, optim_sd = get_state_dict(model, opt)
        saver.save(2, {"model": model_sd, "optim": optim_sd})
        losses += _run(model, opt, batches[2:], True)

        # Resume into a fresh sharded model and optimizer; run the last two steps again.
        fresh = _sharded_model()
        fresh_opt = _offloaded(fresh)
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        state = {"model": model_sd, "optim": optim_sd}
        saver.load(saver.path_for(2), state)
        set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        resumed = _run(fresh, fresh_opt, batches[2:], True)

        torch.save(
            {
                "ref_losses": ref_losses,
                "losses": losses,
                "resumed": resumed,
                "ref": _local_params(ref),
                "params": _local_params(model),
                "fresh": _local_params(fresh),
                "masters": [opt.state[p]["master"].clone() for p in model.parameters()],
                "local_numel": sum(p.to_local().numel() for p in model.parameters()),
                "memory": opt.memory_report(),
                "wait_points": wait_points,
                "update_order": [u.name for u in opt._update_order],
            },
            Path(out) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def _section() -> dict:
    return {"lr": HP["lr"], "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.slow
def test_each_rank_offloads_its_shard_and_matches_fsdp_adamw(tmp_path) -> None:
    mp.start_processes(
        _worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn"
    )
    n = CFG.num_params()
    total_local = 0
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # Same data, same weights: the loss sequence of FSDP2 + torch AdamW, to 1e-6.
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6, abs=0)
        assert r["losses"][:2] == r["ref_losses"][:2]
        for p, q, m in zip(r["params"], r["ref"], r["masters"], strict=True):
            rel = ((p - q).norm() / q.norm()).item() if q.numel() else 0.0
            assert rel < 1e-6 and torch.equal(p, m)
        # Resuming from the DCP checkpoint of step 2 redoes steps 3-4 bit for bit.
        assert r["resumed"] == r["losses"][4:]
        assert all(torch.equal(a, b) for a, b in zip(r["fresh"], r["params"], strict=True))
        # The rank's ledger: 12 bytes per parameter of its own shard, nothing on the device.
        mem, local = r["memory"], r["local_numel"]
        tensors = len(r["params"])
        assert mem["host_master_bytes"] + mem["host_optimizer_bytes"] == 12 * local + 4 * tensors
        assert mem["device_optimizer_bytes"] == mem["device_master_bytes"] == 0
        assert math.isclose(local, n / WORLD, rel_tol=0.01)
        total_local += local
        # Blocks are waited for at their own fully_shard-ed module, embed and head at the
        # root (its all-gather reads them both), so those two are updated first.
        assert r["wait_points"]["layers.0"] == ["FSDPTransformerBlock"]
        assert r["wait_points"]["head"] == [] and r["update_order"][:2] == ["embed", "head"]
    assert total_local == n
