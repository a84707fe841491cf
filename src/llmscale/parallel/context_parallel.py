"""Context parallelism: each sequence split over the cp ranks, attention as a causal ring.

Load balancing. A sequence of length s is cut into 2 cp chunks of s / (2 cp) tokens; cp rank r
holds chunks r and 2 cp - 1 - r (Megatron's and torch's `context_parallel` split), so every rank
holds as many early queries (which attend to little) as late ones (which attend to much) and the
causal work is the same on every rank. `load_balanced_indices` gives a rank's token positions;
the trainer takes those columns of every sample's inputs and targets (`shard_sequence`), and the
model places RoPE (or learned positions) at those absolute positions (`Transformer.positions`).

The ring. q, k and v of a rank cover its two chunks. In cp steps each rank attends with its
queries to the key/value chunks of every rank: step t uses those of rank r - t, received from
rank r - 1 while step t - 1 computes (point-to-point `batch_isend_irecv` over the cp group). A
(query chunk, key chunk) pair is skipped when the keys come after the queries, causal on the
diagonal and full before it. The blocks' outputs are merged with the online softmax: each block
returns its output and log-sum-exp, and out = sum_b out_b exp(lse_b - lse) with
lse = logaddexp over b. The backward recomputes each block's probabilities from the saved final
lse, accumulates dq in place and sends dk, dv around the ring with the keys they belong to: after
cp steps (and one last pass) each rank holds the gradients of its own k and v.

The math runs in fp32 whatever the inputs' dtype (the blocks are plain matmuls, so it runs on the
CPU, where torch 2.13's `context_parallel` does not). Grouped-query attention is handled by
expanding k and v to the query heads inside each block; the ring carries the unexpanded ones.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmscale.model.transformer import AttentionCore, Transformer


def load_balanced_indices(
    seq_len: int, cp: int, rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Positions (int64) of the tokens cp rank `rank` holds: chunks rank and 2 cp - 1 - rank of
    2 cp equal chunks of the sequence."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} is not a multiple of 2 x cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat((first, second))


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's load-balanced columns of `t` along `dim` (the sequence)."""
    if cp == 1:
        return t
    idx = load_balanced_indices(t.shape[dim], cp, rank, t.device)
    return t.index_select(dim, idx).contiguous()


def local_positions(cp: int, rank: int, local_len: int, device: torch.device) -> torch.Tensor:
    """Absolute positions of a rank's `local_len` tokens (a sequence of local_len x cp)."""
    return load_balanced_indices(local_len * cp, cp, rank, device)


# ---- the ring -------------------------------------------------------------------------------
def _start_pass(send: torch.Tensor, group: Any, tag: int) -> tuple[torch.Tensor, list[Any]]:
    """Send `send` to the next cp rank and receive the previous one's into a new tensor."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (r + 1) % cp)
    prv = dist.get_global_rank(group, (r - 1) % cp)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, nxt, group, tag),
        dist.P2POp(dist.irecv, recv, prv, group, tag),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _pairs(rank: int, src: int, cp: int, c: int) -> list[tuple[slice, slice, bool]]:
    """(query slice, key slice, causal) of the blocks rank `rank` computes with rank `src`'s
    keys: a pair is skipped when the key chunk comes after the query chunk."""
    out = []
    for qi, qc in enumerate((rank, 2 * cp - 1 - rank)):
        for ki, kc in enumerate((src, 2 * cp - 1 - src)):
            if kc <= qc:
                out.append((slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c), kc == qc))
    return out


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """k or v with its heads repeated for grouped-query attention (SDPA's enable_gqa order)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: sum over each group's query heads."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)  # type: ignore[no-untyped-call]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """Causal attention over a load-balanced, cp-sharded sequence (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float
    ) -> torch.Tensor:
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        groups = q.shape[1] // k.shape[1]
        qf = q.float()
        # Laid out (batch, seq, heads, head_dim), as SDPA's flash kernel returns it, so that the
        # block's transpose and reshape for wo is a view of this output, not a copy.
        bs, heads, seq, hd = qf.shape
        out = torch.zeros(bs, seq, heads, hd, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v)).float().contiguous()
        for step in range(cp):
            if step < cp - 1:
                nxt, works = _start_pass(kv, group, tag=0)
            src = (r - step) % cp
            ke, ve = _expand(kv[0], groups), _expand(kv[1], groups)
            for qs, ks, causal in _pairs(r, src, cp, c):
                s = _scores(qf[:, :, qs], ke[:, :, ks], scale, causal)
                blk_lse = torch.logsumexp(s, dim=-1)
                blk_out = torch.matmul(torch.exp(s - blk_lse.unsqueeze(-1)), ve[:, :, ks])
                new = torch.logaddexp(lse[:, :, qs], blk_lse)
                out[:, :, qs] = out[:, :, qs] * torch.exp(lse[:, :, qs] - new).unsqueeze(
                    -1
                ) + blk_out * torch.exp(blk_lse - new).unsqueeze(-1)
                lse[:, :, qs] = new
            if step < cp - 1:
                _wait(works)
                kv = nxt
        result = out.to(q.dtype)  # (preserves the layout)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.scale = group, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        groups = q.shape[1] // k.shape[1]
        qf, do = q.float(), dout.float()
        delta = (do * out.float()).sum(-1)  # rowsum(dO * O): the softmax backward's term
        dq = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v)).float().contiguous()
        works_d: list[Any] = []
        dkv_in: torch.Tensor | None = None
        for step in range(cp):
            if step < cp - 1:
                nxt, works = _start_pass(kv, group, tag=0)
            src = (r - step) % cp
            ke, ve = _expand(kv[0], groups), _expand(kv[1], groups)
            dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros_like(dk)
            for qs, ks, causal in _pairs(r, src, cp, c):
                s = _scores(qf[:, :, qs], ke[:, :, ks], scale, causal)
                p = torch.exp(s - lse[:, :, qs].unsqueeze(-1))
                dv[:, :, ks] += torch.matmul(p.transpose(-1, -2), do[:, :, qs])
                dp = torch.matmul(do[:, :, qs], ve[:, :, ks].transpose(-1, -2))
                ds = p * (dp - delta[:, :, qs].unsqueeze(-1)) * scale
                dq[:, :, qs] += torch.matmul(ds, ke[:, :, ks])
                dk[:, :, ks] += torch.matmul(ds.transpose(-1, -2), qf[:, :, qs])
            # The gradients of rank src's keys: add what the ranks before this one found, pass on.
            dkv = torch.stack((_reduce_heads(dk, groups), _reduce_heads(dv, groups)))
            if dkv_in is not None:
                _wait(works_d)
                dkv = dkv + dkv_in
            if cp > 1:
                dkv_in, works_d = _start_pass(dkv.contiguous(), group, tag=1)
            else:
                dkv_in = dkv
            if step < cp - 1:
                _wait(works)
                kv = nxt
        _wait(works_d)  # after cp passes, the gradients of this rank's own k and v
        assert dkv_in is not None
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any) -> torch.Tensor:
    """Causal attention of (batch, heads, 2 c, head_dim) tensors that hold this cp rank's two
    load-balanced chunks; k and v may have fewer heads (grouped-query attention)."""
    out: torch.Tensor = RingAttention.apply(q, k, v, group, q.shape[-1] ** -0.5)  # type: ignore[no-untyped-call]
    return out


class RingAttentionCore(AttentionCore):
    """The attention core of a block under context parallelism (an `AttentionCore`, so that
    selective recomputation still finds and checkpoints it)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group)


def apply_cp(model: nn.Module, group: Any) -> None:
    """Make `model` (a Transformer) run on this cp rank's load-balanced share of each sequence:
    ring attention in every block, and the absolute positions of its tokens for RoPE / learned
    positions."""
    assert isinstance(model, Transformer)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    for block in model.layers.values():
        block.attention.core = RingAttentionCore(group)  # type: ignore[union-attr]
    model.positions = functools.partial(local_positions, cp, rank)
