"""The figures of README.md's prose (outside its command transcripts), rendered by `make docs`.

Each renderer reads a record under docs/results/ (`pages-startup.json`, which
`python -m llmscale.bench.startup --json-out` writes) or computes the figure from the planner,
which is deterministic: nothing here measures. `docs.py` lists the blocks (`BLOCKS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmscale.docs import Context

STARTUP_RECORD = "pages-startup.json"
STARTUP_COMMAND = "python -m llmscale.bench.startup --json-out docs/results/pages-startup.json"
MIB = 2**20


# ---- docs/results/pages-startup.json (bench/startup.py) -----------------------------------------


def _startup(ctx: Context) -> dict[str, Any] | None:
    from llmscale.bench import startup

    return ctx.record(STARTUP_RECORD, startup.SUITE)


def _not_measured() -> str:
    return f"not measured yet: `{STARTUP_COMMAND}`"


def _when(rec: dict[str, Any]) -> str:
    load = rec["load_average"]
    return (
        f"in `python -m llmscale.bench.startup`'s record of {rec['measured_at'][:10]}: "
        f"{rec['cores']} CPU cores, load average {load[0]:.2f} at the start, {load[1]:.2f} at "
        "the end"
    )


def startup_calibration(ctx: Context) -> str:
    """README: how long the first run of a shape spends micro-benchmarking this machine."""
    rec = _startup(ctx)
    if rec is None:
        return _not_measured()
    c = rec["calibration"]
    return (
        f"{c['seconds']:.1f} s at the demo's shape, the {c['model']} model, "
        f"{c['micro_batch_size']} × {c['seq_len']} tokens in {c['precision']}, {_when(rec)}"
    )


def startup_probe(ctx: Context) -> str:
    """README: what the probe a run times at each use of cached figures costs."""
    rec = _startup(ctx)
    if rec is None:
        return _not_measured()
    return f"{1e3 * rec['probe']['seconds']:.0f} ms in the same record"


def startup_verify(ctx: Context) -> str:
    """README: a prepared folder's first verification (sha256 and largest id of a shard read
    from the page cache) and a second one, answered by the shard cache."""
    rec = _startup(ctx)
    if rec is None:
        return _not_measured()
    v = rec["verify"]
    return (
        f"{v['first_seconds']:.2f} s for a {v['shard_bytes'] / MIB:,.0f} MiB shard from the page "
        f"cache, its sha256 and largest id, the disk's rate cold; then cached in "
        "`$LLMSCALE_CACHE_DIR` by the shard's path, size, inode, modification and change time, so a "
        f"second open reads nothing: {1e3 * v['again_seconds']:.1f} ms, {_when(rec)}"
    )


# ---- the planner ----------------------------------------------------------------------------


def memcheck_need(ctx: Context) -> str:
    """README: what `llmscale train --model.name llama2-70b` (one CPU process, the default
    config) says it needs: the memory check's own figure (`train.memcheck.predicted_need`)."""
    import torch

    from llmscale.config import load_config
    from llmscale.train.memcheck import GIB, model_label, predicted_need

    cfg = load_config(None, ["--model.name", "llama2-70b"])
    _, host = predicted_need(cfg, torch.device("cpu"))
    return f"the planner predicts {host / GIB:.1f} GiB for {model_label(cfg.model)}"


def params_window(ctx: Context) -> str:
    """README: the device's parameter bytes under optimizer+params (its `param_window`, the
    working copies) against the parameters without offload, small model, fp32, the planner's
    prediction the runtime's ledger is tested equal to (tests/offload/test_params.py)."""
    from llmscale.config import load_config
    from llmscale.plan.predict import as_plan, predict_memory, runtime_options

    def rank0(offload: str) -> Any:
        cfg = load_config(None, ["--model.name", "small", "--optimizer.offload", offload])
        plan = as_plan(cfg)
        return predict_memory(plan, runtime_options(plan, "cpu")).per_rank[0]

    window = rank0("optimizer+params").working_params
    whole = rank0("none").params
    return f"{window / MIB:.2f} MiB of the small model's {whole / MIB:.2f} MiB in fp32"


def korthikanti_fit(ctx: Context) -> str:
    """README: how closely the planner's Megatron-2021 tensor list reproduces Korthikanti et
    al.'s eq. 1 for a GPT-3 175B layer (s = 2048, b = 1; t = 1 and 8, with and without SP,
    none, selective and full), the cases tests/plan/test_memory.py checks to 1%."""
    from llmscale.model.config import get_preset
    from llmscale.plan import activations as act

    g, s = get_preset("gpt3-175b"), 2048
    worst = max(
        abs(
            act.block_bytes(g, 1, s, "fp16", tp, sp, act.MEGATRON_2021, mode)
            / act.korthikanti_bytes(g, 1, s, tp, sp, mode)
            - 1
        )
        for tp, sp in ((1, False), (8, False), (8, True))
        for mode in ("none", "selective", "full")
    )
    return f"which it reproduces to {worst:.3%} for a GPT-3 layer"
