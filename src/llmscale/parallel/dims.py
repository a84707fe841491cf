"""Parallel state in one place: degrees, this rank's coordinates, the N-D device mesh.

The mesh has five named dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``,
``cp``, ``tp`` (as torchtitan orders them): tensor parallelism, the most talkative, on neighbouring
ranks (one node's fast links), then context parallelism's ring, pipeline stages furthest apart.
Under context parallelism the cp ranks hold the same parameters, so gradients are reduced over
them too: FSDP2 shards over the flattened ``dp_shard_cp`` mesh (dp_shard x cp, as torchtitan and
the planner's `Plan.fsdp_shards`), and without FSDP ``replicate`` runs over ``dp_cp``
(dp_replicate x cp). Every dimension is present even at
degree 1, so ``mesh["tp"]`` always exists; a size-1 dimension costs nothing at run time.

A single process (no ``WORLD_SIZE``, or ``WORLD_SIZE=1``) builds no process group and no mesh:
every rank number is 0 and every size 1, and the trainer runs as it always has.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from llmscale.config import V_SCHEDULES, MeshDegrees, ParallelSection
from llmscale.parallel import heartbeat

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def env_world_size() -> int:
    """Processes in the job as the launcher (torchrun, SLURM via torchrun) tells it."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device, timeout_seconds: float = 600.0) -> None:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); no-op alone.

    Call only after the config has been validated against the world size: a bad layout must
    fail with its one-line message, not hang waiting for peers.

    `timeout_seconds` (comm.timeout_seconds) bounds every wait on a peer: the rendezvous store,
    each collective of the world group and of the mesh's subgroups (gloo raises; NCCL's
    watchdog, with TORCH_NCCL_ASYNC_ERROR_HANDLING, tears the rank down), and the heartbeat
    (`parallel.heartbeat`) names the ranks that stopped answering.
    """
    if env_world_size() == 1 or dist.is_initialized():
        return
    pg_seconds, monitor_after = timeout_seconds, None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # gloo alongside NCCL so that a stray CPU-tensor collective still has a backend.
        backend = "cpu:gloo,cuda:nccl"
        # Async error handling (torch's default, 3: tear the process down) is what makes NCCL
        # honour the timeout at all; set it unless the user chose otherwise.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        # The heartbeat, which can name the lost rank, acts at the timeout; NCCL's watchdog
        # (SIGABRT, no name) three heartbeats later (parallel/heartbeat.py).
        monitor_after = timeout_seconds
        pg_seconds += 3 * heartbeat.interval_for(timeout_seconds)
    else:
        backend = "gloo"  # raises at the timeout; the heartbeat then names the lost ranks
    timeout = timedelta(seconds=pg_seconds)
    # The mesh's subgroups are made by new_group without a timeout (torch 2.13's DeviceMesh
    # passes one only from pg_options), which means torch's module default: make it ours.
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rendezvous_store(rank, world_size, timeout)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    # The heartbeat thread talks over a connection of its own: a store client serialises its
    # requests, and the main thread may be blocked in a long `wait` on it.
    heartbeat.start(store.clone(), rank, world_size, timeout_seconds, monitor_after)


def job_store() -> Any:
    """The job's store without the attempt's prefix (what every attempt of a job restarted by
    torchrun's agent shares); None without a process group."""
    if not dist.is_initialized():
        return None
    store = c10d._get_default_store()
    # The process group's prefix, then the attempt's (rendezvous_store): the TCPStore under them.
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def rendezvous_store(rank: int, world_size: int, timeout: timedelta) -> Any:
    """The job's c10d store (MASTER_ADDR:MASTER_PORT), keyed by torchrun's restart attempt.

    torchrun's agent hosts one TCPStore for the whole job and keeps it across restarts
    (`--max-restarts`); `init_process_group`'s own env:// rendezvous uses it unprefixed, so a
    restarted worker can read the address a dead worker of the previous attempt published and
    fail with gloo's "Connection refused". A prefix per attempt (TORCHELASTIC_RESTART_COUNT)
    gives each attempt keys of its own. Without torchrun's agent, rank 0 hosts the store.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0 and not agent,
        timeout=timeout,
        multi_tenant=True,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"llmscale/attempt-{attempt}", store)


@dataclass
class ParallelDims(MeshDegrees):
    """Degrees of the job and, once `build_mesh` ran, this rank's place in the mesh."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1  # context parallelism: each sequence over cp ranks (ring attention)
    tp: int = 1
    mesh: Any = field(default=None, repr=False)  # DeviceMesh, or None for one process
    # Stages placed in a V (zbv, dualpipev): the last stage, and so the loss, is on pp rank 0.
    v_pipeline: bool = False
    _embedding_group: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_config(cls, p: ParallelSection) -> ParallelDims:
        return cls(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp,
                   v_pipeline=p.pp_schedule in V_SCHEDULES)  # fmt: skip

    @property
    def loss_pp_rank(self) -> int:
        """The pp rank holding the last stage: pp - 1, or 0 when the stages are placed in a V."""
        return 0 if self.v_pipeline else self.pp - 1

    # ---- degrees (dp, world_size and fsdp from MeshDegrees) ----------------------------------
    @property
    def stage_size(self) -> int:
        """Ranks that hold (a shard or a copy of) each parameter of one pipeline stage."""
        return self.dp * self.cp * self.tp

    @property
    def reduces_grads(self) -> bool:
        """Gradients are reduced over ranks (FSDP2 or replicate wraps the model): dp x cp > 1."""
        return self.dp * self.cp > 1

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def describe(self) -> str:
        """'pp=2 dp_shard=2 tp=2 (8 ranks)': the degrees that are not 1."""
        parts = [f"{n}={getattr(self, n)}" for n in MESH_AXES if getattr(self, n) > 1]
        return f"{' '.join(parts) or 'single process'} ({self.world_size} ranks)"

    # ---- the mesh ---------------------------------------------------------------------------
    def build_mesh(self, device: torch.device) -> None:
        """Create the 5-D mesh over the initialised process group (nothing for one process),
        and under cp > 1 the flattened mesh the gradients are reduced over."""
        if self.world_size == 1:
            self.mesh = None
            return
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(
            device.type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_AXES,
        )
        if self.cp > 1:  # flattened on the root mesh, where torch wants it
            if self.dp_shard > 1:
                self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            else:
                self.mesh["dp_replicate", "cp"]._flatten("dp_cp")

    def _local(self, dim: str) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank(dim)

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.mesh is not None else 0

    @property
    def pp_rank(self) -> int:
        return self._local("pp")

    @property
    def tp_rank(self) -> int:
        return self._local("tp")

    @property
    def cp_rank(self) -> int:
        return self._local("cp")

    def cp_group(self) -> dist.ProcessGroup:
        assert self.mesh is not None and self.cp > 1, "no cp group"
        group: dist.ProcessGroup = self.mesh.get_group("cp")
        return group

    def cp_shard(self, t: torch.Tensor) -> torch.Tensor:
        """This cp rank's load-balanced share of the sequence dim (dim 1) of `t`; `t` alone
        without context parallelism."""
        if self.cp == 1:
            return t
        from llmscale.parallel.context_parallel import shard_sequence

        return shard_sequence(t, self.cp, self.cp_rank, dim=1)

    @property
    def dp_rank(self) -> int:
        """This rank's slice of the global batch: (replica, shard) flattened, as the data uses."""
        return self._local("dp_replicate") * self.dp_shard + self._local("dp_shard")

    def submesh(self, *dims: str) -> Any:
        assert self.mesh is not None, "no mesh in a single process"
        return self.mesh[dims[0]] if len(dims) == 1 else self.mesh[dims]

    def dp_mesh(self) -> Any:
        """The mesh FSDP2 / replicate run over: 1-D for FSDP or DP, 2-D (replicate, shard) for HSDP.

        Under cp > 1 the shard dimension is dp_shard x cp (`dp_shard_cp`), and without FSDP
        replicate runs over dp_replicate x cp (`dp_cp`)."""
        shard = "dp_shard_cp" if self.cp > 1 else "dp_shard"
        if self.dp_shard > 1 and self.dp_replicate > 1:
            dims: tuple[str, ...] = ("dp_replicate", shard)
        elif self.dp_shard > 1:
            dims = (shard,)
        else:
            dims = ("dp_cp" if self.cp > 1 else "dp_replicate",)
        # torch 2.13 warns that slicing a flattened dimension from the root mesh will go (in
        # 2.11, it says); it is how torchtitan reaches dp_shard_cp, and works.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.submesh(*dims)

    def pp_group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is None or self.pp == 1 else self.mesh.get_group("pp")

    def embedding_group(self) -> dist.ProcessGroup | None:
        """Megatron's embedding group: the two ranks, at this rank's data, context and tensor
        coordinates, that hold the first and the last pipeline stage (pp ranks 0 and pp - 1),
        for a tied embedding's two copies. None without a pipeline or in a V (both stages on pp
        rank 0). A collective the first time (every rank makes every pair's group); kept."""
        if self.mesh is None or self.pp == 1 or self.v_pipeline:
            return None
        if self.pp == 2:
            return self.pp_group()
        if self._embedding_group is None:
            me = dist.get_rank()
            columns = self.mesh.mesh.reshape(self.pp, -1)  # pp outermost: one column per coord
            for j in range(columns.shape[1]):
                pair = [int(columns[0, j]), int(columns[-1, j])]
                group = dist.new_group(pair)
                if me in pair:
                    self._embedding_group = group
        return self._embedding_group

    # ---- reductions over the whole job ------------------------------------------------------
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over every rank, in place (identity for one process)."""
        if self.mesh is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def holds_loss(self) -> bool:
        """The ranks that contribute the loss: the last stage's (pp rank 0 in a V) first TP rank
        of each data-parallel slice, and every cp rank of it (each holds part of each sequence)."""
        return self.pp_rank == self.loss_pp_rank and self.tp_rank == 0

    def global_mean_loss(self, local_loss: torch.Tensor) -> torch.Tensor:
        """The global batch's mean loss on every rank, from each replica's last pipeline stage.

        One all-reduce over the world: the ranks that `holds_loss` add loss / (dp x cp) (under
        context parallelism each holds the mean over the same number of tokens: its share of
        every sequence), every other rank adds 0 (its value may be a placeholder).
        """
        if self.mesh is None:
            return local_loss
        n = self.dp * self.cp
        contrib = local_loss.detach().float() / n if self.holds_loss() else None
        if contrib is None:
            contrib = torch.zeros((), device=local_loss.device)
        return self.all_reduce_sum(contrib.clone())

    def agree(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when any rank says True (e.g. a SIGTERM seen by some ranks only)."""
        if self.mesh is None:
            return flag
        t = torch.tensor(float(flag), device=device)
        return bool(self.all_reduce_max(t).item())
