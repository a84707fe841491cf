"""`checkpoint.init_from`: a new run starts from a Hugging Face Llama folder or another run.

The Hugging Face model is a small random `LlamaForCausalLM` the test makes and saves (weights
drawn wider than its default init, norms not at 1, so that a wrong row order or a swapped matrix
shows). llmscale's logits equal transformers' within 1e-5 in fp32, and training continues from
those weights: the first step's loss is transformers' loss on the same batch, in one process and
under FSDP (dp_shard=2) and TP (tp=2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_harness import BASE, hf_model, run_config, run_model, save_random_llama

from llmscale.hf.convert import from_hf_llama, to_hf_state_dict
from llmscale.hf.folder import read_llama_folder
from llmscale.model.transformer import build_model
from llmscale.train.metrics import read_jsonl
from llmscale.train.trainer import Trainer
from llmscale.train.weights import read_run_weights

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))  # parallel_harness

TOL = 1e-5


def tokens(n: int = 2, seq: int = 33) -> torch.Tensor:
    return torch.randint(0, 264, (n, seq), generator=torch.Generator().manual_seed(3))


def test_llama_folder_gives_transformers_logits(llama_dir: Path) -> None:
    cfg, sd = read_llama_folder(llama_dir)
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.n_layers) == (64, 4, 2, 160, 2)
    model = build_model(cfg)
    model.load_state_dict(sd)
    x = tokens()
    with torch.no_grad():
        gap = (model(x) - hf_model(llama_dir)(x).logits).abs().max()
    assert gap < TOL


def test_rope_base_norm_eps_and_tied_head_come_from_the_folder(tmp_path: Path) -> None:
    """transformers 5 writes the RoPE base inside rope_parameters; Llama 3's base of 500000."""
    folder = save_random_llama(
        tmp_path / "hf", rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=True
    )
    cfg, sd = read_llama_folder(folder)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (500000.0, 1e-6, True)
    model = build_model(cfg)
    model.load_state_dict(sd)
    x = tokens(1, 60)
    with torch.no_grad():
        gap = (model(x) - hf_model(folder)(x).logits).abs().max()
    assert gap < TOL  # measured 7e-6 on logits up to 5 (fp32 rounding of the angles)


def test_conversion_round_trips_exactly(llama_dir: Path) -> None:
    cfg, sd = read_llama_folder(llama_dir)
    back = from_hf_llama(cfg, to_hf_state_dict(cfg, sd))
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_training_starts_from_the_llama_weights(llama_dir: Path, tmp_path: Path) -> None:
    """[model] says tiny; the folder's shape wins (the documented rule), and the first step's
    loss is transformers' loss on that step's batch."""
    cfg = run_config(tmp_path / "ft", "--checkpoint.init_from", f"hf:{llama_dir}")
    with Trainer(cfg) as trainer:
        assert trainer.initialized_from
        assert trainer.cfg.model.ffn_dim == 160 and trainer.step == 0
        x = tokens()
        with torch.no_grad():
            hf = hf_model(llama_dir)
            gap = (trainer.model(x) - hf(x).logits).abs().max()
        assert gap < TOL
        batch = trainer.train_stream.next_batch(cfg.train.global_batch_size)
        trainer.train_stream.state = type(trainer.train_stream.state)()  # rewind
        with torch.no_grad():
            logits = hf(batch[:, :-1]).logits
        want = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
        before = trainer.model.state_dict()["layers.0.attention.wq.weight"].clone()
        row = trainer.train_step()
        assert abs(row["loss"] - want) < TOL and not row["skipped"]
        assert not torch.equal(trainer.model.state_dict()["layers.0.attention.wq.weight"], before)


def test_training_starts_from_another_runs_weights(trained_run: Path, tmp_path: Path) -> None:
    source = read_run_weights(trained_run)
    cfg = run_config(tmp_path / "ft", "--checkpoint.init_from", str(trained_run))
    with Trainer(cfg) as trainer:
        assert trainer.initialized_from and trainer.step == 0
        got = trainer.model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in source.state_dict.items())
        assert not trainer.optimizer.state  # weights only, no optimizer state


def test_a_resumed_run_ignores_init_from(trained_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "ft"
    args = ["--checkpoint.init_from", str(trained_run)]
    with Trainer(run_config(run, *args, "--train.steps", "1")) as trainer:
        trainer.fit()
    own = run_model(run).state_dict()
    # (a resume continues: train.steps above the checkpoint's step)
    resumed = run_config(run, *args, "--train.steps", "2", "--checkpoint.resume", "true")
    with Trainer(resumed) as trainer:
        assert not trainer.initialized_from  # its own checkpoint will be loaded instead
        assert trainer.resume() and trainer.step == 1
        assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in own.items())


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallel.dp_shard", "2"], ["--parallel.tp", "2"]])
def test_training_continues_under_fsdp_and_tp(
    llama_dir: Path, tmp_path: Path, layout: list[str]
) -> None:
    from parallel_harness import torchrun

    common = ["--checkpoint.init_from", f"hf:{llama_dir}", "--train.steps", "2"]
    common += ["--train.micro_batch_size", "2"]  # global 4 = 2 x dp 2
    with Trainer(run_config(tmp_path / "one", *common)) as trainer:
        want = trainer.fit().losses
    run = tmp_path / "two"
    torchrun(2, "-m", "llmscale", "train", *BASE, "--job.run_dir", str(run), *common, *layout)
    losses = [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert len(losses) == 2
    assert abs(losses[0] - want[0]) < TOL  # the same start: the Llama weights, sharded
    assert abs(losses[1] - want[1]) < 1e-4 * want[1]
    assert read_run_weights(run).cfg.model.ffn_dim == 160  # config.toml: the source's shape


def test_dry_run_predicts_for_the_sources_shape(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[model] says tiny (max_seq_len 128); the folder's max_position_embeddings is 64."""
    from llmscale.cli import main

    args = ["train", "--dry-run", "--checkpoint.init_from", f"hf:{llama_dir}"]
    assert main(args) == 2  # seq_len 128 > the source's 64
    assert "model.max_seq_len=64" in capsys.readouterr().err
    assert main([*args, "--data.seq_len", "32"]) == 0
    assert "model custom" in capsys.readouterr().out
