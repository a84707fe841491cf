"""The fixed evaluation set (`train.eval_sequences`): the same sequences, the same loss, whatever
the micro-batch size or the parallel layout.

Each trainer here is evaluated before any step: initial weights do not depend on the batch
shape or the layout, so any difference in the validation loss is the evaluation's own.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmscale.config import load_config
from llmscale.data.stream import PackedStream
from llmscale.errors import ConfigError
from llmscale.train.evaluation import IGNORE, local_eval_rows
from llmscale.train.trainer import Trainer

TOL = 1e-6


def _trainer(cfg_factory, *overrides: str) -> Trainer:
    # A fresh run folder for each trainer: a folder belongs to one run.
    return Trainer(cfg_factory(*overrides, run=f"eval-{next(_RUNS)}"))


_RUNS = itertools.count()


def _by_hand(t: Trainer, n: int, chunk: int = 3) -> float:
    """The mean token loss of the first n validation windows, `chunk` sequences per forward
    (3: a batching none of the tested micro-batch sizes uses)."""
    seq = t.cfg.data.seq_len
    stream = PackedStream(t.val_tokens, seq, seed=0, shuffle=False)
    rows = stream.next_batch(min(n, stream.n_windows))
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in rows.split(chunk):
            logits = t.model(batch[:, :-1])
            loss = F.cross_entropy(
                logits.flatten(0, 1).double(), batch[:, 1:].flatten(), reduction="sum"
            )
            total += loss.item()
            count += batch[:, 1:].numel()
    return total / count


def test_loss_does_not_depend_on_micro_batch_size(cfg_factory) -> None:
    n = 7  # not a multiple of 2 or 4: the last micro-batch is padded
    got = {}
    for mbs in (1, 2, 4):
        t = _trainer(
            cfg_factory,
            "--train.micro_batch_size", str(mbs),
            "--train.global_batch_size", "4",
            "--train.eval_sequences", str(n),
        )  # fmt: skip
        got[mbs] = t.evaluate()
    ref = _by_hand(t, n)
    for mbs, v in got.items():
        assert v is not None and abs(v - ref) < TOL, (mbs, v, ref)


def test_scores_exactly_the_first_n_windows(cfg_factory) -> None:
    t = _trainer(cfg_factory, "--train.eval_sequences", "5")
    five, six = t.evaluate(), _by_hand(t, 6)
    assert abs(five - _by_hand(t, 5)) < TOL
    assert abs(five - six) > 10 * TOL  # the sixth window is not scored: it changes the mean


def test_fewer_windows_than_asked_scores_them_all(cfg_factory) -> None:
    t = _trainer(
        cfg_factory,
        "--train.eval_sequences", "100000",
        "--train.micro_batch_size", "32", "--train.global_batch_size", "32",
    )  # fmt: skip
    n_windows = PackedStream(t.val_tokens, t.cfg.data.seq_len, seed=0, shuffle=False).n_windows
    assert n_windows < 100000
    assert abs(t.evaluate() - _by_hand(t, n_windows, chunk=50)) < TOL


def test_zero_sequences_means_no_evaluation(cfg_factory) -> None:
    t = _trainer(cfg_factory, "--train.eval_sequences", "0")
    assert t.evaluate() is None
    assert t.fit().val_loss is None


def test_eval_batches_is_refused_naming_its_replacement(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train.eval_batches", "4"])
    assert e.value.field == "train.eval_batches" and "train.eval_sequences" in e.value.allowed
    old = tmp_path / "old.toml"
    old.write_text("[train]\neval_batches = 4\n")
    with pytest.raises(ConfigError, match="replaced by train.eval_sequences"):
        load_config(old)


def test_replicas_split_the_set_into_equal_padded_slices() -> None:
    rows = torch.arange(7 * 5).reshape(7, 5)  # 7 sequences of 4 tokens (+ 1 target)
    scored = []
    for r in range(2):
        x, y = local_eval_rows(rows, r, 2, group=3)
        assert x.shape == (6, 4) and y.shape == (6, 4)  # 4 real rows per replica, padded to 6
        scored += [tuple(t.tolist()) for t in y if (t != IGNORE).all()]
        assert all((t == IGNORE).all() or (t != IGNORE).all() for t in y)
    assert sorted(scored) == [tuple(r[1:].tolist()) for r in rows]  # each row once


WORKER = Path(__file__).with_name("eval_worker.py")


@pytest.mark.slow
def test_two_ranks_pipeline_and_data_parallel_equal_one_process(cfg_factory, tmp_path) -> None:
    """pp=2 (two micro-batches of 2 per schedule call, 7 sequences: a padded last call),
    dp_shard=2 (FSDP; 4 + 3 sequences) and tp=2 with sequence parallelism (vocabulary-parallel
    token losses) under torchrun give the in-process value to 1e-6."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
    from parallel_harness import torchrun

    common = [
        "--data.max_files", "40", "--data.seq_len", "32", "--train.eval_sequences", "7",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
        "--model.tie_embeddings", "false",
    ]  # fmt: skip
    layouts = {
        "pp2": ["--parallel.pp", "2"],
        "fsdp2": ["--parallel.dp_shard", "2"],
        "tp2_sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    }
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path), "base": common, "layouts": layouts}))
    torchrun(2, str(WORKER), str(spec), timeout=240)
    ref = Trainer(load_config(None, [*common, "--job.run_dir", str(tmp_path / "ref")]))
    want = ref.evaluate()
    for name in layouts:
        got = json.loads((tmp_path / f"{name}.json").read_text())["val_loss"]
        assert abs(got - want) < TOL, (name, got, want)
