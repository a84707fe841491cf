"""Multi-process test harness: torchrun subprocesses on gloo, a free port each."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from llmscale.bench.jobs import short_job

HERE = Path(__file__).parent
WORKER = HERE / "layout_worker.py"

# Every layout test trains the same job: the tiny preset, fp32, 5 steps of a global batch of 8
# sequences of 32 tokens in micro-batches of 2 (so DP and PP layouts accumulate, too).
BASE = short_job(
    train__steps=5,
    train__micro_batch_size=2,
    train__global_batch_size=8,
    train__eval_sequences=8,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env() -> dict[str, str]:
    # One thread per rank: up to 8 ranks share this machine's few cores.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        *args,
    ]  # fmt: skip
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=timeout,
        cwd=HERE.parent.parent,
    )
    assert r.returncode == 0, (
        f"torchrun failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    )
    return r


def run_layouts(
    nproc: int,
    out: Path,
    layouts: list[dict[str, Any]],
    timeout: float = 240,
    base: list[str] | None = None,
    worker: Path = WORKER,
) -> dict[str, dict[str, Any]]:
    """Train each layout in turn in one process group (`base` overrides, BASE by default, then
    the layout's); results by layout name.

    A result merges the per-stage files: losses and events of the first stage's writer, and the
    parameters of all stages (each name must come from exactly one stage); `stages` keeps each
    pipeline rank's payload but its parameters (a worker's own entries among them).
    """
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    base = BASE if base is None else base
    spec.write_text(json.dumps({"out": str(out), "base": base, "layouts": layouts}))
    torchrun(nproc, str(worker), str(spec), timeout=timeout)
    results: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        name = layout["name"]
        files = sorted(out.glob(f"{name}.stage*.pt"))
        assert files, f"{name}: no results written"
        merged: dict[str, Any] = {
            "params": {},
            "stage_events": [],
            "activation_peaks": [],
            "first_rows": [],
            "stages": [],
        }
        for f in files:
            d = torch.load(f, weights_only=False)
            dup = set(d["params"]) & set(merged["params"])
            assert not dup, f"{name}: {sorted(dup)[:3]} held by two pipeline stages"
            merged["params"].update(d["params"])
            merged["stage_events"].append(d["events"])
            merged["activation_peaks"].append(d.get("activation_peak"))  # by pipeline rank
            merged["first_rows"].append(d.get("first_row"))  # metrics of step 1, by pp rank
            merged["stages"].append({k: v for k, v in d.items() if k != "params"})
            for k in ("losses", "val_loss", "steps_done"):
                merged.setdefault(k, d[k])
                assert d[k] == merged[k], f"{name}: stages disagree on {k}"
        merged["run_dir"] = out / layout.get("run", name)
        results[name] = merged
    return results


RTOL = 1e-5
# Gathered weights after the run's AdamW steps. AdamW divides each gradient element by its own
# running magnitude, so a float rounding difference in a small gradient element moves its weight
# by up to the learning rate, whatever the element's size: the weights agree less tightly than
# the losses. Tensor-parallel layouts end with one GQA value projection (layers.1's wv) 1.1-1.4e-5
# from one process on some hosts (a 2-core Xeon, 2026-12-05) and under 1e-5 on others; every
# other weight, and every loss, within 1e-5.
PARAM_RTOL = 5e-5


def single_process_reference(run_dir: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The BASE job (plus `extra` overrides) in this process: its losses, validation loss and
    final parameters."""
    from llmscale.config import load_config
    from llmscale.train.trainer import Trainer

    t = Trainer(load_config(None, [*BASE, *extra, "--job.run_dir", str(run_dir)]))
    r = t.fit()
    params = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    return {"losses": r.losses, "val_loss": r.val_loss, "params": params}


def rel_error(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        return float(((a - b).norm() / b.norm()).item())
    return float(abs(a - b) / abs(b))


def assert_same_run(
    got: dict[str, Any], ref: dict[str, Any], name: str, rtol: float = RTOL, steps: int = 5
) -> None:
    """Same `steps` losses and validation loss as the reference, to rtol, and gathered
    parameters to rtol or `PARAM_RTOL`, whichever is looser."""
    assert got["steps_done"] == steps, name
    assert len(got["losses"]) == len(ref["losses"]) == steps, name
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True), 1):
        assert rel_error(a, b) < rtol, f"{name} step {step}: loss {a} vs {b}"
    assert rel_error(got["val_loss"], ref["val_loss"]) < rtol, (
        name,
        got["val_loss"],
        ref["val_loss"],
    )
    assert set(got["params"]) == set(ref["params"]), name
    for k, want in ref["params"].items():
        have = got["params"][k]
        assert have.shape == want.shape, (name, k)
        rel = rel_error(have, want)
        assert rel < max(rtol, PARAM_RTOL), f"{name} {k}: relative error {rel:.2e}"
