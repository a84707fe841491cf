"""Before a run allocates anything: will it fit? The planner's memory model against this machine.

`llmscale train` asks the planner (plan/memory.py, byte-exact against the trainer's own ledger
on CPU) what each rank will hold, and compares it with what the device has:

- CUDA: the fullest pipeline stage's predicted allocated peak against one GPU's memory (that
  rank would run out first; past it only with the caching allocator's share, a warning: the
  allocator flushes its cache before it fails); host bytes under offload, summed over this
  host's ranks, against its RAM;
- CPU: device and host are the same RAM, shared by every rank on this host: the job's total
  (each stage's bytes times its dp x tp ranks) over the hosts.

More than the device has at all: the run cannot fit, and `job.memory_check = "error"` (the
default) stops it with one line before the model is built, rather than an out-of-memory kill
minutes later. More than is free right now: a warning. A layout the planner does not model is
not checked (said once). The figures exclude the data (the token corpus) and the framework.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from llmscale.config import JobConfig
from llmscale.errors import ConfigError, UsageError
from llmscale.model.config import ModelConfig, get_preset
from llmscale.plan.memory import MemoryEstimate, estimate_memory
from llmscale.plan.predict import as_plan, runtime_options

GIB = 2**30


@dataclass(frozen=True)
class Capacity:
    """Bytes a device has in all, and free now (None: unknown)."""

    what: str
    total: int
    free: int | None


def host_capacity() -> Capacity:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    return Capacity("this host's RAM", total, free)


def cuda_capacity(device: torch.device) -> Capacity:
    free, total = torch.cuda.mem_get_info(device)
    return Capacity(torch.cuda.get_device_name(device), total, free)


def predicted_memory(cfg: JobConfig, device: torch.device) -> MemoryEstimate:
    """The planner's memory of `cfg`'s run on `device`'s kind (ConfigError where it does not
    model the layout)."""
    plan = as_plan(cfg)
    return estimate_memory(plan, runtime_options(plan, device.type))


def predicted_need(
    cfg: JobConfig, device: torch.device, memory: MemoryEstimate | None = None
) -> tuple[float, float]:
    """(bytes per GPU on the fullest stage, host bytes on this host) the planner predicts
    (from `memory`, `predicted_memory`'s, where the caller has it).

    On a GPU the first is the allocated peak: the caching allocator's share over it is a cache
    it flushes before it fails (`plan.memory.MemoryEstimate.fits`; the estimate's `total` adds
    it). On a CPU device both are host memory; the first is then 0 and the second the whole
    share of this host.
    """
    est = predicted_memory(cfg, device) if memory is None else memory
    plan, stages = est.plan, est.per_rank
    world = plan.world_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    ranks_per_stage = plan.dp * plan.cp * plan.tp  # the ranks of one pipeline stage
    hosts = max(1, world // max(1, local))
    if device.type == "cpu":
        job = sum((s.total + s.host) * ranks_per_stage for s in stages)
        return 0.0, job / hosts
    host = sum(s.host * ranks_per_stage for s in stages) / hosts
    return max(s.allocated for s in stages), host


def model_label(model: ModelConfig) -> str:
    """The preset's name, with the keys that reshape it (`tiny with dim=65536`)."""
    try:
        base = get_preset(model.name)
    except ConfigError:
        return model.name
    changed = [
        f"{f.name}={getattr(model, f.name)}"
        for f in dataclasses.fields(model)
        if getattr(model, f.name) != getattr(base, f.name)
    ]
    return f"{model.name} with {', '.join(changed)}" if changed else model.name


# The end of the "cannot fit" message: how `llmscale train` runs it anyway (bench, which has no
# such key, replaces it).
OVERRIDE_HINT = "--job.memory_check warn or off runs it anyway"


def check_memory(cfg: JobConfig, device: torch.device) -> list[str]:
    """Raise UsageError when the run cannot fit (mode "error"); the warnings to print otherwise."""
    mode = cfg.job.memory_check
    if mode == "off":
        return []
    try:
        memory = predicted_memory(cfg, device)
        per_gpu, host = predicted_need(cfg, device, memory)
    except ConfigError as e:
        return [f"memory check skipped: the planner does not model this layout ({e})"]
    host_label = (
        "all ranks on this host: states, activations and buffers"
        if device.type == "cpu"
        else "offloaded states of this host's ranks"
    )
    needs = [(host, host_capacity(), host_label)]
    if device.type == "cuda":
        needs.insert(0, (per_gpu, cuda_capacity(device), "the fullest GPU"))
    warnings = []
    for need, cap, label in needs:
        if need <= 0:
            continue
        say = (
            f"the planner predicts {need / GIB:.1f} GiB for {model_label(cfg.model)} in this layout "
            f"({label}); {cap.what} has {cap.total / GIB:.1f} GiB"
        )
        if need > cap.total:
            msg = (
                f"memory: {say}: it cannot fit. A smaller micro-batch, recomputation, more ranks, "
                f"FSDP or offload would help (llmscale plan); {OVERRIDE_HINT}"
            )
            if mode == "error":
                raise UsageError(msg)
            warnings.append(msg)
        elif cap.free is not None and need > cap.free:
            warnings.append(f"memory: {say}, {cap.free / GIB:.1f} GiB of it free now")
    if device.type == "cuda" and per_gpu > 0:
        cap, reserved = needs[0][1], memory.total
        if per_gpu <= cap.total < reserved:
            warnings.append(
                f"memory: tight: the planner predicts {per_gpu / GIB:.1f} GiB allocated on the "
                f"fullest GPU of {cap.total / GIB:.1f}, {reserved / GIB:.1f} with the caching "
                "allocator's usual share: it will free its cache and retry when short (a device "
                "synchronisation each); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids "
                "most fragments"
            )
    return warnings
