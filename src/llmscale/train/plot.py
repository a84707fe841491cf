"""`llmscale plot RUN_DIR`: loss curve and throughput of a run, as one PNG."""

from __future__ import annotations

from pathlib import Path

from llmscale.errors import UsageError
from llmscale.train.metrics import read_jsonl


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw train (and validation) loss and tokens/s against step; returns the PNG path."""
    run = Path(run_dir)
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(
            f"run_dir: no metrics.jsonl in {str(run)!r} (is it a `llmscale train` folder?)"
        )
    rows = read_jsonl(path)
    train = {r["step"]: r for r in rows if r.get("kind") == "train"}  # last row per step wins
    if not train:
        raise UsageError(f"run_dir: {path} has no training steps yet")
    steps = sorted(train)
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [train[s]["loss"] for s in steps], label="train")
    if val:
        ax_loss.plot(*zip(*val, strict=True), "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_tps.plot(steps, [train[s]["tokens_per_s"] for s in steps], color="tab:green")
    ax_tps.set(xlabel="step", ylabel="tokens / s", title="throughput")
    ax_tps.grid(alpha=0.3)
    fig.suptitle(run.name)
    fig.tight_layout()
    target = Path(out) if out else run / "loss.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target
