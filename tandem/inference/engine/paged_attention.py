"""The engine's `AttentionBackend`: write this step's keys and values into the paged cache, then
attend over each sequence's whole context.

Legend: N = tokens of the step (all sequences, flattened), B = sequences of the step, H = query
heads, Hkv = KV heads, D = head dim, Bs = sequences of a few new tokens, Lq = most new tokens of
one of them, M = most blocks of one of them, S = block size. On CUDA one Triton kernel
(`tandem.kernels.attention`) reads the cache in place for every token of the step; in exact mode
each token as a decode query of its own (`attend_each_token`, the trainer's kernel too), or token by
token in torch where those kernels cannot run. Elsewhere the torch reference runs: prefill chunks
one sequence at a time (causal, offset by what the cache already held), decodes and other short
queries (a token and its drafts) as one padded batch of gathered blocks. The model code and the
runner only see `attend(layer_idx, q, k, v)`.

With an FP8 cache (`KVCache.fp8`) every path attends over what the cache holds: the kernel reads FP8 keys and
values with their scales in place; the torch path dequantizes the blocks it gathers, and a chunk's own keys and
values are their round trip through the cache (`KVCache.write`), so both paths compute the same function.

A decode-only step with a cascade plan (`AttentionMetadata.cascade`, `cascade.py`) reads each group's shared
prefix once for all its members: `tandem.kernels.cascade_attention` on CUDA, `reference_cascade_attention` in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.kernels import attention as attention_kernel
from tandem.kernels.cascade_attention import cascade_decode
from tandem.inference.engine.cascade import CascadeMetadata
from tandem.inference.engine.kv_cache import KVCache
from tandem.models.exact import attention_uses_kernels, exact_causal_attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[N] cache slot of each token of the step (CUDA-graph padding writes to the cache's pad slot)."""
    query_start: torch.Tensor
    """[B + 1] offset of each sequence's first token in the step's N tokens."""
    seq_lens: torch.Tensor
    """[B] context of each sequence after the step (cached tokens plus its new ones)."""
    block_tables: torch.Tensor
    """[B, >= M] cache blocks of each sequence; entries past its context are never read unmasked."""
    tiles: torch.Tensor
    """[2, T] the kernel's work items: (sequence, offset of its first query token)."""
    block_q: int
    """Query tokens per tile (1 for a decode-only step)."""
    query_lens_host: list[int] | None = None
    """The same lengths on the host, for the torch reference; None on the CUDA-graph path."""
    seq_lens_host: list[int] | None = None
    max_context: int | None = None
    """A bound on every sequence's context this step (the kernel sizes a decode's grid by it); None: what the
    block tables can hold. A CUDA graph captures it, so a graph's bound holds for every step it replays."""
    cascade: CascadeMetadata | None = None
    """A decode-only step's groups of sequences sharing a prompt prefix (`cascade.py`), each prefix read once for
    its group; None: plain attention."""


class PagedAttention:
    def __init__(self, cache: KVCache, metadata: AttentionMetadata, exact: bool = False):
        """`exact`: batch-invariant attention (`tandem.models.exact`), the trainer's routine in exact mode."""
        self.cache = cache
        self.meta = metadata
        self.exact = exact
        self._exact_work: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_NHD = q[0]
        k_NHD, v_NHD = self.cache.write(layer_idx, self.meta.slot_mapping, k[0], v[0])  # what the cache now holds
        head_dim = q_NHD.shape[-1]
        if self.reads_only_the_cache(head_dim, q_NHD.device):
            return self.attend_cached(layer_idx, q_NHD)[None]
        if self.exact:
            return exact_paged_attention(q_NHD, k_NHD, v_NHD, *self.cache.layer(layer_idx), self.meta)[None]
        if self.meta.cascade is not None:
            return reference_cascade_attention(q_NHD, self.cache, layer_idx, self.meta)[None]
        return reference_attention(q_NHD, k_NHD, v_NHD, self.cache, layer_idx, self.meta)[None]

    def reads_only_the_cache(self, head_dim: int, device: torch.device) -> bool:
        """Whether `attend` runs a kernel, which reads this step's keys and values back from the cache: then a
        caller that wrote them into their `cache_slots` itself may call `attend_cached` instead
        (`tandem.models.attention.CachedAttention`)."""
        if self.exact:
            return attention_uses_kernels(device, head_dim)
        return attention_kernel.serves(head_dim, device)

    def cache_slots(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                    torch.Tensor | None]:
        return *self.cache.layer(layer_idx), self.meta.slot_mapping, *self.cache.layer_scales(layer_idx)

    def attend_cached(self, layer_idx: int, q_NHD: torch.Tensor) -> torch.Tensor:
        """The kernel's attention of q [N, H, D] over the cache, the step's keys and values already in their
        slots: [N, H, D]. Exact mode: each token a decode query of its own (`attend_each_token`)."""
        k_cache, v_cache = self.cache.layer(layer_idx)
        m = self.meta
        if self.exact:
            tiles, contexts = self.exact_work(q_NHD.shape[1], k_cache.shape[2])
            max_context = m.max_context if m.max_context is not None else m.block_tables.shape[1] * k_cache.shape[1]
            return attention_kernel.attend_each_token(q_NHD, k_cache, v_cache, m.block_tables, m.seq_lens, m.query_start,
                                                      tiles, contexts, max_context)
        if m.cascade is not None:
            c = m.cascade
            max_context = m.max_context if m.max_context is not None else m.block_tables.shape[1] * k_cache.shape[1]
            return cascade_decode(q_NHD.contiguous(), k_cache, v_cache, m.block_tables, m.seq_lens, m.query_start,
                                  c.row_prefix, c.group_prefix, c.group_members, max_context,
                                  *self.cache.layer_scales(layer_idx))
        return attention_kernel.paged_attention(q_NHD.contiguous(), k_cache, v_cache, m.block_tables, m.seq_lens,
                                                m.query_start, m.tiles, m.block_q, m.max_context,
                                                *self.cache.layer_scales(layer_idx))

    def exact_work(self, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention's work items and each token's context (position + 1), [2, T] and [N], once per step. A
        decode-only step (the CUDA-graph path among them) has them already: its tiles, one per sequence, and the
        sequences' contexts; a step that prefills builds them from the host's lengths."""
        if self._exact_work is None:
            m = self.meta
            if m.block_q == 1:
                self._exact_work = m.tiles, m.seq_lens
            else:
                device = m.seq_lens.device
                tiles = attention_kernel.exact_tiles(m.query_lens_host, attention_kernel.exact_tile_tokens(num_heads, num_kv_heads),
                                                     device)
                contexts = np.concatenate([np.arange(ctx - n + 1, ctx + 1) for n, ctx in zip(m.query_lens_host, m.seq_lens_host)])
                self._exact_work = tiles, torch.from_numpy(contexts).to(device, m.seq_lens.dtype)
        return self._exact_work


def exact_paged_attention(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Each sequence's new tokens by `exact_causal_attention`, over the keys and values the cache held before
    the step and the step's own (the same values the cache now holds), [N, H, D]."""
    assert meta.query_lens_host is not None and meta.seq_lens_host is not None, "exact attention needs host lengths"
    block_size = k_cache.shape[1]
    out, start = [], 0
    for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        cached = ctx - q_len
        blocks = meta.block_tables[i, :-(-cached // block_size)] if cached else None
        k_old = k_cache.index_select(0, blocks).flatten(0, 1)[:cached] if cached else None
        v_old = v_cache.index_select(0, blocks).flatten(0, 1)[:cached] if cached else None
        out.append(exact_causal_attention(q_NHD[start:start + q_len], k_NHD[start:start + q_len], v_NHD[start:start + q_len],
                                          cached, k_old, v_old))
        start += q_len
    return torch.cat(out)


SHORT_QUERY_TOKENS = 16
"""Sequences that compute at most this many tokens after cached ones (decodes; speculative verification, a token
and its drafts) attend as one padded batch in the torch path; longer chunks one at a time, where padding would
cost more than the loop."""


def reference_attention(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, cache: KVCache, layer_idx: int,
                        meta: AttentionMetadata) -> torch.Tensor:
    """The torch path (CPU, and the GPU tests' reference): gathered blocks of layer `layer_idx` (`KVCache.read_blocks`)
    and SDPA, [N, H, D]."""
    assert meta.query_lens_host is not None and meta.seq_lens_host is not None, "the torch path needs host lengths"
    block_size = cache.block_size
    gqa = q_NHD.shape[1] != k_NHD.shape[1]
    out = torch.empty_like(q_NHD)  # [N, H, D]
    short: list[int] = []
    start = 0
    for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        s, e = start, start + q_len
        start = e
        if q_len < ctx and q_len <= SHORT_QUERY_TOKENS:
            short.append(i)
            continue
        q_i = q_NHD[s:e].transpose(0, 1)[None]
        if q_len == ctx:  # nothing cached before the chunk: plain causal over its own keys
            k_i, v_i = k_NHD[s:e].transpose(0, 1)[None], v_NHD[s:e].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, enable_gqa=gqa)
        else:
            k_blocks, v_blocks = cache.read_blocks(layer_idx, meta.block_tables[i, :-(-ctx // block_size)])
            k_i = k_blocks.flatten(0, 1)[:ctx].transpose(0, 1)[None]
            v_i = v_blocks.flatten(0, 1)[:ctx].transpose(0, 1)[None]
            mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q_NHD.device).tril(ctx - q_len)
            o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, enable_gqa=gqa)
        out[s:e] = o[0].transpose(0, 1)
    if short:
        attend_short_queries(q_NHD, cache, layer_idx, meta, short, out)
    return out


def attend_short_queries(q_NHD: torch.Tensor, cache: KVCache, layer_idx: int, meta: AttentionMetadata,
                         seqs: list[int], out: torch.Tensor) -> None:
    """Sequences `seqs` (Bs, each a few tokens after cached ones, all in the cache already) as one batch padded to
    the longest query (Lq) and context, written into `out`. A padding query repeats its sequence's last token,
    so it writes that token's own output again."""
    assert meta.query_lens_host is not None and meta.seq_lens_host is not None
    device = q_NHD.device
    num_kv_heads, head_dim = cache.keys.shape[3:]
    block_size = cache.block_size
    q_lens = torch.tensor([meta.query_lens_host[i] for i in seqs], device=device)
    lens = torch.tensor([meta.seq_lens_host[i] for i in seqs], device=device)
    width = -(-int(lens.max()) // block_size)
    rows = torch.tensor(seqs, device=device)
    blocks = meta.block_tables[rows, :width]  # [Bs, M]
    offsets = torch.minimum(torch.arange(int(q_lens.max()), device=device)[None], q_lens[:, None] - 1)  # [Bs, Lq]
    tokens = meta.query_start[rows][:, None] + offsets  # [Bs, Lq] rows of the step's tokens
    q_s = q_NHD[tokens].transpose(1, 2)  # [Bs, H, Lq, D]
    k_s, v_s = (x.view(len(seqs), -1, num_kv_heads, head_dim).transpose(1, 2)
                for x in cache.read_blocks(layer_idx, blocks.reshape(-1)))
    positions = (lens - q_lens)[:, None] + offsets  # [Bs, Lq] each query's position
    mask = torch.arange(width * block_size, device=device)[None, None] <= positions[:, :, None]  # [Bs, Lq, M * S]
    o = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask[:, None], enable_gqa=q_s.shape[1] != num_kv_heads)
    out[tokens] = o.transpose(1, 2)


def reference_cascade_attention(q_NHD: torch.Tensor, cache: KVCache, layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:
    """The torch path of a cascade decode step (`meta.cascade`, its host plan): each group's queries against its
    shared prefix, gathered once, and each sequence's query against its own keys past its prefix, merged by their
    log-sum-exp, [N, H, D]."""
    plan = meta.cascade.plan if meta.cascade is not None else None
    assert plan is not None and meta.seq_lens_host is not None, "the torch path needs the plan on the host"
    block_size = cache.block_size
    num_kv_heads, head_dim = cache.keys.shape[3:]
    device = q_NHD.device
    rows = len(meta.seq_lens_host)
    tokens = meta.query_start[:rows]
    q_BHD = q_NHD[tokens]
    lens = torch.tensor(meta.seq_lens_host, device=device)
    starts = torch.tensor(plan.row_prefix, device=device)
    width = -(-int(lens.max()) // block_size)
    k_own, v_own = (x.view(rows, -1, num_kv_heads, head_dim) for x in
                    cache.read_blocks(layer_idx, meta.block_tables[:rows, :width].reshape(-1)))
    keys = torch.arange(width * block_size, device=device)
    own = (keys[None] >= starts[:, None]) & (keys[None] < lens[:, None])  # [B, M * S]
    out, lse = attend_with_lse(q_BHD[:, :, None], k_own, v_own, own[:, None, None])  # [B, H, 1, D], [B, H, 1]
    out, lse = out[:, :, 0], lse[:, :, 0]
    for members, prefix in zip(plan.groups, plan.prefix_tokens):
        blocks = meta.block_tables[members[0], :prefix // block_size]
        k_pre, v_pre = (x.reshape(1, prefix, num_kv_heads, head_dim) for x in cache.read_blocks(layer_idx, blocks))
        group = torch.tensor(members, device=device)
        out_pre, lse_pre = attend_with_lse(q_BHD[group].transpose(0, 1)[None], k_pre, v_pre, None)  # [1, H, n, D]
        out_pre, lse_pre = out_pre[0].transpose(0, 1), lse_pre[0].transpose(0, 1)  # [n, H, D], [n, H]
        total = torch.logaddexp(lse[group], lse_pre)
        out[group] = (out[group] * (lse[group] - total).exp()[..., None]
                      + out_pre * (lse_pre - total).exp()[..., None])
        lse[group] = total
    result = torch.zeros_like(q_NHD)
    result[tokens] = out.to(q_NHD.dtype)
    return result


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, H, Lq, D] over k, v [B, L, Hkv, D] (GQA: each KV head serves H / Hkv query heads)
    where `mask` [B, 1 or H, Lq, L] allows, in fp32: (output [B, H, Lq, D], log-sum-exp of the scores [B, H, Lq]),
    what two parts over disjoint keys need to be merged. A row that sees no key gets zeros and a log-sum-exp of
    -inf (it weighs nothing in a merge)."""
    group = q.shape[1] // k.shape[2]
    k_ = k.float().transpose(1, 2).repeat_interleave(group, dim=1)  # [B, H, L, D]
    v_ = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = q.float() @ k_.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.where(lse[..., None] == float("-inf"), 0.0, (scores - lse[..., None]).exp())
    return weights @ v_, lse
