"""Model shapes, and the facts about running them that the runtime and the planner share.

This module must not import torch: the planner counts parameters and FLOPs from it. Besides
`ModelConfig` it states, once, what the runtime does and the planner predicts:

- `TP_STYLES` / `VOCAB_TP_STYLES` / `SP_MODULES` and `vocab_parallel`: which module is split
  column- or row-wise over tensor-parallel ranks, what sequence parallelism shards and gathers,
  whether the loss runs on vocabulary shards (`loss_parallel`, `sp_embedding_scatter`)
  (`parallel/tensor_parallel.py` maps them to DTensor styles; `plan/params.py` and
  `plan/activations.py` count from them);
- `stage_layer_counts`, `split_layers`, `auto_split_ok` and `stage_ids`: the layer -> pipeline
  stage -> rank placement, automatic or from `parallel.pp_layers` (`parallel/pipeline.py`, `plan/plan.py`);
- `block_recompute`, `op_sac_saves_matmul` and `ModelConfig.recompute_fraction`: which blocks
  each recompute mode checkpoints (the every-k rule), which matmul outputs selective_op keeps,
  and the share of forward FLOPs run again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, NamedTuple, get_args

from llmscale.errors import ConfigError

Norm = Literal["rmsnorm", "layernorm"]
Mlp = Literal["swiglu", "gelu", "relu2"]
PosEmb = Literal["rope", "learned"]
RopeScaling = Literal["none", "linear", "llama3"]

NORMS: tuple[Norm, ...] = get_args(Norm)
MLPS: tuple[Mlp, ...] = get_args(Mlp)
POS_EMBS: tuple[PosEmb, ...] = get_args(PosEmb)
ROPE_SCALINGS: tuple[RopeScaling, ...] = get_args(RopeScaling)

# Byte-level vocabulary: 256 byte values plus special tokens, padded to a multiple of 8 so that a
# vocabulary-parallel split over tp <= 8 ranks is even.
BYTE_VOCAB_SIZE = 264


# The integers that make a shape: each positive, and each required of a custom [model] table.
SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (Llama family, with GPT-2/3 variants for presets)."""

    name: str = "custom"
    """A preset (llmscale models) whose shape the other keys override."""
    vocab_size: int = BYTE_VOCAB_SIZE
    """Tokens in the vocabulary (the byte-level data uses 264)."""
    dim: int = 64
    """Width of the residual stream."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads; a divisor of dim."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); a divisor of n_heads."""
    ffn_dim: int = 192
    """Hidden width of the feed-forward network."""
    max_seq_len: int = 128
    """Longest sequence the model takes (RoPE table or learned positions)."""
    norm: Norm = "rmsnorm"
    """Normalisation before attention, before the FFN and at the output."""
    mlp: Mlp = "swiglu"
    """Feed-forward network: gated SwiGLU (three matrices), GELU (two) or squared ReLU (two,
    relu(x)^2: Primer, So et al. 2021; Nemotron-4)."""
    pos_emb: PosEmb = "rope"
    """Positions: rotary embeddings in attention, or a learned table added to the input."""
    bias: bool = False
    """Biases in the linear layers and the LayerNorms."""
    tie_embeddings: bool = False
    """The output projection shares the input embedding's matrix."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling = "none"
    """RoPE frequency scaling (Hugging Face's rope_type): linear divides every frequency by
    rope_factor; llama3 (Llama 3.1/3.2) divides the low ones, keeps the high ones and blends
    between (rope_low_freq_factor, rope_high_freq_factor, rope_original_max_seq_len)."""
    rope_factor: float = 1.0
    """Divisor of the scaled RoPE frequencies (rope_scaling linear or llama3)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths over rope_original_max_seq_len / this are fully scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths under rope_original_max_seq_len / this are kept."""
    rope_original_max_seq_len: int = 8192
    """llama3 scaling: the context length the model was first trained on."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    init_std: float = 0.02
    """Standard deviation of the weights' normal initialisation (wo, w2 scaled with depth)."""
    published_params: int = 0
    """Published parameter count (presets only; checked in tests)."""
    published_source: str = ""
    """Where published_params comes from (presets only)."""

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        for f in SHAPE_KEYS:
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
        # `not x > 0` rather than `x <= 0`: NaN fails every comparison; inf is no size either.
        for f in (
            "rope_theta",
            "norm_eps",
            "init_std",
            "rope_factor",
            "rope_low_freq_factor",
            "rope_high_freq_factor",
        ):
            v = getattr(self, f)
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"model.{f}", v, "a positive finite number")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ConfigError("model.rope_scaling", self.rope_scaling, " | ".join(ROPE_SCALINGS))
        v = self.rope_original_max_seq_len
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError("model.rope_original_max_seq_len", v, "a positive integer")
        if (
            self.rope_scaling == "llama3"
            and not self.rope_high_freq_factor > self.rope_low_freq_factor
        ):
            raise ConfigError(
                "model.rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"more than model.rope_low_freq_factor={self.rope_low_freq_factor}",
            )

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
        """SwiGLU has three FFN matrices (gate, up, down); GELU and squared ReLU have two."""
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
            shapes: list[tuple[str, tuple[int, ...]]] = [(f"{name}.weight", (out, inp))]
            return shapes + ([(f"{name}.bias", (out,))] if bias else [])

        def norm(name: str) -> list[tuple[str, tuple[int, ...]]]:
            shift = self.norm == "layernorm" and bias
            shapes: list[tuple[str, tuple[int, ...]]] = [(f"{name}.weight", (d,))]
            return shapes + ([(f"{name}.bias", (d,))] if shift else [])

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

    def block_matmuls(self) -> list[tuple[str, int, int]]:
        """A block's matmuls in the order its forward runs them: (module, in, out features)."""
        d, kv, f = self.dim, self.kv_dim, self.ffn_dim
        mlp = [("w1", d, f), ("w3", d, f)] if self.gated else [("w1", d, f)]
        return [("wq", d, d), ("wk", d, kv), ("wv", d, kv), ("wo", d, d), *mlp, ("w2", f, d)]

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

    def recompute_fraction(self, mode: str, seq_len: int, every_k: int = 2) -> float:
        """Share of the blocks' forward FLOPs that `mode` runs a second time in backward.

        full: every block (1.0); every_k: the blocks `block_recompute` checkpoints; selective:
        the attention core (QK^T, AV: the runtime checkpoints `AttentionCore`, the SDPA call);
        selective_op: the matmuls `op_sac_saves_matmul` does not save (the attention kernel is
        saved, so QK^T and AV are not redone); none: 0. For `train_flops_per_token` (HFU counts
        it, MFU does not). Element-wise work redone (norms, RoPE, activations) is not FLOPs here.
        """
        if mode == "selective":
            return self.attention_core_flops_per_token(
                seq_len
            ) / self.block_forward_flops_per_token(seq_len)
        if mode == "selective_op":
            redone = sum(
                n_in * n_out
                for i, (_, n_in, n_out) in enumerate(self.block_matmuls())
                if not op_sac_saves_matmul(i)
            )
            return 2.0 * self.n_layers * redone / self.block_forward_flops_per_token(seq_len)
        n = self.n_layers
        return sum(block_recompute(mode, i, every_k) == "full" for i in range(n)) / n

    # ---- conversion -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def seq_len_allowed(self) -> str:
        """What a planning command accepts as a sequence length for this model, and how to plan
        a longer context (a preset's max_seq_len is its released context)."""
        longer = [
            n
            for n, p in PRESETS.items()
            if p.max_seq_len > self.max_seq_len and p.shape_key() == self.shape_key()
        ]
        twin = (
            f"--model {longer[0]} ({PRESETS[longer[0]].max_seq_len:,} tokens), or "
            if longer
            else ""
        )
        return (
            f"<= model.max_seq_len={self.max_seq_len} (a longer context: {twin}--model FILE.toml "
            f'whose [model] table has name = "{self.name}" and max_seq_len = N)'
        )

    def shape_key(self) -> tuple[Any, ...]:
        """What sizes the model's work, whatever its context length and positions' scaling."""
        return (self.vocab_size, self.dim, self.n_layers, self.n_heads, self.n_kv_heads,
                self.ffn_dim, self.norm, self.mlp, self.pos_emb, self.bias, self.tie_embeddings)  # fmt: skip

    def with_overrides(self, **overrides: Any) -> ModelConfig:
        known = {f.name for f in fields(self)}
        for k in overrides:
            if k not in known:
                raise ConfigError(f"model.{k}", k, "one of " + ", ".join(sorted(known)))
        return replace(self, **overrides)


# ---- facts shared by the runtime and the planner ------------------------------------------------

TPStyle = Literal["colwise", "rowwise"]


class TPSplit(NamedTuple):
    """How one module is split over tensor-parallel ranks (torch's Colwise/RowwiseParallel)."""

    style: TPStyle
    embedding: bool = False  # an nn.Embedding (weight [vocab, dim]) rather than a nn.Linear
    gather_output: bool = False  # the output is all-gathered to every rank (not left sharded)

    def sharded_dim(self, param: str) -> int | None:
        """The dimension of `param` ("weight" or "bias") split over tp; None: replicated.

        Colwise: a linear's weight [out, in] on dim 0 and its bias; an embedding on dim 1.
        Rowwise: a linear's weight on dim 1 (its bias stays whole); an embedding on dim 0 (the
        vocabulary). torch.distributed.tensor.parallel.style is the reference.
        """
        if self.style == "colwise":
            return 1 if self.embedding and param == "weight" else 0
        if param == "weight":
            return 0 if self.embedding else 1
        return None


# Each block's linears, by module path inside the block (torchtitan's Llama plan, Megatron's
# split): q, k, v and the FFN's input projections column-wise (heads, hidden units per rank),
# the output projections row-wise (partial sums, reduced). Norms are replicated.
TP_STYLES: dict[str, TPSplit] = {
    "attention.wq": TPSplit("colwise"),
    "attention.wk": TPSplit("colwise"),
    "attention.wv": TPSplit("colwise"),
    "attention.wo": TPSplit("rowwise"),
    "feed_forward.w1": TPSplit("colwise"),
    "feed_forward.w2": TPSplit("rowwise"),
    "feed_forward.w3": TPSplit("colwise"),
}
# Root modules under vocabulary parallelism (see `vocab_parallel`): the embedding looks up its
# vocabulary range and a reduce sums; the output projection computes its vocabulary columns and
# leaves the logits split over the vocabulary: the loss runs on the shards (torch's
# `loss_parallel`, Megatron's vocab-parallel cross-entropy), so the full logits are never
# gathered (see `loss_parallel`).
VOCAB_TP_STYLES: dict[str, TPSplit] = {
    "tok_embeddings": TPSplit("rowwise", embedding=True),
    "output": TPSplit("colwise", gather_output=False),
}
# Sequence parallelism: these norms run on seq / tp tokens (the residual stream between them is
# sharded on the sequence); the inputs of these modules are all-gathered to the whole sequence,
# and the gathered copy is what their first linears save for backward.
SP_SHARDED_MODULES: tuple[str, ...] = ("attention_norm", "ffn_norm", "norm")
SP_GATHERED_INPUTS: tuple[str, ...] = ("attention", "feed_forward")


def vocab_parallel(model: ModelConfig, tp: int) -> bool:
    """Whether the embedding and the output projection are split over `tp` ranks.

    Untied models split both along the vocabulary; a tied matrix cannot be row- and column-split
    at once, so tied models keep both replicated. tp = 1 splits nothing.
    """
    return tp > 1 and not model.tie_embeddings


def loss_parallel(model: ModelConfig, tp: int) -> bool:
    """Whether the loss runs on vocabulary shards of the logits (torch's `loss_parallel`,
    Megatron's vocab-parallel cross-entropy) rather than on logits gathered whole on every tp
    rank: wherever the output projection is vocabulary-parallel."""
    return vocab_parallel(model, tp) and not VOCAB_TP_STYLES["output"].gather_output


def sp_embedding_scatter(model: ModelConfig, tp: int) -> bool:
    """Under sequence parallelism: does the embedding itself leave the sequence split?

    Yes for a vocabulary-parallel embedding without learned positions: its partial sums are
    reduce-scattered onto sequence shards. Otherwise the embedding's output is whole on every
    tp rank (a vocabulary-parallel one all-reduces; learned positions are added to the whole
    sequence, as Megatron does) and the first block's input is split on the sequence, each rank
    keeping its slice (no communication). With tied embeddings the final norm's output is
    all-gathered before the (replicated) head, whose logits are whole on every rank.
    """
    return vocab_parallel(model, tp) and model.pos_emb == "rope"


# Tied embeddings under pipeline parallelism: the last stage cannot read the first stage's
# embedding, so it keeps a copy of it as its own output projection (Megatron's scheme; DeepSpeed's
# TiedLayerSpec), initialised from the embedding and kept equal to it (parallel/tied_embeddings.py).
EMBEDDING_WEIGHT = "tok_embeddings.weight"
TIED_HEAD_WEIGHT = "output.weight"


def tied_copy(model: ModelConfig, pp: int, *, v_shape: bool = False) -> bool:
    """Whether the last pipeline stage keeps a copy of the tied embedding: pp > 1 and tied,
    except where the first and the last stage share a rank (`v_shape`: zbv, dualpipev). There
    the head and the embedding are one tensor, with or without a data-parallel wrapper: the last
    stage's `output.weight`, which the first stage's embedding reads
    (`parallel.tied_embeddings.SharedEmbedding`; under FSDP2 it gathers the last stage's root
    unit first, which then holds the tied weight and the final norm, while the first stage's
    root holds no tied weight: `stack.residency.stage_units`)."""
    return pp > 1 and model.tie_embeddings and not v_shape


def value_name(model: ModelConfig, name: str) -> str:
    """The parameter whose value parameter `name` holds: `name` itself, except the last stage's
    copy of a tied embedding, which holds the embedding's (its initial value, its checkpointed
    value, its value in a Hugging Face folder)."""
    return EMBEDDING_WEIGHT if model.tie_embeddings and name == TIED_HEAD_WEIGHT else name


def tp_split(param_name: str, vocab_split: bool) -> TPSplit | None:
    """The split of the module owning parameter `param_name` ("layers.3.attention.wq.weight")."""
    module = param_name.rsplit(".", 1)[0]
    if module.startswith("layers."):
        return TP_STYLES.get(module.split(".", 2)[-1])
    return VOCAB_TP_STYLES.get(module) if vocab_split else None


def pp_layers_problem(pp_layers: list[int] | tuple[int, ...], n_layers: int, n_stages: int) -> str:
    """What is wrong with an explicit `parallel.pp_layers` list ("" when nothing is). The first
    stage may hold no layer (the embedding alone) and so may the last (the final norm, output
    projection and loss alone), as Megatron-Core's account_for_embedding_in_pipeline_split and
    account_for_loss_in_pipeline_split place them; every other stage holds at least one."""
    if len(pp_layers) != n_stages:
        return f"{n_stages} entries (one per pipeline stage: pp x pp_chunks), got {len(pp_layers)}"
    problem = pp_layer_counts_problem(pp_layers)
    if problem:
        return problem
    if n_stages == 1 and pp_layers[0] < 1:
        return "at least one layer on every stage but the first and the last"
    if sum(pp_layers) != n_layers:
        return f"layer counts summing to model.n_layers={n_layers}, got {sum(pp_layers)}"
    return ""


def pp_layer_counts_problem(pp_layers: list[int] | tuple[int, ...]) -> str:
    """What is wrong with the entries of a layer split, whatever the model ("" when nothing is):
    integers >= 0, and 0 only on the first or the last stage."""
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in pp_layers):
        return "layer counts >= 0 (0 only for the first or the last stage)"
    if any(n < 1 for n in pp_layers[1:-1]):
        return "at least one layer on every stage but the first and the last"
    return ""


def auto_split_ok(n_layers: int, n_stages: int) -> bool:
    """Can the automatic split (`stage_layer_counts` without `pp_layers`) place `n_layers`
    layers on `n_stages` stages: at most one stage per layer, or exactly two more (the
    embedding and the head each on a stage of their own)."""
    return 1 <= n_stages <= n_layers or (n_layers >= 1 and n_stages == n_layers + 2)


def stage_layer_counts(
    n_layers: int, n_stages: int, pp_layers: list[int] | tuple[int, ...] = ()
) -> list[int]:
    """Layers of each pipeline stage: `pp_layers` when given, else automatic.

    Automatic: floor(L / stages) or ceil(L / stages) each; the extra layers go to the middle
    stages first (rank 1 upwards), then to the first stage, then to the last, so that the
    first stage (embedding) and the last (final norm, output projection and loss) are the
    lighter ones. 126 layers over 4 stages: 31, 32, 32, 31. Over L + 2 stages the first holds
    the embedding alone and the last the head alone, one layer on each stage between: 126
    layers over pp 16 x 8 chunks are 0, 1, ..., 1, 0. This is Megatron-Core's split with
    account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split (the
    embedding and the loss each take a layer's slot; Megatron-Bridge's Llama 3.1 405B recipe
    sets both), which equals the split above wherever its slots divide and the end stages
    keep a layer.
    """
    if pp_layers:
        problem = pp_layers_problem(pp_layers, n_layers, n_stages)
        if problem:
            raise ValueError(f"parallel.pp_layers = {list(pp_layers)}: expected {problem}")
        return list(pp_layers)
    if not auto_split_ok(n_layers, n_stages):
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    if n_stages == n_layers + 2:
        return [0, *([1] * n_layers), 0]
    base, extra = divmod(n_layers, n_stages)
    order = [*range(1, n_stages - 1), 0, n_stages - 1] if n_stages > 1 else [0]
    heavy = set(order[:extra])
    return [base + (1 if s in heavy else 0) for s in range(n_stages)]


def split_layers(
    n_layers: int, n_stages: int, pp_layers: list[int] | tuple[int, ...] = ()
) -> list[range]:
    """Contiguous layer ranges, one per pipeline stage (`stage_layer_counts` sizes)."""
    out, start = [], 0
    for size in stage_layer_counts(n_layers, n_stages, pp_layers):
        out.append(range(start, start + size))
        start += size
    return out


def stage_ids(pp_rank: int, pp: int, chunks: int, v_shape: bool = False) -> list[int]:
    """Stages held by pipeline rank `pp_rank`: loop style r, r + pp, r + 2 pp, ...; with
    `v_shape` (zbv, dualpipev: exactly two chunks) r and 2 pp - 1 - r."""
    if v_shape:
        if chunks != 2:
            raise ValueError(f"a V placement holds exactly 2 chunks per rank, not {chunks}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(chunks)]


BlockMode = Literal["none", "selective", "selective_op", "full"]


def block_recompute(mode: str, layer_id: int, every_k: int = 2) -> BlockMode:
    """What train.recompute = `mode` does to block `layer_id`.

    full: the whole block is checkpointed (only its input kept); every_k: blocks k-1, 2k-1, ...
    are, the others are not; selective: the block's attention core is checkpointed;
    selective_op: the whole block is checkpointed with an op-level policy that keeps some
    outputs (`op_sac_saves_matmul`, the attention kernel's); none: none.
    """
    if mode == "every_k":
        return "full" if (layer_id + 1) % every_k == 0 else "none"
    if mode in ("full", "selective", "selective_op", "none"):
        return mode  # type: ignore[return-value]
    raise ConfigError("train.recompute", mode, "none | selective | selective_op | every_k | full")


# Collectives whose outputs selective_op keeps (torchtitan's op-level list: the sequence-parallel
# reduce-scatter); a block's other tensor-parallel collectives (sequence parallelism's
# all-gathers, the all-reduces without it) run again when its forward is recomputed in backward.
OP_SAC_SAVED_COLLECTIVES = frozenset({"reduce_scatter"})


def op_sac_saves_matmul(index: int) -> bool:
    """selective_op: does a block keep the output of its `index`-th matmul (0-based, in
    `ModelConfig.block_matmuls` order)? Every other one, from the first (torchtitan's op-level
    policy: wq, wv, w1, w2 for SwiGLU; wq, wv, w1 for GELU); the rest are recomputed."""
    return index % 2 == 0


# Each family's architecture: Llama's (RMSNorm, SwiGLU, RoPE, no biases) is ModelConfig's default;
# GPT-2 and GPT-3 use LayerNorm, GELU, learned positions and biases.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "gpt": {"norm": "layernorm", "mlp": "gelu", "pos_emb": "learned", "bias": True},
}
_BYTES = BYTE_VOCAB_SIZE  # the byte-level tokenizer (tiny, small)

# One preset a row: vocabulary, width, layers, attention heads and key/value heads, FFN width,
# longest sequence, RoPE base (theta) and whether the head shares the embedding's matrix (tied).
# fmt: off
_SHAPES: tuple[tuple[str, str, int, int, int, int, int, int, int, float, bool], ...] = (
    # name          family   vocab   dim    layers heads kv  ffn    seq   theta     tied
    ("tiny",        "llama", _BYTES, 64,    4,     4,    2,  192,   128,  10000.0,  False),
    ("small",       "llama", _BYTES, 256,   6,     8,    4,  768,   256,  10000.0,  False),
    ("gpt2-124m",   "gpt",   50257,  768,   12,    12,   12, 3072,  1024, 10000.0,  True),
    ("llama2-7b",   "llama", 32000,  4096,  32,    32,   32, 11008, 4096, 10000.0,  False),
    ("llama2-13b",  "llama", 32000,  5120,  40,    40,   40, 13824, 4096, 10000.0,  False),
    ("llama2-70b",  "llama", 32000,  8192,  80,    64,   8,  28672, 4096, 10000.0,  False),
    ("llama3.2-1b", "llama", 128256, 2048,  16,    32,   8,  8192,  8192, 500000.0, True),
    ("llama3-8b",   "llama", 128256, 4096,  32,    32,   8,  14336, 8192, 500000.0, False),
    ("llama3-70b",  "llama", 128256, 8192,  80,    64,   8,  28672, 8192, 500000.0, False),
    ("llama3-405b", "llama", 128256, 16384, 126,   128,  8,  53248, 8192, 500000.0, False),
    ("gpt3-175b",   "gpt",   50257,  12288, 96,    96,   96, 49152, 2048, 10000.0,  True),
)
# fmt: on

_HF = "https://huggingface.co/{} (safetensors parameter count)"

# The published parameter count of a preset and where it comes from.
_PUBLISHED: dict[str, tuple[int, str]] = {
    "gpt2-124m": (124_439_808, _HF.format("openai-community/gpt2")),
    "llama2-7b": (6_738_415_616, _HF.format("meta-llama/Llama-2-7b-hf")),
    "llama2-13b": (13_015_864_320, _HF.format("meta-llama/Llama-2-13b-hf")),
    "llama2-70b": (68_976_648_192, _HF.format("meta-llama/Llama-2-70b-hf")),
    "llama3.2-1b": (1_235_814_400, _HF.format("meta-llama/Llama-3.2-1B")),
    "llama3-8b": (8_030_261_248, _HF.format("meta-llama/Meta-Llama-3-8B")),
    "llama3-70b": (70_553_706_496, _HF.format("meta-llama/Meta-Llama-3-70B")),
    "llama3-405b": (
        405_000_000_000,
        "Llama Team, 'The Llama 3 Herd of Models' (2024), Table 3: 405B",
    ),
    "gpt3-175b": (
        175_000_000_000,
        "Brown et al., 'Language Models are Few-Shot Learners' (2020), Table 2.1: 175.0B",
    ),
}


def _preset(
    name: str,
    family: str,
    vocab: int,
    dim: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    seq: int,
    theta: float,
    tied: bool,
) -> ModelConfig:
    params, source = _PUBLISHED.get(name, (0, ""))
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=ffn,
        max_seq_len=seq,
        rope_theta=theta,
        tie_embeddings=tied,
        published_params=params,
        published_source=source,
        **_FAMILIES[family],
    )


PRESETS: dict[str, ModelConfig] = {row[0]: _preset(*row) for row in _SHAPES}

# Llama 3.1: Llama 3's shapes with a 128K context, RoPE scaled by rope_type "llama3" (factor 8,
# low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192, and
# max_position_embeddings 131072 in the config.json of meta-llama/Llama-3.1-8B and -70B). The
# published runs at 32K-256K tokens (torchtitan's context-parallel tables) are of these.
for _size in ("8b", "70b", "405b"):
    _base = PRESETS[f"llama3-{_size}"]
    PRESETS[f"llama3.1-{_size}"] = replace(
        _base,
        name=f"llama3.1-{_size}",
        max_seq_len=131072,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=8192,
        published_source=(
            _HF.format(f"meta-llama/Llama-3.1-{_size.upper()}") + ", the same shape as Llama 3"
            if _size != "405b"
            else _base.published_source
        ),
    )


def model_overrides(model: ModelConfig) -> list[str]:
    """`llmscale train` overrides that give `model`'s shape: its preset's name, then every field
    that differs from that preset (a custom shape: from the defaults)."""
    base = PRESETS.get(model.name, ModelConfig())
    out = [f"--model.name {model.name}"]
    for f in fields(model):
        if f.name in ("name", "published_params", "published_source"):
            continue
        value = getattr(model, f.name)
        if value != getattr(base, f.name):
            out.append(
                f"--model.{f.name} {str(value).lower() if isinstance(value, bool) else value}"
            )
    return out


def get_preset(name: str) -> ModelConfig:
    """Return a preset by name, or raise ConfigError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("model.name", name, " | ".join(PRESETS)) from None


# ---- Hugging Face config.json -------------------------------------------------------------------

# The ModelConfig field behind each key of Hugging Face's rope_parameters (rope_scaling), and the
# keys each rope_type uses: read by `from_hf_config`, written by `hf_rope_parameters`.
HF_ROPE_KEYS: dict[str, str] = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_seq_len",
}
HF_ROPE_TYPE_KEYS: dict[RopeScaling, tuple[str, ...]] = {
    "none": (),
    "linear": ("factor",),
    "llama3": tuple(HF_ROPE_KEYS),
}


# The config.json keys that make a Hugging Face model a mixture of experts (Mixtral's,
# Qwen-MoE's and DeepSeek's expert counts): refused by name rather than as an unknown type.
HF_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def hf_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """`cfg`'s RoPE as transformers' `rope_parameters` (rope_type "default" for unscaled)."""
    out: dict[str, Any] = {
        "rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
        "rope_theta": cfg.rope_theta,
    }
    for key in HF_ROPE_TYPE_KEYS[cfg.rope_scaling]:
        out[key] = getattr(cfg, HF_ROPE_KEYS[key])
    return out


def from_hf_config(
    hf: dict[str, Any], field: str = "model", source: str = "config.json"
) -> ModelConfig:
    """The llmscale shape of a Hugging Face config.json: Llama; for the planner also GPT-2, and
    Mistral without a sliding window (then a Llama block exactly: transformers' MistralModel
    differs from LlamaModel only in the window).

    Reads RoPE from `rope_parameters` (transformers 5, `rope_theta` inside it) or from the older
    `rope_scaling` plus a top-level `rope_theta`: rope_type default, linear or llama3. Anything
    llmscale's model cannot hold exactly is refused with ConfigError(field, source, what is
    needed), naming the config.json key.
    """

    def bad(what: str) -> ConfigError:
        return ConfigError(field, source, what)

    def number(key: str, value: Any, kind: type = float) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int:
            ok = ok and float(value).is_integer()
        if not ok or not (value > 0 and math.isfinite(value)):
            noun = "integer" if kind is int else "number"
            raise bad(f"config.json {key} a positive {noun} (got {value!r})")
        return kind(value)

    def need(*keys: str) -> None:
        missing = [k for k in keys if k not in hf]
        if missing:
            raise bad(f"a config.json with {', '.join(missing)}")

    model_type = hf.get("model_type")
    if model_type == "gpt2":
        need("vocab_size", "n_embd", "n_layer", "n_head")
        dim = number("n_embd", hf["n_embd"], int)
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise bad(f"config.json activation_function 'gelu_new' (got {act!r})")
        heads = number("n_head", hf["n_head"], int)
        return ModelConfig(
            name="custom",
            vocab_size=number("vocab_size", hf["vocab_size"], int),
            dim=dim,
            n_layers=number("n_layer", hf["n_layer"], int),
            n_heads=heads,
            n_kv_heads=heads,
            ffn_dim=number("n_inner", hf.get("n_inner") or 4 * dim, int),
            max_seq_len=number("n_positions", hf.get("n_positions", 1024), int),
            norm_eps=number("layer_norm_epsilon", hf.get("layer_norm_epsilon", 1e-5)),
            init_std=number("initializer_range", hf.get("initializer_range", 0.02)),
            tie_embeddings=True,
            **_FAMILIES["gpt"],
        )
    experts = next((k for k in HF_EXPERT_KEYS if hf.get(k)), None)
    if experts is not None:
        raise bad(
            f"a dense model (config.json {experts} = {hf[experts]!r}: a mixture of experts, "
            "which llmscale does not model)"
        )
    if model_type == "mistral" and hf.get("sliding_window") is not None:
        raise bad(
            f"config.json sliding_window null (got {hf['sliding_window']!r}): llmscale's "
            "attention is full causal"
        )
    if model_type not in ("llama", "mistral"):
        raise bad(
            "a Llama folder (config.json model_type 'llama'; for planning also 'gpt2', or "
            "'mistral' without a sliding window)"
        )
    need("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    need("num_attention_heads")
    dim = number("hidden_size", hf["hidden_size"], int)
    heads = number("num_attention_heads", hf["num_attention_heads"], int)
    head_dim = number("head_dim", hf.get("head_dim") or dim // heads, int)
    if head_dim * heads != dim:
        raise bad("config.json head_dim x num_attention_heads = hidden_size")
    if hf.get("hidden_act", "silu") != "silu":
        raise bad(f"config.json hidden_act 'silu' (got {hf.get('hidden_act')!r})")
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attn_bias != mlp_bias:
        raise bad("config.json attention_bias equal to mlp_bias (one bias switch)")
    rope = _hf_rope(hf, bad, number)
    return ModelConfig(
        name="custom",
        vocab_size=number("vocab_size", hf["vocab_size"], int),
        dim=dim,
        n_layers=number("num_hidden_layers", hf["num_hidden_layers"], int),
        n_heads=heads,
        n_kv_heads=number("num_key_value_heads", hf.get("num_key_value_heads") or heads, int),
        ffn_dim=number("intermediate_size", hf["intermediate_size"], int),
        max_seq_len=number("max_position_embeddings", hf.get("max_position_embeddings", 2048), int),
        bias=attn_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        init_std=number("initializer_range", hf.get("initializer_range", 0.02)),
        **rope,
    )


def _hf_rope(hf: dict[str, Any], bad: Any, number: Any) -> dict[str, Any]:
    """ModelConfig's rope_* fields from a Llama config.json (see `from_hf_config`)."""
    params = hf.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = hf.get("rope_scaling"), "rope_scaling"
    params = params or {}
    if not isinstance(params, dict):
        raise bad(f"config.json {key} an object (got {params!r})")
    kind = params.get("rope_type", params.get("type", "default"))
    allowed = {"default": "none", "linear": "linear", "llama3": "llama3"}
    if kind not in allowed:
        raise bad(f"config.json {key}.rope_type default | linear | llama3 (got {kind!r})")
    scaling: RopeScaling = allowed[kind]  # type: ignore[assignment]
    out: dict[str, Any] = {
        "rope_scaling": scaling,
        "rope_theta": number(
            f"{key}.rope_theta", params.get("rope_theta", hf.get("rope_theta", 10000.0))
        ),
    }
    for k in HF_ROPE_TYPE_KEYS[scaling]:
        if k not in params:
            if k == "original_max_position_embeddings":
                continue  # transformers falls back to max_position_embeddings; so do we below
            raise bad(f"config.json {key}.{k} for rope_type {kind!r}")
        kind_of = int if k == "original_max_position_embeddings" else float
        out[HF_ROPE_KEYS[k]] = number(f"{key}.{k}", params[k], kind_of)
    if scaling == "llama3" and "rope_original_max_seq_len" not in out:
        out["rope_original_max_seq_len"] = number(
            "max_position_embeddings", hf.get("max_position_embeddings", 2048), int
        )
    return out
