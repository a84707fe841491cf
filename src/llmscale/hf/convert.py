"""The mapping between llmscale's model and Hugging Face's Llama and GPT-2, both ways.

No `transformers` import: the folders are plain files (config.json, model.safetensors), so
export and import work where only the main dependencies are installed.

What differs besides the names:
- RoPE. llmscale rotates consecutive pairs (x[2i], x[2i+1]) of each head by angle i; Hugging
  Face's Llama rotates halves (x[i], x[i + head_dim/2]). Same angles, so permuting the rows of wq
  and wk (and their biases) within each head turns one into the other (`_halves`/`_pairs`).
- GPT-2 stores its linears as Conv1D, (in, out) rather than (out, in), and q, k and v as one
  fused c_attn matrix.
Everything else (RMSNorm with its eps, SwiGLU as gate/up/down, untied or tied head, GQA, RoPE
scaling per frequency: `rope_parameters`) maps one to one. config.json is parsed by the torch-free
`model.config.from_hf_config`, which the planner reads too.
"""

from __future__ import annotations

from typing import Any

import torch

from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig, hf_rope_parameters

Family = str  # "llama" | "gpt2"


def export_family(cfg: ModelConfig) -> Family:
    """Which Hugging Face architecture holds `cfg` exactly, or ConfigError naming what differs."""
    llama = cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.pos_emb == "rope"
    if llama:
        return "llama"
    gpt = cfg.norm == "layernorm" and cfg.mlp == "gelu" and cfg.pos_emb == "learned"
    if gpt:
        if not cfg.bias:
            raise ConfigError("model.bias", cfg.bias, "true to export as GPT-2 (GPT-2 has biases)")
        if not cfg.tie_embeddings:
            raise ConfigError(
                "model.tie_embeddings", False, "true to export as GPT-2 (its head is tied)"
            )
        if cfg.n_kv_heads != cfg.n_heads:
            raise ConfigError(
                "model.n_kv_heads",
                cfg.n_kv_heads,
                f"model.n_heads={cfg.n_heads} to export as GPT-2 (no grouped-query attention)",
            )
        return "gpt2"
    raise ConfigError(
        "model",
        f"norm={cfg.norm}, mlp={cfg.mlp}, pos_emb={cfg.pos_emb}",
        "rmsnorm + swiglu + rope (Llama) or layernorm + gelu + learned (GPT-2) to export",
    )


# ---- config.json ------------------------------------------------------------------------------


def hf_config(
    cfg: ModelConfig, bos_id: int, eos_id: int, pad_id: int, dtype: str = "float32"
) -> dict[str, Any]:
    """config.json for `cfg` with weights of `dtype`, in the key names of transformers 5
    (`dtype`, not `torch_dtype`; RoPE in `rope_parameters` with `rope_theta` inside it)."""
    common = {
        "vocab_size": cfg.vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": dtype,
    }
    if export_family(cfg) == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": cfg.dim,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_dim,
            "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len,
            "activation_function": "gelu_new",  # GELU, tanh approximation, as llmscale's
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "initializer_range": cfg.init_std,
            **common,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": hf_rope_parameters(cfg),
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        **common,
    }


# ---- weights ----------------------------------------------------------------------------------


def _halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or bias) from consecutive-pair order to halves order, per head."""
    rest = w.shape[1:]
    return w.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def _pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_halves`."""
    rest = w.shape[1:]
    return w.reshape(heads, 2, -1, *rest).transpose(1, 2).reshape(w.shape).contiguous()


_LLAMA_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def _llama_name(name: str) -> str:
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, rest = name.split(".", 2)
    for ours, theirs in _LLAMA_BLOCK.items():
        if rest == ours or rest.startswith(ours + "."):
            return f"model.layers.{layer}.{theirs}{rest[len(ours) :]}"
    raise KeyError(name)


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llmscale's full state dict as the Hugging Face model's (Llama or GPT-2, `export_family`)."""
    if export_family(cfg) == "gpt2":
        return _to_gpt2(cfg, sd)
    out = {}
    for name, t in sd.items():
        if ".attention.wq." in name:
            t = _halves(t, cfg.n_heads)
        elif ".attention.wk." in name:
            t = _halves(t, cfg.n_kv_heads)
        out[_llama_name(name)] = t.contiguous()
    return out


def from_hf_llama(
    cfg: ModelConfig,
    hf_sd: dict[str, torch.Tensor],
    field: str = "checkpoint.init_from",
    src: str = "",
) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state dict as llmscale's; ConfigError naming the folder `src` and
    the missing tensor."""
    theirs_to_ours = {}
    names = ["tok_embeddings.weight", "norm.weight"]
    if not cfg.tie_embeddings:
        names.append("output.weight")
    for i in range(cfg.n_layers):
        for ours in _LLAMA_BLOCK:
            leaves = (
                [""] if ours.endswith(".weight") else [".weight"] + ([".bias"] if cfg.bias else [])
            )
            names += [f"layers.{i}.{ours}{leaf}" for leaf in leaves]
    for name in names:
        theirs_to_ours[_llama_name(name)] = name
    out = {}
    for theirs, ours in theirs_to_ours.items():
        if theirs not in hf_sd:
            raise ConfigError(
                field,
                src or theirs,
                f"a Llama folder holding every tensor its config.json implies ({theirs} is "
                f"missing: {cfg.n_layers} layers in config.json)",
            )
        t = hf_sd[theirs].float()
        if ".attention.wq." in ours:
            t = _pairs(t, cfg.n_heads)
        elif ".attention.wk." in ours:
            t = _pairs(t, cfg.n_kv_heads)
        out[ours] = t.contiguous()
    return out


def _to_gpt2(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {
        "transformer.wte.weight": sd["tok_embeddings.weight"],
        "transformer.wpe.weight": sd["pos_embeddings.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": sd["norm.bias"],
    }
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[h + theirs + ".weight"] = sd[p + ours + ".weight"]
            out[h + theirs + ".bias"] = sd[p + ours + ".bias"]
        qkv = [p + f"attention.{w}" for w in ("wq", "wk", "wv")]
        # Conv1D: (in, out), so the transposes; q, k and v side by side in one matrix.
        out[h + "attn.c_attn.weight"] = torch.cat([sd[n + ".weight"] for n in qkv]).t()
        out[h + "attn.c_attn.bias"] = torch.cat([sd[n + ".bias"] for n in qkv])
        for ours, theirs in (
            ("attention.wo", "attn.c_proj"),
            ("feed_forward.w1", "mlp.c_fc"),
            ("feed_forward.w2", "mlp.c_proj"),
        ):
            out[h + theirs + ".weight"] = sd[p + ours + ".weight"].t()
            out[h + theirs + ".bias"] = sd[p + ours + ".bias"]
    return {k: v.contiguous() for k, v in out.items()}


def drop_vocab_padding(
    cfg: ModelConfig, sd: dict[str, torch.Tensor], vocab: int
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`cfg` and llmscale's state dict `sd` cut to the tokenizer's `vocab` ids: the rows of the
    embedding and of the output projection past it (the padding to a multiple of 64 x tp, never
    in the data, never trained) are dropped, so that no probability lands on them."""
    if vocab >= cfg.vocab_size:
        return cfg, sd
    out = dict(sd)
    for name in ("tok_embeddings.weight", "output.weight"):
        if name in out:
            out[name] = out[name][:vocab]
    return cfg.with_overrides(vocab_size=vocab), out
