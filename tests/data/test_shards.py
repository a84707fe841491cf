"""The memory-mapped shard loader, and training on a prepared dataset (vocabulary, resume)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from corpus_maker import prepare_small

from llmscale.data.prepared import load_meta
from llmscale.data.shards import IndexPermutation, ShardStream
from llmscale.data.stream import StreamState
from llmscale.train.data import mask_padded_vocab
from llmscale.train.trainer import Trainer, lm_loss


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A BPE dataset split into several small shards."""
    return prepare_small(tmp_path_factory.mktemp("ds"), "bpe", 300, shard_tokens=3000)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection_per_seed_and_epoch(n) -> None:
    p = IndexPermutation(n, seed=3, epoch=0)
    order = p(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    assert p(np.arange(n)).tolist() == order.tolist()  # deterministic
    # evaluated piecewise, the same order
    assert (
        np.concatenate([p(np.arange(0, n // 2)), p(np.arange(n // 2, n))]).tolist()
        == order.tolist()
    )
    if n >= 64:
        assert order.tolist() != IndexPermutation(n, 3, 1)(np.arange(n)).tolist()
        assert order.tolist() != IndexPermutation(n, 4, 0)(np.arange(n)).tolist()
        assert order.tolist() != list(range(n))


def test_an_epoch_visits_every_window_once_and_rows_are_the_shards_tokens(prepared) -> None:
    meta = load_meta(prepared)
    assert len(meta.splits["train"].shards) >= 3
    seq = 16
    s = ShardStream.from_meta(meta, "train", seq, seed=0)
    assert all(isinstance(m, np.memmap) for m in s.shards)
    tokens = [np.fromfile(p, dtype="<u2") for p in meta.shard_paths("train")]
    assert s.n_windows == sum((len(t) - 1) // seq for t in tokens)
    seen = []
    while s.state.epoch == 0:
        k = min(5, s.n_windows - s.state.cursor)
        before = s.state.cursor
        idx = s._take(k)  # the window numbers of this batch
        seen += idx.tolist()
        assert s.state.cursor in (before + k, 0)
    assert sorted(seen) == list(range(s.n_windows))
    # a window's row: seq + 1 consecutive tokens of one shard
    rows = s.rows(np.array([0, s.n_windows - 1]))
    assert rows[0].tolist() == tokens[0][: seq + 1].tolist()
    last = len(tokens) - 1
    k = (len(tokens[last]) - 1) // seq - 1
    assert rows[1].tolist() == tokens[last][k * seq : (k + 1) * seq + 1].tolist()


def test_data_parallel_ranks_split_the_global_batch(prepared) -> None:
    meta = load_meta(prepared)
    one = ShardStream.from_meta(meta, "train", 16, seed=1)
    ranks = [ShardStream.from_meta(meta, "train", 16, seed=1, dp_rank=r, dp_size=2) for r in (0, 1)]
    for _ in range(4):
        whole = one.next_batch(8)
        parts = [s.next_batch(8) for s in ranks]
        assert torch.equal(torch.cat(parts), whole)
        assert not torch.equal(parts[0], parts[1])


def test_resuming_from_the_state_gives_the_same_batches(prepared) -> None:
    meta = load_meta(prepared)
    a = ShardStream.from_meta(meta, "train", 16, seed=2)
    n = a.n_windows
    first = [a.next_batch(6) for _ in range(math.ceil(n / 6) + 2)]  # past an epoch's end
    b = ShardStream.from_meta(meta, "train", 16, seed=2)
    for _ in range(3):
        b.next_batch(6)
    c = ShardStream.from_meta(meta, "train", 16, seed=2)
    c.state = StreamState.from_dict(b.state.to_dict())
    rest = [c.next_batch(6) for _ in range(len(first) - 3)]
    assert all(torch.equal(x, y) for x, y in zip(first[3:], rest, strict=True))
    assert c.state.epoch == 1


def test_padded_ids_are_masked_out_of_the_loss() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 320, requires_grad=True)
    targets = torch.randint(0, 300, (2, 5))
    loss = lm_loss(logits, targets, 300)
    expected = F.cross_entropy(logits[..., :300].flatten(0, 1), targets.flatten())
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()
    assert logits.grad is not None and logits.grad[..., 300:].abs().max() == 0
    # nothing to mask: unchanged
    assert mask_padded_vocab(logits, 320) is logits and mask_padded_vocab(logits, None) is logits


def _run(cfg_factory, prepared, run: str, *extra: str):
    cfg = cfg_factory(
        "--data.dataset", str(prepared), "--data.seq_len", "16", "--train.steps", "4",
        "--checkpoint.enabled", "true", *extra, run=run,
    )  # fmt: skip
    with Trainer(cfg) as t:
        return t, t.fit()


def test_training_on_a_prepared_dataset_resumes_bit_exactly(cfg_factory, prepared) -> None:
    t, full = _run(cfg_factory, prepared, "full")
    assert t.cfg.model.vocab_size == 320 and t.data.n_valid_vocab == 300  # 300 padded to 64
    assert isinstance(t.train_stream, ShardStream)
    assert full.losses[0] == pytest.approx(math.log(300), abs=0.3)  # uniform over the real ids
    _, first = _run(cfg_factory, prepared, "cut", "--checkpoint.stop_after", "2")
    assert first.interrupted and first.steps_done == 2
    _, rest = _run(cfg_factory, prepared, "cut", "--checkpoint.resume", "true")
    assert first.losses + rest.losses == full.losses  # bit-exact
    assert rest.val_loss == full.val_loss is not None


def test_a_checkpoint_without_a_tokenizer_sha_still_resumes(cfg_factory) -> None:
    from llmscale.train.data import byte_tokenizer_sha256, checkpoint_tokenizer_sha256

    common = ("--checkpoint.enabled", "true", "--train.eval_sequences", "0")
    with Trainer(cfg_factory(*common, "--train.steps", "2", run="old")) as t:
        t.sha_kept = False  # as checkpoints were written before the sha256 was kept
        t.fit()
        folder = t.checkpointer.folder
    assert checkpoint_tokenizer_sha256(folder / "step-000002") is None
    cfg = cfg_factory(*common, "--train.steps", "3", "--checkpoint.resume", "true", run="old")
    with Trainer(cfg) as t:
        assert t.fit().steps_done == 3
    assert checkpoint_tokenizer_sha256(folder / "step-000003") == byte_tokenizer_sha256()
