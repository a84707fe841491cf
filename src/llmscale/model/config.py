"""Model shapes: one dataclass that feeds both the runtime and the planner.

This module must not import torch: the planner counts parameters and FLOPs from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from llmscale.errors import ConfigError

Norm = Literal["rmsnorm", "layernorm"]
Mlp = Literal["swiglu", "gelu"]
PosEmb = Literal["rope", "learned"]

NORMS: tuple[str, ...] = ("rmsnorm", "layernorm")
MLPS: tuple[str, ...] = ("swiglu", "gelu")
POS_EMBS: tuple[str, ...] = ("rope", "learned")

# Byte-level vocabulary: 256 byte values plus special tokens, padded to a multiple of 8 so that a
# vocabulary-parallel split over tp <= 8 ranks is even.
BYTE_VOCAB_SIZE = 264


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (Llama family, with GPT-2/3 variants for presets)."""

    name: str = "custom"
    vocab_size: int = BYTE_VOCAB_SIZE
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 192
    max_seq_len: int = 128
    norm: str = "rmsnorm"
    mlp: str = "swiglu"
    pos_emb: str = "rope"
    bias: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Published parameter count and where it comes from (presets only; checked in tests).
    published_params: int = 0
    published_source: str = ""

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        for f in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "max_seq_len",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.{f}", v, "a positive integer")
        if self.norm not in NORMS:
            raise ConfigError("model.norm", self.norm, " | ".join(NORMS))
        if self.mlp not in MLPS:
            raise ConfigError("model.mlp", self.mlp, " | ".join(MLPS))
        if self.pos_emb not in POS_EMBS:
            raise ConfigError("model.pos_emb", self.pos_emb, " | ".join(POS_EMBS))
        if self.dim % self.n_heads:
            raise ConfigError("model.n_heads", self.n_heads, f"a divisor of model.dim={self.dim}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "model.n_kv_heads", self.n_kv_heads, f"a divisor of model.n_heads={self.n_heads}"
            )
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ConfigError("model.dim", self.dim, "dim / n_heads even (RoPE rotates pairs)")
        if self.norm_eps <= 0:
            raise ConfigError("model.norm_eps", self.norm_eps, "a positive number")

    # ---- shapes -----------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection."""
        return self.n_kv_heads * self.head_dim

    @property
    def gated(self) -> bool:
        """SwiGLU has three FFN matrices (gate, up, down); GELU has two."""
        return self.mlp == "swiglu"

    # ---- parameter counts (exact, matching model/transformer.py) ----------------------------
    def attention_weights(self) -> int:
        """Weights of wq, wk, wv and wo."""
        d, kv = self.dim, self.kv_dim
        return 2 * d * d + 2 * d * kv

    def mlp_weights(self) -> int:
        """Weights of the FFN matrices (gate, up, down for SwiGLU; fc, proj for GELU)."""
        return (3 if self.gated else 2) * self.dim * self.ffn_dim

    def attention_params(self) -> int:
        biases = (2 * self.dim + 2 * self.kv_dim) if self.bias else 0
        return self.attention_weights() + biases

    def mlp_params(self) -> int:
        n_in = 2 if self.gated else 1
        biases = (n_in * self.ffn_dim + self.dim) if self.bias else 0
        return self.mlp_weights() + biases

    def norm_params(self) -> int:
        """One normalisation layer: a scale, plus a shift for LayerNorm with biases."""
        return self.dim * (2 if self.norm == "layernorm" and self.bias else 1)

    def layer_params(self) -> int:
        """One transformer block: attention, MLP and its two norms."""
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token embedding, plus learned positions where used."""
        pos = self.max_seq_len * self.dim if self.pos_emb == "learned" else 0
        return self.vocab_size * self.dim + pos

    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied to the embedding)."""
        out = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.norm_params() + out

    def num_params(self) -> int:
        """Total number of parameters (tied weights counted once)."""
        return self.embedding_params() + self.n_layers * self.layer_params() + self.head_params()

    def parameter_shapes(self, layer: int = 0) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """Every parameter tensor's name and shape, as `model/transformer.py` registers them.

        Grouped as {"embedding": [...], "block": [...], "head": [...]}; block names are those of
        layer `layer` (every block has the same shapes). The planner needs shapes, not just
        counts: FSDP pads each tensor's first dimension to a multiple of the shard count.
        """
        d, kv, f, v = self.dim, self.kv_dim, self.ffn_dim, self.vocab_size
        bias = self.bias

        def linear(name: str, out: int, inp: int) -> list[tuple[str, tuple[int, ...]]]:
            return [(f"{name}.weight", (out, inp))] + ([(f"{name}.bias", (out,))] if bias else [])

        def norm(name: str) -> list[tuple[str, tuple[int, ...]]]:
            shift = self.norm == "layernorm" and bias
            shape: tuple[int, ...] = (d,)
            return [(f"{name}.weight", shape)] + ([(f"{name}.bias", shape)] if shift else [])

        emb: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (v, d))]
        if self.pos_emb == "learned":
            emb.append(("pos_embeddings.weight", (self.max_seq_len, d)))
        p = f"layers.{layer}."
        block = norm(p + "attention_norm")
        block += linear(p + "attention.wq", d, d) + linear(p + "attention.wk", kv, d)
        block += linear(p + "attention.wv", kv, d) + linear(p + "attention.wo", d, d)
        block += norm(p + "ffn_norm")
        block += linear(p + "feed_forward.w1", f, d) + linear(p + "feed_forward.w2", d, f)
        if self.gated:
            block += linear(p + "feed_forward.w3", f, d)
        head = norm("norm")
        if not self.tie_embeddings:
            head.append(("output.weight", (v, d)))
        return {"embedding": emb, "block": block, "head": head}

    # ---- FLOPs ------------------------------------------------------------------------------
    def block_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of all transformer blocks: 2 per multiply-accumulate.

        Attention scores (QK^T) and the weighted sum (AV) cost 2*s*d multiply-accumulates per
        token per layer when the full s x s product is computed, as Narayanan et al. (2021)
        count it. Norms, softmax and element-wise ops are left out (< 1% at the sizes that
        matter).
        """
        weights = self.attention_weights() + self.mlp_weights()
        return 2.0 * self.n_layers * (weights + 2 * seq_len * self.dim)

    def attention_core_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of every block's QK^T and AV (what selective recompute redoes)."""
        return 2.0 * self.n_layers * 2 * seq_len * self.dim

    def head_forward_flops_per_token(self) -> float:
        """Forward FLOPs per token of the output projection to the vocabulary."""
        return 2.0 * self.vocab_size * self.dim

    def forward_flops_per_token(self, seq_len: int) -> float:
        return self.block_forward_flops_per_token(seq_len) + self.head_forward_flops_per_token()

    def train_flops_per_token(self, seq_len: int, recompute_fraction: float = 0.0) -> float:
        """Training FLOPs per token: forward, backward (2x forward), and recomputed forward.

        recompute_fraction is the share of the blocks' forward that runs a second time (1.0 for
        full recomputation); the output projection is never recomputed.
        """
        fwd = self.forward_flops_per_token(seq_len)
        return 3.0 * fwd + recompute_fraction * self.block_forward_flops_per_token(seq_len)

    # ---- conversion -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **overrides: Any) -> ModelConfig:
        known = {f.name for f in fields(self)}
        for k in overrides:
            if k not in known:
                raise ConfigError(f"model.{k}", k, "one of " + ", ".join(sorted(known)))
        return replace(self, **overrides)


def _llama(name: str, **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, **kw)


def _gpt(name: str, **kw: Any) -> ModelConfig:
    return ModelConfig(
        name=name,
        norm="layernorm",
        mlp="gelu",
        pos_emb="learned",
        bias=True,
        tie_embeddings=True,
        **kw,
    )


_HF = "https://huggingface.co/{} (safetensors parameter count)"

PRESETS: dict[str, ModelConfig] = {
    p.name: p
    for p in (
        _llama("tiny", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=128),
        _llama("small", dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=256),
        _gpt(
            "gpt2-124m",
            vocab_size=50257,
            dim=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=12,
            ffn_dim=3072,
            max_seq_len=1024,
            published_params=124_439_808,
            published_source=_HF.format("openai-community/gpt2"),
        ),
        _llama(
            "llama2-7b",
            vocab_size=32000,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=32,
            ffn_dim=11008,
            max_seq_len=4096,
            published_params=6_738_415_616,
            published_source=_HF.format("meta-llama/Llama-2-7b-hf"),
        ),
        _llama(
            "llama2-13b",
            vocab_size=32000,
            dim=5120,
            n_layers=40,
            n_heads=40,
            n_kv_heads=40,
            ffn_dim=13824,
            max_seq_len=4096,
            published_params=13_015_864_320,
            published_source=_HF.format("meta-llama/Llama-2-13b-hf"),
        ),
        _llama(
            "llama2-70b",
            vocab_size=32000,
            dim=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            ffn_dim=28672,
            max_seq_len=4096,
            published_params=68_976_648_192,
            published_source=_HF.format("meta-llama/Llama-2-70b-hf"),
        ),
        _llama(
            "llama3.2-1b",
            vocab_size=128256,
            dim=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=8192,
            max_seq_len=8192,
            rope_theta=500000.0,
            tie_embeddings=True,
            published_params=1_235_814_400,
            published_source=_HF.format("meta-llama/Llama-3.2-1B"),
        ),
        _llama(
            "llama3-8b",
            vocab_size=128256,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            max_seq_len=8192,
            rope_theta=500000.0,
            published_params=8_030_261_248,
            published_source=_HF.format("meta-llama/Meta-Llama-3-8B"),
        ),
        _llama(
            "llama3-70b",
            vocab_size=128256,
            dim=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            ffn_dim=28672,
            max_seq_len=8192,
            rope_theta=500000.0,
            published_params=70_553_706_496,
            published_source=_HF.format("meta-llama/Meta-Llama-3-70B"),
        ),
        _llama(
            "llama3-405b",
            vocab_size=128256,
            dim=16384,
            n_layers=126,
            n_heads=128,
            n_kv_heads=8,
            ffn_dim=53248,
            max_seq_len=8192,
            rope_theta=500000.0,
            published_params=405_000_000_000,
            published_source="Llama Team, 'The Llama 3 Herd of Models' (2024), Table 3: 405B",
        ),
        _gpt(
            "gpt3-175b",
            vocab_size=50257,
            dim=12288,
            n_layers=96,
            n_heads=96,
            n_kv_heads=96,
            ffn_dim=4 * 12288,
            max_seq_len=2048,
            published_params=175_000_000_000,
            published_source="Brown et al., 'Language Models are Few-Shot Learners' (2020), Table 2.1: 175.0B",
        ),
    )
}


def get_preset(name: str) -> ModelConfig:
    """Return a preset by name, or raise ConfigError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("model.name", name, " | ".join(PRESETS)) from None
