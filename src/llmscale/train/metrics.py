"""Per-step metrics: throughput, FLOP/s and MFU, memory; written as JSONL.

`offload_bytes_moved` (every row): bytes copied between device and host in the step, both
directions (`Optimizers.offload_bytes_moved`; docs/offload.md, "Bytes moved").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmscale.errors import ExitCode, JobStopped
from llmscale.tensors import tensor_bytes


def param_bytes(modules: Iterable[nn.Module]) -> int:
    return tensor_bytes(p for m in modules for p in m.parameters())


def grad_bytes(modules: Iterable[nn.Module]) -> int:
    return tensor_bytes(p.grad for m in modules for p in m.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor optimizer state (Adam's moments; the 0-d `step` counters are included)."""
    return tensor_bytes(
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def peak_flops_for_device(device: torch.device, configured_tflops: float) -> float | None:
    """Peak dense FLOP/s for MFU: the configured figure, else the catalog's for a known GPU."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    try:
        from llmscale.hardware.catalog import gpu_for_device_name
    except ImportError:
        return None
    gpu = gpu_for_device_name(torch.cuda.get_device_name(device))
    return gpu.peak_flops("bf16") if gpu is not None else None


class JsonlWriter:
    """Appends one JSON object per line; rows are flushed at once so a killed run keeps them."""

    def __init__(self, path: str | Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._fh: Any = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps(_finite(row)) + "\n")
            self._fh.flush()
        except OSError as e:
            # A full disk: one line; the torn row it may leave is dropped by the next --resume.
            raise JobStopped(
                f"writing {self.path} failed: {e.strerror or e}; the checkpoints written so far "
                "are kept: free space, then continue with --resume",
                ExitCode.FAILURE,
            ) from None

    def close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            # The failed write's bytes, still buffered, fail again: write() said so already.
            with contextlib.suppress(OSError):
                fh.close()


class TensorBoardWriter:
    """The metrics rows as TensorBoard scalars under one folder (`tensorboard --logdir runs/`).

    Tags: train/loss, train/lr, train/grad_norm, train/loss_scale, train/tokens_per_s, train/mfu
    (when a peak is known), val/loss, offload/bytes_moved, and memory/<key> for every *_bytes
    figure of the row. A run
    resumed at step s drops the events after s that the interrupted run had written (`purge_step`),
    as metrics.jsonl drops its rows.
    """

    SCALARS = {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "loss_scale": "train/loss_scale",
        "tokens_per_s": "train/tokens_per_s",
        "mfu": "train/mfu",
        "val_loss": "val/loss",
        "offload_bytes_moved": "offload/bytes_moved",
        # data-parallel collectives per step (stack/residency.py): traffic, not memory
        "param_allgathers": "comm/param_allgathers",
        "grad_reduces": "comm/grad_reduces",
        "param_allgather_bytes": "comm/param_allgather_bytes",
        "grad_reduce_bytes": "comm/grad_reduce_bytes",
        "grad_allreduces": "comm/grad_allreduces",
        "grad_allreduce_bytes": "comm/grad_allreduce_bytes",
    }

    def __init__(self, folder: str | Path, resumed_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder)
        self._w: Any = SummaryWriter(
            str(self.folder), purge_step=resumed_step + 1 if resumed_step else None
        )

    def write(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        for key, value in row.items():
            tag = self.SCALARS.get(key) or (f"memory/{key}" if key.endswith("_bytes") else None)
            if tag and isinstance(value, int | float) and not isinstance(value, bool):
                self._w.add_scalar(tag, float(value), step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class RunWriter:
    """Where rank 0 writes each metrics row: metrics.jsonl, and TensorBoard when asked."""

    def __init__(
        self,
        jsonl_path: str | Path,
        tensorboard_dir: str | Path | None = None,
        enabled: bool = True,
        resumed_step: int = 0,
    ) -> None:
        self.jsonl = JsonlWriter(jsonl_path, enabled=enabled)
        self.tensorboard = (
            TensorBoardWriter(tensorboard_dir, resumed_step)
            if enabled and tensorboard_dir is not None
            else None
        )

    def write(self, row: dict[str, Any]) -> None:
        self.jsonl.write(row)
        if self.tensorboard is not None:
            self.tensorboard.write(row)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def truncate_after(path: str | Path, step: int, say: Callable[[str], None] | None = None) -> None:
    """Drop the rows of steps after `step` (resuming from it redoes them) and a torn last line
    (a full disk or a host crash cut it), naming the latter through `say`.

    The file is repaired, never rewritten in place: the rows to drop are its tail (rows are
    appended in step order), so it is cut at the first of them with one `truncate` call, and a
    kill at any moment leaves every row before it. An unreadable line inside the file is kept.
    Should rows of later steps come before kept ones (a file edited by hand), the kept rows go
    to a new file that replaces the old one only once written (fsync, rename).
    """
    p = Path(path)
    if not p.is_file():
        return
    data = p.read_bytes()
    lines: list[tuple[int, bytes]] = []  # (offset, line without its newline)
    at = 0
    for raw in data.split(b"\n"):
        lines.append((at, raw))
        at += len(raw) + 1
    rows: list[tuple[int, bytes, dict[str, Any] | None]] = []
    for offset, raw in lines:
        if not raw.strip(b" \t\r"):
            continue
        try:
            row = json.loads(raw)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            row = None
        rows.append((offset, raw, row if isinstance(row, dict) else None))
    cut = len(data)
    if rows and rows[-1][2] is None:  # a torn (or zeroed) last line
        offset, raw, _ = rows.pop()
        cut = offset
        if say is not None:
            say(f"{p}: dropped a torn last line ({len(raw)} B that are no JSON row)")
    later = [
        i for i, (_, _, row) in enumerate(rows) if row is not None and row.get("step", 0) > step
    ]
    if later and all(r is None or r.get("step", 0) > step for _, _, r in rows[later[0] :]):
        cut = rows[later[0]][0]
    elif later:
        kept = [raw for _, raw, r in rows if r is None or r.get("step", 0) <= step]
        tmp = p.with_name(p.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(b"".join(raw + b"\n" for raw in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        return
    with p.open("r+b") as f:
        if cut < len(data):
            f.truncate(cut)
        if cut and data[cut - 1 : cut] != b"\n":  # a complete last row without its newline
            f.seek(cut)
            f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf/nan: write them as strings so the file stays valid."""
    return {
        k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
    }
