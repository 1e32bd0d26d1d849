"""Attention of each query over its own chosen latent entries: DSA's top-k in MLA's absorbed form, in memory that
grows with T x k rather than T^2.

Query t has k chosen positions p[t, j] among the entries E [S, C + Dr] of its row (C = kv_lora_rank); in the absorbed
form every query head reads the same entries, as one key head of C + Dr features and one value head of its first C:

    o[t, h] = sum_j softmax_j(scale * q[t, h] . E[p[t, j]]) E[p[t, j], :C]        over the j that query t keeps

A masked dense attention computes all T^2 (query, key) pairs and holds a [T, T] mask; this computes the T x k pairs
chosen. Queries go in slices of at most `CHOSEN_PAIRS` (query, entry) pairs: a slice gathers its entries
[L, k, C + Dr], scores them, and keeps only its log-sum-exp for backward, which gathers again and recomputes the
probabilities (flash attention's recompute, over chosen entries instead of key tiles). The entries' gradient is
summed by position into an fp32 buffer (`index_add_`; on CUDA its order of additions is not fixed, as in flash
attention's backward). Probabilities and the softmax's statistics are fp32; the products run in the inputs' dtype.
"""

from __future__ import annotations

import torch

CHOSEN_PAIRS = 2**19
"""Most (query, entry) pairs of one slice: its gathered entries (C + Dr values each) and fp32 scores of every head
(GLM-5: 576 bf16 and 64 fp32 a pair, about 0.5 GiB a slice with backward's temporaries)."""


def attend_chosen(q: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor, kept: torch.Tensor, scale: float,
                  value_dim: int, max_pairs: int = CHOSEN_PAIRS) -> torch.Tensor:
    """Queries q [B, T, H, F] over entries [B, S, F] at their chosen `positions` [B, T, k] (indices into S) where
    `kept` [B, T, k] (each query keeps one at least) -> [B, T, H, value_dim], the attention over the entries' first
    `value_dim` features. Differentiable in q and entries."""
    B, T, H, F = q.shape
    S = entries.shape[1]
    rows = (positions + torch.arange(B, device=positions.device)[:, None, None] * S).flatten(0, 1).to(torch.int32)
    out = ChosenAttention.apply(q.flatten(0, 1), entries.flatten(0, 1), rows, kept.flatten(0, 1), scale, value_dim,
                                max_pairs)
    return out.view(B, T, H, value_dim)


def query_slices(num_pairs: int, num_queries: int, max_pairs: int | None) -> list[slice]:
    """Consecutive slices of `num_queries` queries (sharing `num_pairs` query-key pairs evenly), each of at most
    `max_pairs` pairs or of one query; one slice of all where `max_pairs` is None."""
    size = num_queries if max_pairs is None else max(1, max_pairs * num_queries // num_pairs)
    return [slice(start, start + size) for start in range(0, num_queries, size)]


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the inputs' dtype where it is wider (fp64 tests)."""
    return torch.promote_types(dtype, torch.float32)


def probabilities(q: torch.Tensor, chosen: torch.Tensor, kept: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores [L, H, k] (`statistics_dtype`) of queries q [L, H, F] on their gathered entries [L, k, F], -inf where
    not kept."""
    scores = torch.matmul(q, chosen.transpose(1, 2)).to(statistics_dtype(q.dtype)) * scale
    return scores.masked_fill_(~kept[:, None], float("-inf"))


class ChosenAttention(torch.autograd.Function):
    """`attend_chosen` over flattened rows: q [N, H, F], entries [M, F], rows [N, k] int32 (indices into M), kept
    [N, k] bool."""

    @staticmethod
    def forward(ctx, q, entries, rows, kept, scale, value_dim, max_pairs):
        N, H, _ = q.shape
        out = q.new_empty(N, H, value_dim)
        lse = torch.empty(N, H, dtype=statistics_dtype(q.dtype), device=q.device)
        for part in query_slices(N * rows.shape[1], N, max_pairs):
            chosen = entries.index_select(0, rows[part].flatten()).view(-1, rows.shape[1], entries.shape[1])
            scores = probabilities(q[part], chosen, kept[part], scale)
            lse[part] = torch.logsumexp(scores, dim=-1)
            p = torch.exp(scores - lse[part][..., None])
            out[part] = torch.matmul(p.to(q.dtype), chosen[..., :value_dim])
        ctx.save_for_backward(q, entries, rows, kept, out, lse)
        ctx.scale, ctx.value_dim, ctx.max_pairs = scale, value_dim, max_pairs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, entries, rows, kept, out, lse = ctx.saved_tensors
        scale, V = ctx.scale, ctx.value_dim
        grad_q = torch.empty_like(q)
        wide = statistics_dtype(q.dtype)
        grad_entries = torch.zeros(entries.shape, dtype=wide, device=entries.device)
        for part in query_slices(q.shape[0] * rows.shape[1], q.shape[0], ctx.max_pairs):
            index = rows[part].flatten()
            chosen = entries.index_select(0, index).view(-1, rows.shape[1], entries.shape[1])
            p = torch.exp(probabilities(q[part], chosen, kept[part], scale) - lse[part][..., None])  # [L, H, k]
            d_out = grad_out[part]
            d_p = torch.matmul(d_out, chosen[..., :V].transpose(1, 2)).to(wide)
            delta = (d_out.to(wide) * out[part].to(wide)).sum(-1, keepdim=True)
            d_scores = (p * (d_p - delta) * scale).to(q.dtype)
            grad_q[part] = torch.matmul(d_scores, chosen)
            d_chosen = torch.matmul(d_scores.transpose(1, 2), q[part]).to(wide)  # [L, k, F]
            d_chosen[..., :V] += torch.matmul(p.to(q.dtype).transpose(1, 2), d_out).to(wide)
            grad_entries.index_add_(0, index, d_chosen.flatten(0, 1))
        return grad_q, grad_entries.to(entries.dtype), None, None, None, None, None
