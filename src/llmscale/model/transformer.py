"""A decoder-only transformer a reader can hold in their head.

Llama family by default (RMSNorm, RoPE, SwiGLU, grouped-query attention through
`F.scaled_dot_product_attention`), with the GPT-2/3 variants (LayerNorm, GELU, learned positions,
biases, tied embeddings) that the presets need. The model knows nothing of parallelism: blocks
live in a `ModuleDict` keyed by layer index so that a pipeline split can drop some and keep the
others' names, and attention reshapes with -1 heads so that a tensor-parallel shard (fewer local
heads) runs the same code.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmscale.model.config import ModelConfig, value_name


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)
    return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)


def rope_inv_freq(
    head_dim: int, theta: float, cfg: ModelConfig | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The rotation frequency of each pair, fp32, scaled as `cfg.rope_scaling` says.

    Computed as transformers computes them (`modeling_rope_utils`: default, linear, llama3), in
    fp32, so that an imported Llama 3.1 folder gets the very same angles.
    """
    exps = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exps)
    if cfg is None or cfg.rope_scaling == "none":
        return inv_freq
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    # llama3: wavelengths longer than the original context / low_freq_factor are divided by the
    # factor, those shorter than it / high_freq_factor are kept, and the band between is blended.
    low, high, old = (
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_max_seq_len,
    )
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def rope_tables(
    head_dim: int,
    seq_len: int,
    theta: float,
    device: torch.device | None = None,
    cfg: ModelConfig | None = None,
) -> torch.Tensor:
    """cos and sin of the rotation angles, stacked: shape (2, seq_len, head_dim // 2), fp32.

    `cfg` brings its RoPE scaling (`rope_inv_freq`); without it the frequencies are plain.
    """
    inv_freq = rope_inv_freq(head_dim, theta, cfg, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()))


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by the table's angles."""
    seq = x.shape[1]
    cos = rope[0, :seq].unsqueeze(1)  # (seq, 1, head_dim/2): broadcast over heads
    sin = rope[1, :seq].unsqueeze(1)
    xf = x.float().unflatten(-1, (-1, 2))  # type: ignore[no-untyped-call]  # torch: Tensor.unflatten unannotated
    x1, x2 = xf[..., 0], xf[..., 1]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class AttentionCore(nn.Module):
    """Causal scaled-dot-product attention on (batch, heads, seq, head_dim) tensors.

    A module of its own so that selective recomputation can checkpoint exactly this part.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.use_rope = cfg.pos_emb == "rope"
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.bias)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if self.use_rope:
            assert rope is not None
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        y: torch.Tensor = self.wo(out.transpose(1, 2).reshape(bs, seq, -1))
        return y


def ffn_activation(mlp: str, h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
    """The FFN's element-wise ops between its linears, by `ModelConfig.mlp`, on w1's output
    `h1` (and, SwiGLU, w3's `h3`): what the block runs and the calibration times."""
    if mlp == "swiglu":
        assert h3 is not None
        return F.silu(h1) * h3
    if mlp == "relu2":
        return F.relu(h1).square()
    return F.gelu(h1, approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.mlp = cfg.mlp
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)  # gate (SwiGLU) or fc
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)  # down / proj
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias) if cfg.gated else None  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h3 = self.w3(x) if self.w3 is not None else None
        y: torch.Tensor = self.w2(ffn_activation(self.mlp, self.w1(x), h3))
        return y


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = build_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = build_norm(cfg)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        h: torch.Tensor = x + self.attention(self.attention_norm(x), rope)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab).

    A pipeline stage may lack tok_embeddings (then it takes hidden states) or norm/output
    (then it returns hidden states); the forward handles each piece being None.
    """

    rope: torch.Tensor  # the RoPE table, a non-persistent buffer (empty without RoPE)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos_emb == "learned" else None
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = build_norm(cfg)
        self.output: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        )
        self.register_buffer(
            "rope",
            rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg=cfg)
            if cfg.pos_emb == "rope"
            else torch.empty(0),
            persistent=False,
        )
        # Absolute positions of the tokens this rank sees, from its sequence length and device;
        # None: 0 .. seq-1. Set by context parallelism (parallel/context_parallel.py), where a
        # rank holds load-balanced chunks of each sequence.
        self.positions: Callable[[int, torch.device], torch.Tensor] | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        h: torch.Tensor
        pos = None if self.positions is None else self.positions(seq, tokens.device)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                w = self.pos_embeddings.weight
                h = h + (w[:seq] if pos is None else w[pos])
        else:
            h = tokens  # hidden states from the previous pipeline stage
        rope = self.rope if self.cfg.pos_emb == "rope" else None
        if rope is not None and pos is not None:
            rope = rope[:, pos]
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is None:
            return h  # an earlier pipeline stage: hidden states go to the next one
        h = self.norm(h)
        if self.output is not None:
            logits: torch.Tensor = self.output(h)
            return logits
        assert self.tok_embeddings is not None, "tied head needs the embedding on this stage"
        return F.linear(h, self.tok_embeddings.weight)

    def initial_value(self, name: str, shape: tuple[int, ...], seed: int | None) -> torch.Tensor:
        """The full initial fp32 value (on the CPU) of parameter `name` of the whole model.

        Normal(0, init_std) for matrices and embeddings; the residual-branch outputs (wo, w2)
        scaled by 1/sqrt(2 * n_layers) as in GPT-2, so the residual stream's variance does not
        grow with depth; norms at 1, biases at 0. Each parameter draws from its own generator,
        seeded by (seed, name) (`param_seed`), so its value depends on nothing else: not on the
        other parameters, the device, or which of them a pipeline stage or shard holds. The
        last pipeline stage's copy of a tied embedding (`output.weight`) starts as the embedding.
        """
        name = value_name(self.cfg, name)
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:
            return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
        if leaf == "bias":
            return torch.zeros(shape)
        std = self.cfg.init_std
        if name.endswith(("wo.weight", "w2.weight")):
            std = std / math.sqrt(2 * self.cfg.n_layers)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(param_seed(0 if seed is None else seed, name))
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter and buffer (also after `to_empty` from the meta device)."""
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, tuple(p.shape), seed))
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """Compute the RoPE table (on `device`, default where the buffer is)."""
        if self.cfg.pos_emb == "rope":
            self.rope = rope_tables(
                self.cfg.head_dim,
                self.cfg.max_seq_len,
                self.cfg.rope_theta,
                device=device or self.rope.device,
                cfg=self.cfg,
            )


def param_seed(seed: int, name: str) -> int:
    """A parameter's own generator seed, from the run's seed and the parameter's name."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """A Transformer on `device`; on "meta" nothing is allocated (for counting big presets)."""
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"):
            return Transformer(cfg)
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(seed)
    return model


def count_params(model: nn.Module) -> int:
    """Parameters of a module, shared (tied) ones counted once."""
    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n
