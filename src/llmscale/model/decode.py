"""Inference with a key/value cache: one forward over the prompt, then one token at a time.

It runs the trained `Transformer`'s own modules (embeddings, norms, projections, FFN, head) in
the same order as `Transformer.forward`, adding only what decoding needs: each layer's keys and
values are kept, so a new token attends to the cached ones instead of recomputing the whole
prefix. Training never goes through here. Positions come from the start offset (the RoPE table
row, or the learned position), so the cache holds at most `max_seq_len` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

from llmscale.model.transformer import Transformer, TransformerBlock, apply_rope


@dataclass
class KVCache:
    """Per layer, the keys and values of the tokens seen so far: (batch, kv_heads, seq, head_dim)."""

    keys: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    length: int = 0

    def extend(
        self, layer: str, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (batch, seq, vocab) of `tokens`, which follow the `cache.length` cached ones."""
    start, seq = cache.length, tokens.shape[1]
    cfg = model.cfg
    if start + seq > cfg.max_seq_len:
        raise ValueError(f"{start + seq} tokens exceed model.max_seq_len={cfg.max_seq_len}")
    assert model.tok_embeddings is not None and model.norm is not None, "a whole model"
    h = model.tok_embeddings(tokens)
    if model.pos_embeddings is not None:
        h = h + model.pos_embeddings.weight[start : start + seq]
    rope = model.rope[:, start : start + seq] if cfg.pos_emb == "rope" else None
    # Query i (at position start + i) sees keys 0 .. start + i.
    pos = torch.arange(start + seq, device=tokens.device)
    mask = pos[None, :] <= pos[start:, None]
    for name, block in model.layers.items():
        layer = cast(TransformerBlock, block)
        attn = layer.attention
        x = layer.attention_norm(h)
        bs = x.shape[0]
        q = attn.wq(x).view(bs, seq, -1, attn.head_dim)
        k = attn.wk(x).view(bs, seq, -1, attn.head_dim)
        v = attn.wv(x).view(bs, seq, -1, attn.head_dim)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        k_all, v_all = cache.extend(name, k.transpose(1, 2), v.transpose(1, 2))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_all, v_all, attn_mask=mask, enable_gqa=True
        )
        h = h + attn.wo(out.transpose(1, 2).reshape(bs, seq, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    cache.length = start + seq
    h = model.norm(h)
    if model.output is not None:
        return cast(torch.Tensor, model.output(h))
    return F.linear(h, model.tok_embeddings.weight)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
    vocab_limit: int | None = None,
    suppress: list[int] | None = None,
) -> list[int]:
    """The new token ids after `prompt` (stopping after `eos_id` or at model.max_seq_len).

    temperature 0 is greedy; otherwise logits / temperature, cut to the top_k best (0 = all),
    sampled from a generator seeded by `seed`. Ids at or above `vocab_limit` (the padding of a
    vocabulary padded for tensor parallelism) are never produced, nor those of `suppress` (ids
    inside it that the tokenizer has no token for).
    """
    model.eval()
    device = model.tok_embeddings.weight.device  # type: ignore[union-attr]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache = KVCache()
    budget = min(max_new_tokens, model.cfg.max_seq_len - len(prompt))
    out: list[int] = []
    if budget <= 0:
        return out
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache)[0, -1]
    for i in range(budget):
        logits = logits.float()
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[vocab_limit:] = -torch.inf
        if suppress:
            logits[suppress] = -torch.inf
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            scaled = logits / temperature
            if 0 < top_k < scaled.shape[-1]:
                kth = torch.topk(scaled, top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, -torch.inf)
            probs = torch.softmax(scaled, dim=-1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        out.append(nxt)
        if nxt == eos_id or i == budget - 1:
            break
        logits = forward_cached(model, torch.tensor([[nxt]], device=device), cache)[0, -1]
    return out
