"""What a run costs before its first step, on this machine: the figures README.md quotes.

- the calibration: the first run of a shape micro-benchmarks this machine on the runtime's own
  kernels (`train/calibration.py`'s `measure` at a run's effort, `QUICK`), here at the demo's
  shape (`configs/default.toml`: the tiny model, micro-batch 8 x 128 tokens, fp32);
- the probe that a later run times to decide whether the cached figures still hold
  (`probe_seconds`: the median wall time of `PROBE_CALLS` calls, and the median pass it
  returns);
- a prepared folder's verification (`data.prepared.verify_dataset`) of one shard of
  `--shard-mb` MB of uint16 ids just written (so read from the page cache), with an empty
  shard cache (the shard's sha256 and largest id are read), then again (the cache answers).

    python -m llmscale.bench.startup                     # print the figures
    python -m llmscale.bench.startup --json-out docs/results/pages-startup.json
                                # the record README.md's figures are rendered from (make docs)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmscale.bench.records import suite_record, write_record
from llmscale.config import load_config
from llmscale.paths import SOURCE_ROOT

SUITE = "startup"
RECORD = SOURCE_ROOT / "docs" / "results" / "pages-startup.json"
DEMO_CONFIG = SOURCE_ROOT / "configs" / "default.toml"
VOCAB = 300  # ids drawn below it, as a small tokenizer's would be


def calibration_seconds() -> tuple[float, dict[str, Any]]:
    """Wall seconds of the first run's calibration at the demo's shape, and that shape."""
    from llmscale.train.calibration import QUICK, measure

    cfg = load_config(DEMO_CONFIG if DEMO_CONFIG.is_file() else None)
    shape: dict[str, Any] = {
        "model": cfg.model.name,
        "micro_batch_size": cfg.train.micro_batch_size,
        "seq_len": cfg.data.seq_len,
        "precision": cfg.precision.mode,
    }
    t0 = time.perf_counter()
    measure(cfg.model, shape["micro_batch_size"], shape["seq_len"], shape["precision"],
            torch.device("cpu"), effort=QUICK)  # fmt: skip
    return time.perf_counter() - t0, shape


PROBE_CALLS = 5  # the probe's cost: the median wall time of this many calls


def probe_times() -> tuple[float, float]:
    """(median wall seconds of a `probe_seconds` call, what the median call returned: its
    median pass)."""
    from llmscale.train.calibration import probe_seconds

    calls = []
    for _ in range(PROBE_CALLS):
        t0 = time.perf_counter()
        median_pass = probe_seconds(torch.device("cpu"))
        calls.append((time.perf_counter() - t0, median_pass))
    return sorted(calls)[PROBE_CALLS // 2]


@contextmanager
def _cache_dir(path: Path) -> Iterator[None]:
    old = os.environ.get("LLMSCALE_CACHE_DIR")
    os.environ["LLMSCALE_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if old is None:
            del os.environ["LLMSCALE_CACHE_DIR"]
        else:
            os.environ["LLMSCALE_CACHE_DIR"] = old


def verify_times(shard_bytes: int) -> tuple[float, float]:
    """(seconds of the first verification of a folder with one shard of `shard_bytes` bytes, of
    the second), each `load_meta` + `verify_dataset` as a run opens the folder."""
    from llmscale.data.prepared import file_sha256, load_meta, verify_dataset

    with tempfile.TemporaryDirectory(prefix="llmscale-startup-") as tmp:
        root = Path(tmp) / "data"
        root.mkdir()
        n = shard_bytes // 2
        ids = np.random.default_rng(0).integers(0, VOCAB, n, dtype=np.uint16)
        ids.astype("<u2").tofile(root / "train-00000.bin")
        del ids
        (root / "tokenizer.json").write_text('{"startup": "a stand-in tokenizer file"}\n')
        meta = {
            "vocab_size": VOCAB, "dtype": "uint16", "eos_id": 0, "pad_id": 1,
            "tokenizer_sha256": file_sha256(root / "tokenizer.json"),
            "splits": {"train": {"tokens": n, "shards": ["train-00000.bin"],
                                 "shard_sha256": [file_sha256(root / "train-00000.bin")]}},
        }  # fmt: skip
        (root / "meta.json").write_text(json.dumps(meta))
        times = []
        with _cache_dir(Path(tmp) / "cache"):
            for _ in range(2):
                t0 = time.perf_counter()
                verify_dataset(load_meta(root))
                times.append(time.perf_counter() - t0)
        return times[0], times[1]


def record(argv: list[str], shard_mb: int) -> dict[str, Any]:
    """Every figure, as docs/results/pages-startup.json holds them."""
    before = os.getloadavg()[0]
    calibration_s, shape = calibration_seconds()
    probe_wall, probe_pass = probe_times()
    first, again = verify_times(shard_mb * 2**20)
    return suite_record(
        SUITE,
        "What a run costs before its first step",
        "llmscale.bench.startup",
        argv,
        (before, os.getloadavg()[0]),
        torch=torch.__version__,
        calibration={"seconds": calibration_s, **shape},
        probe={"seconds": probe_wall, "median_pass_seconds": probe_pass},
        verify={"shard_bytes": shard_mb * 2**20, "first_seconds": first, "again_seconds": again},
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.bench.startup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shard-mb", type=int, default=256, help="the shard's size, MiB (256)")
    ap.add_argument(
        "--json-out",
        type=Path,
        help="write the figures as a record (docs/results/pages-startup.json: make docs renders "
        "README.md's figures from it)",
    )
    args = ap.parse_args(argv)
    if args.shard_mb < 1:
        ap.error(f"--shard-mb: got {args.shard_mb}; allowed: an integer >= 1")
    rec = record(sys.argv[1:] if argv is None else argv, args.shard_mb)[SUITE]
    c, p, v = rec["calibration"], rec["probe"], rec["verify"]
    print(f"calibration at {c['model']} {c['micro_batch_size']} x {c['seq_len']} "
          f"{c['precision']}: {c['seconds']:.2f} s")  # fmt: skip
    print(
        f"probe: {1e3 * p['seconds']:.0f} ms (median pass {1e3 * p['median_pass_seconds']:.1f} ms)"
    )
    print(f"verify a {v['shard_bytes'] / 2**20:.0f} MiB shard: {v['first_seconds']:.3f} s, "
          f"again {1e3 * v['again_seconds']:.2f} ms")  # fmt: skip
    print(f"load average {rec['load_average'][0]:.2f} -> {rec['load_average'][1]:.2f}")
    if args.json_out is not None:
        write_record(args.json_out, {SUITE: rec})


if __name__ == "__main__":
    main()
