"""What every pipeline rank holds besides saved activations, measured and predicted, per schedule.

    python -m llmscale.bench.pipeline_memory --pp 4 --microbatches 8 [--seq-len 32]
        [--schedules gpipe,1f1b,...] [--work-dir DIR] [--json-out docs/results/pipeline_memory.json]

Runs the pipeline suite's memory runs (`bench.pipeline.memory_args`: the tiny model with 8
layers, one sequence per micro-batch, CPU, gloo) of each schedule for two steps in one
torchrun group of `pp` processes. Each rank writes its last metrics row. For every rank it then
prints `pending_weight_grad_bytes` (what split backwards keep from B),
`pipeline_buffer_bytes` (the receive buffers) and `activation_peak_bytes`, each measured and
predicted (`plan.predict.expected_runtime_metrics`), with their ratio. The pipeline suite
itself reads rank 0 only; this prints every rank. With --json-out it merges its rows into that
file, from which `make docs` renders the table in docs/schedule.md, "Memory of the split
schedules".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from llmscale.bench.pipeline import PipeConfig, memory_args
from llmscale.bench.report import Row
from llmscale.bench.runner import BenchOptions
from llmscale.bench.timed import now_iso
from llmscale.config import PP_SCHEDULES, to_toml

SUITE = "pipeline_memory"
KEYS = ("pending_weight_grad_bytes", "pipeline_buffer_bytes", "activation_peak_bytes")


def worker(spec_path: str) -> None:
    """One rank: train each configuration two steps; write this rank's last row."""
    import torch
    import torch.distributed as dist

    from llmscale.config import load_config
    from llmscale.train.trainer import Trainer

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    for path in spec["configs"]:
        with Trainer(load_config(path)) as t:
            row: dict[str, object] = {}
            for _ in range(t.cfg.train.steps):
                row = t.train_step()
            out = Path(spec["out"], f"{Path(path).stem}.rank{t.dims.pp_rank}.json")
            out.write_text(json.dumps({k: row.get(k) for k in KEYS}))
        dist.barrier()
    dist.destroy_process_group()


def measure(
    pp: int, m: int, seq_len: int, schedules: list[str], work: Path
) -> list[dict[str, Any]]:
    """Run the memory runs; a row (results.json's schema) per schedule, rank and KEYS entry:
    config "pp=P m=M SCHEDULE rank R", measured and predicted bytes."""
    from llmscale.plan import activations as act
    from llmscale.plan.memory import MemoryOptions
    from llmscale.plan.predict import as_plan, expected_runtime_metrics

    opts = BenchOptions(model="tiny", seq_len=seq_len, steps=2, warmup=0, data_files=8,
                        png_dir=None, work_dir=work)  # fmt: skip
    configs, paths = [], []
    for s in schedules:
        c = PipeConfig(pp, s, m)
        cfg = opts.job(*memory_args(c), run=c.name)
        path = work / f"{c.name}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(to_toml(cfg))
        configs.append((c, cfg))
        paths.append(str(path))
    spec = work / "pipeline-memory.json"
    spec.write_text(json.dumps({"configs": paths, "out": str(work)}))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(pp), "-m", "llmscale.bench.pipeline_memory", "--worker", str(spec),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"torchrun failed ({r.returncode}):\n{r.stderr[-4000:]}")
    options = MemoryOptions(kernels=act.RUNTIME_CPU)  # the ranks run on the CPU
    rows = []
    for c, cfg in configs:
        plan = as_plan(cfg)
        for rank in range(pp):
            got = json.loads((work / f"{c.name}.rank{rank}.json").read_text())
            want = expected_runtime_metrics(plan, rank, options)
            config = f"pp={pp} m={m} {c.schedule} rank {rank}"
            rows += [Row(SUITE, config, k, "B", got[k], want[k]).to_dict() for k in KEYS]
    return rows


def lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per schedule and rank: each key's measured / predicted (ratio)."""
    by: dict[str, list[str]] = {}
    for r in rows:
        g, p = r["measured"], r["predicted"]
        ratio = f"{p / g:.4f}" if g else ("1" if p == 0 else "-")
        by.setdefault(r["config"], []).append(f"{r['quantity']} {g} / {p:.0f} ({ratio})")
    return [f"{config}: " + "; ".join(cells) for config, cells in by.items()]


def record(path: Path, rows: list[dict[str, Any]], pp: int, m: int, measured_at: str) -> None:
    """Merge this run's rows into `path` (docs/results/pipeline_memory.json), replacing an
    earlier run of the same pp and m."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    suite = data.get(SUITE) or {
        "title": "What pipeline ranks hold besides saved activations, per schedule (bytes)",
        "rows": [], "tables": {}, "figures": [],
        "notes": ["python -m llmscale.bench.pipeline_memory --json-out: the tiny model with 8 "
                  "layers, seq 32, one sequence per micro-batch, fp32, CPU, gloo; the last of 2 "
                  "steps, every rank; docs/schedule.md renders its tables from these rows."],
    }  # fmt: skip
    head = f"pp={pp} m={m} "
    suite["rows"] = [r for r in suite["rows"] if not r["config"].startswith(head)] + rows
    suite.setdefault("measured_at_by_run", {})[f"pp={pp} m={m}"] = measured_at
    suite["measured_at"] = measured_at
    data[SUITE] = suite
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--schedules", default=",".join(PP_SCHEDULES))
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument(
        "--json-out", type=Path, default=None,
        help="also merge the rows into this file (docs/results/pipeline_memory.json)",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker)
        return
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="pipeline-memory-"))
    rows = measure(a.pp, a.microbatches, a.seq_len, a.schedules.split(","), work)
    print("measured / predicted (ratio), bytes; the last of 2 steps")
    for line in lines(rows):
        print(line)
    if a.json_out:
        record(a.json_out, rows, a.pp, a.microbatches, now_iso())
        print(f"wrote {a.json_out}")


if __name__ == "__main__":
    main()
