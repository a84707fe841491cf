"""`llmscale eval`: validation loss and perplexity of a run's newest checkpoint.

The trainer's own evaluation, not a copy of it: a single-process Trainer is built from the run's
config (any overrides applied, e.g. --data.dataset), started from the run's weights through
checkpoint.init_from, and asked for `evaluate()`; so the same validation data and batches as
during training, whatever layout the run trained under.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llmscale.config import ParallelSection, load_config
from llmscale.data.prepared import load_meta
from llmscale.errors import ConfigError, UsageError
from llmscale.train.data import byte_tokenizer_sha256, check_checkpoint_tokenizer
from llmscale.train.trainer import Trainer
from llmscale.train.weights import find_checkpoint, read_run_config


@dataclass(frozen=True)
class Evaluation:
    step: int
    val_loss: float
    perplexity: float

    def to_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def evaluate_run(run_dir: str | Path, overrides: list[str] | None = None) -> Evaluation:
    base = read_run_config(run_dir)
    # The checkpoint the trainer below reads (through init_from): its notices are printed then.
    step, path = find_checkpoint(run_dir, base, say=lambda _: None)
    cfg = load_config(Path(run_dir) / "config.toml", overrides or [])
    if cfg.model != base.model:
        # The weights are the checkpoint's, so is its shape: a [model] override would be read,
        # then silently replaced by init_from's.
        changed = sorted(
            k for k, v in dataclasses.asdict(cfg.model).items() if getattr(base.model, k) != v
        )
        raise ConfigError(
            f"model.{changed[0]}" if changed else "model",
            getattr(cfg.model, changed[0]) if changed else "(changed)",
            f"the run's own ({getattr(base.model, changed[0]) if changed else ''}): eval reads "
            "the model from its checkpoint; leave out --model.* overrides",
        )
    # Data from another tokenizer than the checkpoint's (--data.dataset): one line, not a loss
    # over meaningless ids or an index error in the embedding.
    sha = load_meta(cfg.data.dataset).tokenizer_sha256 if cfg.data.dataset else None
    check_checkpoint_tokenizer(path, sha or byte_tokenizer_sha256(), cfg.data.dataset)
    cfg.parallel = ParallelSection()  # one process, whatever the run trained under
    cfg.optimizer = dataclasses.replace(cfg.optimizer, offload="none")
    cfg.checkpoint = dataclasses.replace(
        cfg.checkpoint, enabled=False, resume=False, init_from=str(run_dir)
    )
    # The evaluating trainer is not a run: a folder of its own (the run's holds its lock and
    # files, which a new trainer there would refuse), removed afterwards.
    with tempfile.TemporaryDirectory(prefix="llmscale-eval-") as scratch:
        cfg.job.run_dir = scratch
        with Trainer(cfg) as trainer:
            loss = trainer.evaluate()
    if loss is None:
        raise UsageError(
            f"no validation data for {run_dir}: its validation split holds no sequence of "
            f"data.seq_len + 1 = {cfg.data.seq_len + 1} tokens, or train.eval_sequences is 0"
        )
    return Evaluation(step=step, val_loss=loss, perplexity=math.exp(min(loss, 700.0)))
