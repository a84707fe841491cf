"""Llama 3.1/3.2 folders: RoPE scaling (llama3, linear) imported, trained and exported.

A random Llama 3.1-shaped folder (grouped-query attention, rope_theta 500000, rope_parameters
llama3 or linear) made with transformers round-trips: llmscale's logits on the imported
weights equal transformers' within 1e-4; one training step from it; the export, loaded by
transformers, equals llmscale's logits on the trained weights within 1e-4. The original context
is 64 positions (not Llama 3.1's 8192) so that all three llama3 bands (kept, blended, divided)
turn within the 64 positions the test feeds; unscaled RoPE on the same weights is far off.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hf_harness import hf_model, run_model, save_random_llama, train_run

from llmscale.hf.folder import read_llama_folder
from llmscale.inference.export import export_run
from llmscale.model.transformer import build_model, rope_inv_freq

TOL = 1e-4
ROPE = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
}


def llama31_folder(folder: Path, kind: str, tied: bool = False) -> Path:
    return save_random_llama(
        folder,
        tie_word_embeddings=tied,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": 500000.0, **ROPE[kind]},
    )


def logits_gap(model: torch.nn.Module, folder: Path, seq: int = 64) -> float:
    x = torch.randint(0, 264, (2, seq), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return float((model(x) - hf_model(folder)(x).logits).abs().max())


@pytest.mark.parametrize(
    ("kind", "tied"),
    [("llama3", False), ("linear", False), ("llama3", True)],
    ids=["llama3.1", "linear", "llama3.2-tied"],
)
def test_scaled_rope_round_trips_through_training_and_export(
    kind: str, tied: bool, tmp_path: Path
) -> None:
    source = llama31_folder(tmp_path / "hf", kind, tied)
    cfg, sd = read_llama_folder(source)
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.rope_factor) == (
        kind,
        500000.0,
        ROPE[kind]["factor"],
    )
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.tie_embeddings) == (4, 2, tied)
    model = build_model(cfg)
    model.load_state_dict(sd)
    assert logits_gap(model.eval(), source) < TOL  # measured 4.6e-6 (llama3), 5.2e-6 (linear)
    # The scaling matters on these weights: plain RoPE is far from transformers.
    plain = build_model(dataclasses.replace(cfg, rope_scaling="none"))
    plain.load_state_dict(sd)
    assert logits_gap(plain.eval(), source) > 100 * TOL

    run = train_run(
        tmp_path / "run", "--checkpoint.init_from", f"hf:{source}", "--train.steps", "1"
    )
    out = export_run(run, tmp_path / "out").out
    params = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert params == {"rope_theta": 500000.0, **ROPE[kind]}
    trained = run_model(run)
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(trained.state_dict()[wq], sd[wq])  # the step changed the weights
    assert logits_gap(trained, out) < TOL  # measured 6.1e-6 (llama3), 5.2e-6 (linear)


def test_llama3_frequencies_fall_in_three_bands() -> None:
    """head_dim 16, theta 5e5, original context 64: wavelength 6.3 kept (< 16), 32.5 blended,
    the rest (> 64) divided by 8."""
    from llmscale.model.config import ModelConfig

    cfg = ModelConfig(
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_original_max_seq_len=64,
    )
    plain = rope_inv_freq(16, 500000.0)
    ratio = (rope_inv_freq(16, 500000.0, cfg) / plain).tolist()
    assert ratio[0] == 1.0
    assert 1 / 8 < ratio[1] < 1.0
    assert ratio[2:] == pytest.approx([1 / 8] * 6, rel=1e-6)
