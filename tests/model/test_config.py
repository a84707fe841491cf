import pytest
import torch

from llmscale.errors import ConfigError
from llmscale.model.config import PRESETS, ModelConfig, get_preset
from llmscale.model.transformer import build_model, count_params


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.published_params])
def test_preset_parameter_count_matches_published(name: str) -> None:
    cfg = PRESETS[name]
    counted = count_params(build_model(cfg, "meta"))
    assert counted == cfg.num_params()
    assert abs(counted / cfg.published_params - 1) < 0.005, (counted, cfg.published_params)
    assert cfg.published_source


def test_exact_counts_of_known_models() -> None:
    # Exact checkpoint sizes (Hugging Face safetensors metadata).
    assert get_preset("llama2-7b").num_params() == 6_738_415_616
    assert get_preset("llama3-8b").num_params() == 8_030_261_248
    assert get_preset("gpt2-124m").num_params() == 124_439_808


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_small_presets_count_real_parameters(name: str) -> None:
    m = build_model(PRESETS[name])
    assert count_params(m) == PRESETS[name].num_params()
    assert sum(p.numel() for p in m.parameters()) == PRESETS[name].num_params()


def test_tiny_is_a_few_hundred_thousand_parameters() -> None:
    assert 100_000 < PRESETS["tiny"].num_params() < 500_000


def test_flops_match_narayanan_formula_for_gpt3() -> None:
    # Narayanan et al. 2021, eq. (3) without recompute: 72 B s l h^2 (1 + s/6h + V/12lh) per step.
    m = get_preset("gpt3-175b")
    s, l, h, V = 2048, m.n_layers, m.dim, m.vocab_size
    expected = 72 * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h)) / s
    assert m.train_flops_per_token(s) == pytest.approx(expected, rel=1e-12)
    # With full recomputation Narayanan count 96 instead of 72 (and V/16lh).
    expected_r = 96 * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h)) / s
    assert m.train_flops_per_token(s, recompute_fraction=1.0) == pytest.approx(
        expected_r, rel=1e-12
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dim": 0}, "model.dim"),
        ({"n_heads": 5}, "model.n_heads"),
        ({"n_kv_heads": 3}, "model.n_kv_heads"),
        ({"norm": "batchnorm"}, "model.norm"),
        ({"mlp": "relu"}, "model.mlp"),
        ({"n_layers": -2}, "model.n_layers"),
    ],
)
def test_bad_shapes_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig(**kwargs)
    assert e.value.field == field


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="llama2-70b"):
        get_preset("llama9")


def test_meta_model_allocates_nothing() -> None:
    m = build_model(get_preset("llama3-405b"), "meta")
    assert all(p.device.type == "meta" for p in m.parameters())
    assert isinstance(next(m.parameters()), torch.nn.Parameter)


def test_llama31_presets_are_llama3_shapes_with_a_128k_context() -> None:
    """Llama 3.1's config.json: Llama 3's shape, max_position_embeddings 131072, rope_type
    "llama3" with factor 8; a planning command asked for more context than llama3-8b's names
    the Llama 3.1 preset."""
    for size in ("8b", "70b", "405b"):
        base, long = get_preset(f"llama3-{size}"), get_preset(f"llama3.1-{size}")
        assert long.shape_key() == base.shape_key()
        assert long.num_params() == base.num_params()
        assert (long.max_seq_len, long.rope_scaling, long.rope_factor) == (131072, "llama3", 8.0)
        assert (long.rope_original_max_seq_len, long.rope_theta) == (8192, base.rope_theta)
    said = get_preset("llama3-8b").seq_len_allowed()
    assert "--model llama3.1-8b (131,072 tokens)" in said
    assert "--model llama3" not in get_preset("llama2-7b").seq_len_allowed()
