"""The torch-free Hugging Face config.json parser and `load_model` (NAME, FILE.toml, DIR)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmscale.config import load_model
from llmscale.errors import ConfigError
from llmscale.model.config import from_hf_config, get_preset, hf_rope_parameters

# Llama-3.2-1B's config.json as published (transformers 4 key names: rope_scaling, rope_theta).
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


def test_llama_32_1b_parses_to_the_published_parameter_count() -> None:
    cfg = from_hf_config(LLAMA_32_1B)
    assert cfg.num_params() == get_preset("llama3.2-1b").published_params == 1_235_814_400
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_seq_len) == (
        "llama3",
        32.0,
        8192,
    )
    assert (cfg.rope_theta, cfg.n_kv_heads, cfg.tie_embeddings) == (500000.0, 8, True)


def test_transformers_5_rope_parameters_hold_the_base() -> None:
    """transformers 5 writes rope_parameters with rope_theta inside (no top-level rope_theta)."""
    hf = {k: v for k, v in LLAMA_32_1B.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 250000.0}
    cfg = from_hf_config(hf)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_theta) == ("linear", 2.0, 250000.0)
    assert hf_rope_parameters(cfg) == hf["rope_parameters"]
    default = from_hf_config({**hf, "rope_parameters": {"rope_type": "default"}})
    assert (default.rope_scaling, default.rope_theta) == ("none", 10000.0)


def test_gpt2_config_parses_to_the_gpt2_preset() -> None:
    hf = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
          "n_positions": 1024}  # fmt: skip
    assert from_hf_config(hf).num_params() == get_preset("gpt2-124m").published_params


def test_mistral_without_a_window_is_a_llama_shape_and_with_one_is_refused() -> None:
    """Mistral-7B-v0.3's config.json as published: transformers' MistralModel is LlamaModel
    with a sliding window, here none (null), so the shape is a Llama one, exactly."""
    mistral = {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32768,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False,
    }  # fmt: skip
    cfg = from_hf_config(mistral)
    assert cfg == from_hf_config({**mistral, "model_type": "llama"})
    assert cfg.num_params() == 7_248_023_552  # Mistral-7B-v0.3's safetensors hold 7.25B
    with pytest.raises(ConfigError) as e:  # Mistral-7B-v0.1: a 4,096-token window
        from_hf_config({**mistral, "sliding_window": 4096}, "--model", "DIR")
    assert "sliding_window null (got 4096)" in str(e.value)


@pytest.mark.parametrize(
    "experts",
    [
        {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
        {"model_type": "qwen3_moe", "num_experts": 128},
        {"model_type": "deepseek_v3", "n_routed_experts": 256},
    ],
)
def test_a_mixture_of_experts_is_refused_by_its_expert_count(experts: dict) -> None:
    with pytest.raises(ConfigError) as e:
        from_hf_config({**LLAMA_32_1B, **experts}, "--model", "DIR")
    key = next(k for k in experts if "expert" in k and "per_tok" not in k)
    assert f"config.json {key} = {experts[key]}: a mixture of experts" in str(e.value)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, "rope_scaling.factor"),
        ({"hidden_size": 20.5}, "hidden_size"),
        ({"num_key_value_heads": -1}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "mistral2"}, "model_type"),
    ],
)
def test_bad_values_name_the_config_json_key(change: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_hf_config({**LLAMA_32_1B, **change}, "--model", "DIR")
    assert e.value.field == "--model" and named in str(e.value), str(e.value)


def test_load_model_reads_a_name_a_toml_file_and_a_folder(tmp_path: Path) -> None:
    assert load_model("llama3-8b") == get_preset("llama3-8b")
    preset = tmp_path / "preset.toml"
    preset.write_text('[model]\nname = "llama3-8b"\nn_layers = 2\n')
    assert load_model(str(preset)) == get_preset("llama3-8b").with_overrides(n_layers=2)
    custom = tmp_path / "custom.toml"
    custom.write_text(
        "[model]\nvocab_size = 1000\ndim = 128\nn_layers = 3\nn_heads = 4\nn_kv_heads = 2\n"
        'ffn_dim = 256\nmax_seq_len = 64\nrope_scaling = "linear"\nrope_factor = 2.0\n'
    )
    cfg = load_model(str(custom))
    assert (cfg.name, cfg.vocab_size, cfg.n_layers, cfg.rope_factor) == ("custom", 1000, 3, 2.0)
    assert cfg.norm_eps == 1e-5  # every other key its default
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_32_1B))
    assert load_model(str(folder)).num_params() == 1_235_814_400


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ("[model]\ndim = 128\n", "model.vocab_size"),
        ('[model]\nname = "tiny"\nwidth = 3\n', "model.width"),
        ('[model]\nname = "tiny"\ndim = "wide"\n', "model.dim"),
        ('[model]\nname = "tiny"\nrope_scaling = "yarn"\n', "model.rope_scaling"),
        ('[model]\nname = "nope"\n', "model.name"),
        ("[train]\nsteps = 3\n", "[model]"),
        ("[model\n", "TOML"),
    ],
)
def test_bad_model_files_name_the_field(tmp_path: Path, toml: str, named: str) -> None:
    f = tmp_path / "m.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_model(str(f))
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_folder_without_config_json_and_an_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ConfigError, match="model.name"):
        load_model("llama9-1t")
