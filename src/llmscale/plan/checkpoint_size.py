"""Bytes of one checkpoint on disk, from the states it holds (torch-free).

What `train/checkpoint.py` saves (DCP, `torch.distributed.checkpoint`), per parameter tensor:

- the model entry: fp32 (4 B per element: the parameters are the master weights), except under
  `optimizer.offload` without FSDP2's CPU offload, where the device keeps param_dtype copies
  (2 B under bf16/fp16) and the fp32 master is an optimizer entry of its own;
- AdamW's exp_avg and exp_avg_sq (fp32, 8 B per element) and its 0-d fp32 `step`;
- the param group's hyper-parameters, one small pickled entry per key per tensor (DCP flattens
  the optimizer state by parameter name): `PARAM_GROUP_KEYS` of them for torch's AdamW,
  `OFFLOAD_PARAM_GROUP_KEYS` for the offloaded one (`offload/adamw.py`);

and once per job the trainer's entries (step, data position, loss scaler, LR scheduler).

Format overhead, measured with torch 2.x's FileSystemWriter (one `torch.save` record per
entry, and a `.metadata` pickle listing every entry): about `TENSOR_ENTRY_BYTES` per tensor
entry and chunk, `BYTES_ENTRY_BYTES` per pickled value, `METADATA_ENTRY_BYTES` per entry in
`.metadata`. For a small model the overhead is a quarter of the checkpoint; for a large one it
vanishes. Sharded tensors (FSDP over dp_shard x cp, TP) are written as one chunk per shard, each
with its own record; replicated values are written once.
"""

from __future__ import annotations

from llmscale.config import JobConfig

PARAM_GROUP_KEYS = 12  # torch AdamW: lr, betas, eps, weight_decay, amsgrad, ... initial_lr
OFFLOAD_PARAM_GROUP_KEYS = 5  # OffloadedAdamW: lr, betas, eps, weight_decay, initial_lr
TRAINER_ENTRIES = 13  # step, data (2), loss scaler (3), LR scheduler (7)
TENSOR_ENTRY_BYTES = 1577
BYTES_ENTRY_BYTES = 1261
METADATA_ENTRY_BYTES = 228
MANIFEST_FILE_BYTES = 160  # manifest.json: header plus one line per file


def param_tensors(cfg: JobConfig) -> tuple[int, int]:
    """(parameter tensors, parameter elements) of the whole model."""
    m = cfg.model
    shapes = m.parameter_shapes()
    n_tensors = len(shapes["embedding"]) + m.n_layers * len(shapes["block"]) + len(shapes["head"])
    return n_tensors, m.num_params()


def checkpoint_bytes(cfg: JobConfig) -> int:
    """Predicted bytes of one checkpoint of `cfg`'s job (all ranks' files together)."""
    n_tensors, n_elems = param_tensors(cfg)
    offload_master = cfg.optimizer.offload != "none" and not cfg.fsdp_cpu_offload
    low_precision = cfg.precision.mode in ("bf16", "fp16", "fp8", "nvfp4")
    model_bytes = 2 if offload_master and low_precision else 4
    # exp_avg, exp_avg_sq (+ the master under offload): fp32.
    optim_elem_bytes = 8 + (4 if offload_master else 0)
    optim_tensors = 3 + (1 if offload_master else 0)  # + the 0-d step
    data = n_elems * (model_bytes + optim_elem_bytes) + n_tensors * 4  # 0-d fp32 steps
    p = cfg.parallel
    chunks = (
        p.dp_shard * p.cp * p.tp
    )  # records per sharded tensor (an upper bound: some stay whole)
    tensor_entries = n_tensors * (1 + optim_tensors)
    group_keys = OFFLOAD_PARAM_GROUP_KEYS if offload_master else PARAM_GROUP_KEYS
    bytes_entries = n_tensors * group_keys + TRAINER_ENTRIES
    overhead = (
        tensor_entries * chunks * TENSOR_ENTRY_BYTES
        + bytes_entries * BYTES_ENTRY_BYTES
        + (tensor_entries + bytes_entries) * METADATA_ENTRY_BYTES
        + MANIFEST_FILE_BYTES
    )
    return int(data + overhead)
