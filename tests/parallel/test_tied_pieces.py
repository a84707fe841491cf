"""The pieces of tied embeddings under pipeline parallelism, in one process (no torchrun):
the last stage's copy starts as the embedding, the config accepts the layout and refuses what
it cannot run with one line, checkpoints hold one tensor, the planner counts the copy; a V
holds one tensor, and under FSDP2 the planner puts it in the last stage's root unit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.parallel.pipeline import pipeline_split
from llmscale.parallel.tied_embeddings import give_copies, store_once
from llmscale.plan.params import rank_params
from llmscale.stack.residency import stage_units

TINY_TIED = dataclasses.replace(get_preset("tiny"), tie_embeddings=True, n_layers=8)


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_last_stage_copy_starts_as_the_embedding(schedule, chunks) -> None:
    model = build_model(TINY_TIED, seed=3)
    emb = model.tok_embeddings.weight
    parts, ids = pipeline_split(model, 1, 2, chunks, (), schedule)
    (head,) = [p for p, s in zip(parts, ids, strict=True) if s == 2 * chunks - 1]
    assert torch.equal(head.output.weight, emb)
    assert head.tok_embeddings is None
    # The model's own init gives the copy the embedding's value (layout-independent).
    shape = tuple(emb.shape)
    assert torch.equal(model.initial_value("output.weight", shape, 3), emb)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_holds_one_tensor(schedule) -> None:
    """A V places the first and the last stage on pp rank 0: the embedding reads the head's
    weight, the one tensor, registered once (on the last stage), with or without data
    parallelism (under FSDP2 it gathers the last stage's root unit first)."""
    model = build_model(TINY_TIED, seed=3)
    emb = model.tok_embeddings.weight.detach().clone()
    parts, ids = pipeline_split(model, 0, 2, 2, (), schedule)
    first, last = parts[ids.index(0)], parts[ids.index(3)]
    assert first.tok_embeddings.weight is last.output.weight
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert names.count("output.weight") == 1 and "tok_embeddings.weight" not in names
    assert torch.equal(last.output.weight, emb)
    # The embedding's lookup reads it: the same rows as the whole model's embedding.
    tokens = torch.tensor([[1, 5, 7]])
    assert torch.equal(first.tok_embeddings(tokens), model.tok_embeddings(tokens))
    # pp rank 1 (the middle stages) holds neither.
    mid, _ = pipeline_split(model, 1, 2, 2, (), schedule)
    assert all(p.tok_embeddings is None and p.output is None for p in mid)


def test_config_accepts_tied_pp_and_refuses_offload_in_one_line() -> None:
    base = ["--model.name", "gpt2-124m", "--parallel.pp", "2", "--train.micro_batch_size", "4"]
    load_config(None, base).validate(world_size=2)
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "--optimizer.offload", "optimizer"]).validate(world_size=2)
    assert e.value.field == "optimizer.offload"
    assert "\n" not in str(e.value)


def test_checkpoint_names_store_one_tensor() -> None:
    emb, copy, m = torch.ones(2), torch.zeros(2), torch.full((2,), 5.0)
    # The last stage alone: its copy is stored (and asked for) under the embedding's names.
    assert store_once({"output.weight": copy, "norm.weight": m}) == {
        "tok_embeddings.weight": copy,
        "norm.weight": m,
    }
    optim = {"state.output.weight.exp_avg": copy, "param_groups.output.weight.lr": 0.1}
    assert store_once(optim) == {
        "state.tok_embeddings.weight.exp_avg": copy,
        "param_groups.tok_embeddings.weight.lr": 0.1,
    }
    # A V: both on this rank, the embedding's entry is the one stored.
    assert store_once({"tok_embeddings.weight": emb, "output.weight": copy}) == {
        "tok_embeddings.weight": emb
    }
    loaded = give_copies({"tok_embeddings.weight": emb, "state.tok_embeddings.weight.step": 3})
    assert loaded["output.weight"] is emb and loaded["state.output.weight.step"] == 3


def test_planner_counts_the_copy_on_the_last_stage() -> None:
    v, d = TINY_TIED.vocab_size, TINY_TIED.dim
    one = rank_params(TINY_TIED, 1, 1, 0)
    first, last = rank_params(TINY_TIED, 1, 2, 0), rank_params(TINY_TIED, 1, 2, 1)
    assert last.numel - (one.numel - first.numel) == v * d  # the copy, beyond the split
    assert first.numel + last.numel == one.numel + v * d
    # A V: one tensor on rank 0, as in one process, with or without FSDP2.
    shared = [rank_params(TINY_TIED, 1, 2, r, chunks=2, v_shape=True) for r in (0, 1)]
    assert shared[0].numel + shared[1].numel == one.numel
    assert shared[0].autocast_numel + shared[1].autocast_numel == one.autocast_numel
    sharded = [rank_params(TINY_TIED, 1, 2, r, 2, chunks=2, v_shape=True) for r in (0, 1)]
    assert sharded[0].shard_numel + sharded[1].shard_numel == one.numel // 2
    # FSDP2's units: the first stage's root holds no tied weight, the last stage's holds it.
    v_units = [stage_units(TINY_TIED, s, 4, v_shape=True) for s in (0, 3)]
    loop_units = [stage_units(TINY_TIED, s, 4) for s in (0, 3)]
    assert len(v_units[0]) == len(loop_units[0]) - 1 == 2  # 2 blocks, no root
    assert v_units[1] == loop_units[1] and (v, d) in v_units[1][-1]  # 2 blocks, norm + weight


def test_cli_accepts_the_tied_pipeline(capsys, tmp_path, monkeypatch) -> None:
    """`plan --model gpt2-124m --gpu h100 --gpus 8 --seq 1024 --pp 2` and `train --model.name
    gpt2-124m --parallel.pp 2 --train.micro_batch_size 4 --dry-run` take the tied layout; the
    dry run's last pp rank holds the copy: its fp32 parameters are the planner's, the copy's
    `vocab x dim` beyond what the split gives it. (The dry run against the h100 here: without
    --gpu it calibrates this machine first, a minute.)"""
    import json

    from llmscale.cli import main
    from llmscale.plan.memory import MemoryOptions
    from llmscale.plan.predict import expected_runtime_metrics

    monkeypatch.chdir(tmp_path)
    plan = ["plan", "--model", "gpt2-124m", "--gpu", "h100", "--gpus", "8", "--seq", "1024"]
    assert main([*plan, "--pp", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["candidates"] and all(c["plan"]["pp"] == 2 for c in got["candidates"])
    assert any(c["fits"] for c in got["candidates"])
    job = ["--model.name", "gpt2-124m", "--parallel.pp", "2", "--train.micro_batch_size", "4"]
    assert main(["train", *job, "--dry-run", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "tied_embedding_comm" in out
    gpt2 = get_preset("gpt2-124m")
    cfg = load_config(None, job)
    ranks = [expected_runtime_metrics(cfg, rank=r, options=MemoryOptions()) for r in (0, 1)]
    split = rank_params(gpt2, 1, 2, 1)
    one = rank_params(gpt2, 1, 1, 0)
    assert ranks[1]["param_bytes"] == 4 * split.numel
    assert split.numel - (one.numel - rank_params(gpt2, 1, 2, 0).numel) == 50257 * 768
    for r, row in enumerate(ranks):  # the dry run's table, GiB to 2 decimals
        line = next(x for x in out.splitlines() if x.split()[:2] == [str(r), str(r)])
        assert line.split()[2] == f"{row['param_bytes'] / 2**30:.2f}", (r, line)
