import torch
import torch.nn.functional as F

from llmscale.model.config import get_preset
from llmscale.model.transformer import apply_rope, build_model, rope_tables


def test_forward_shape_and_determinism() -> None:
    cfg = get_preset("tiny")
    x = torch.randint(0, cfg.vocab_size, (3, 17))
    a, b = build_model(cfg, seed=1), build_model(cfg, seed=1)
    assert a(x).shape == (3, 17, cfg.vocab_size)
    assert torch.equal(a(x), b(x))
    assert not torch.equal(a(x), build_model(cfg, seed=2)(x))


def test_causal_future_tokens_do_not_change_the_past() -> None:
    cfg = get_preset("tiny")
    m = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (1, 20))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 7) % cfg.vocab_size
    torch.testing.assert_close(m(x)[0, :12], m(y)[0, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(m(x)[0, 12:], m(y)[0, 12:])


def test_rope_preserves_norm_and_depends_on_relative_position() -> None:
    hd, s = 16, 32
    rope = rope_tables(hd, s, 10000.0)
    q = torch.randn(1, s, 1, hd)
    k = torch.randn(1, s, 1, hd)  # only its first position is used below
    qr = apply_rope(q, rope)
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1))
    # Same vectors at every position: the score depends only on the offset i - j.
    q_same = q[:, :1].expand(1, s, 1, hd)
    k_same = k[:, :1].expand(1, s, 1, hd)
    scores = torch.einsum("bihd,bjhd->ij", apply_rope(q_same, rope), apply_rope(k_same, rope))
    torch.testing.assert_close(scores[5, 2], scores[20, 17], rtol=1e-5, atol=1e-5)


def test_gqa_equals_attention_with_repeated_kv_heads() -> None:
    cfg = get_preset("tiny")
    assert cfg.n_kv_heads < cfg.n_heads
    q = torch.randn(2, cfg.n_heads, 10, cfg.head_dim)
    k = torch.randn(2, cfg.n_kv_heads, 10, cfg.head_dim)
    v = torch.randn(2, cfg.n_kv_heads, 10, cfg.head_dim)
    rep = cfg.n_heads // cfg.n_kv_heads
    m = build_model(cfg)
    got = m.layers["0"].attention.core(q, k, v)
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
    )
    torch.testing.assert_close(got, want)


def test_tied_embeddings_share_one_matrix() -> None:
    cfg = get_preset("gpt2-124m").with_overrides(
        n_layers=1, dim=64, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=300, max_seq_len=32
    )
    m = build_model(cfg)
    assert m.output is None
    x = torch.randint(0, 300, (2, 8))
    m(x).sum().backward()
    assert m.tok_embeddings.weight.grad is not None
    assert cfg.num_params() == sum(p.numel() for p in m.parameters())


def test_residual_output_projections_are_scaled_down() -> None:
    cfg = get_preset("small")
    m = build_model(cfg)
    wq = m.layers["0"].attention.wq.weight.std().item()
    wo = m.layers["0"].attention.wo.weight.std().item()
    assert abs(wo / wq - (2 * cfg.n_layers) ** -0.5) < 0.05


def test_squared_relu_ffn_is_relu_squared_between_two_matrices() -> None:
    """mlp = "relu2" (Nemotron-4's): w2(relu(w1 x)^2), two matrices, as many parameters as a
    GELU FFN of the same width."""

    from llmscale.model.config import ModelConfig
    from llmscale.model.transformer import FeedForward

    cfg = ModelConfig(dim=16, ffn_dim=32, mlp="relu2", bias=False)
    ffn = FeedForward(cfg)
    assert ffn.w3 is None and not cfg.gated
    x = torch.randn(2, 3, 16)
    assert torch.equal(ffn(x), ffn.w2(F.relu(ffn.w1(x)) ** 2))
    gelu = ModelConfig(dim=16, ffn_dim=32, mlp="gelu", bias=False)
    assert cfg.mlp_params() == gelu.mlp_params()
