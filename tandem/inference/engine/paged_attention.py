"""The engine's `AttentionBackend`: write this step's keys and values into the paged cache, then
attend over each sequence's whole context.

Legend: N = tokens of the step (all sequences, flattened), H = query heads, Hkv = KV heads,
D = head dim, Bd = decoding sequences, M = most blocks of one of them, S = block size. Prefill chunks attend one sequence at a time (causal,
offset by what the cache already held); decodes attend as one padded batch. This module is the
seam a GPU speed issue replaces (varlen/flash attention, CUDA graphs): the model code and the
runner only see `attend(layer_idx, q, k, v)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.inference.engine.kv_cache import KVCache


@dataclass
class PrefillSpan:
    query_start: int
    """Offset of the chunk's first token in the step's N tokens."""
    query_len: int
    context_len: int
    """Tokens the chunk attends to: the cached ones before it plus itself."""
    context_blocks: torch.Tensor | None
    """Cache blocks holding the whole context; None when nothing was cached (plain causal)."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[N] cache slot of each token of the step."""
    prefills: list[PrefillSpan]
    decode_token_index: torch.Tensor
    """[Bd] offsets of the decode tokens in the step's N tokens."""
    decode_blocks: torch.Tensor
    """[Bd, M] block table of each decoding sequence, padded with its first block."""
    decode_mask: torch.Tensor
    """[Bd, 1, 1, M * S] True where a gathered position belongs to the context."""


class PagedAttention:
    def __init__(self, cache: KVCache, metadata: AttentionMetadata):
        self.cache = cache
        self.meta = metadata

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_NHD, k_NHD, v_NHD = q[0], k[0], v[0]
        k_cache, v_cache = self.cache.layer(layer_idx)  # [blocks, S, Hkv, D]
        num_kv_heads, head_dim = k_cache.shape[2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self.meta.slot_mapping, k_NHD)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self.meta.slot_mapping, v_NHD)
        gqa = q_NHD.shape[1] != num_kv_heads
        out = torch.empty_like(q_NHD)  # [N, H, D]
        for span in self.meta.prefills:
            s, e = span.query_start, span.query_start + span.query_len
            q_i = q_NHD[s:e].transpose(0, 1)[None]
            if span.context_blocks is None:
                k_i, v_i = k_NHD[s:e].transpose(0, 1)[None], v_NHD[s:e].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, enable_gqa=gqa)
            else:
                k_i = k_cache.index_select(0, span.context_blocks).flatten(0, 1)[:span.context_len].transpose(0, 1)[None]
                v_i = v_cache.index_select(0, span.context_blocks).flatten(0, 1)[:span.context_len].transpose(0, 1)[None]
                mask = torch.ones(span.query_len, span.context_len, dtype=torch.bool, device=q.device)
                mask = mask.tril(span.context_len - span.query_len)
                o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, enable_gqa=gqa)
            out[s:e] = o[0].transpose(0, 1)
        if self.meta.decode_token_index.numel():
            idx, blocks = self.meta.decode_token_index, self.meta.decode_blocks
            only_decodes = not self.meta.prefills  # then the decode tokens are all N tokens, in order
            num_decodes = blocks.shape[0]
            q_d = (q_NHD if only_decodes else q_NHD[idx])[:, :, None]  # [Bd, H, 1, D]
            k_d = k_cache.index_select(0, blocks.view(-1)).view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
            v_d = v_cache.index_select(0, blocks.view(-1)).view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q_d, k_d, v_d, attn_mask=self.meta.decode_mask, enable_gqa=gqa)
            if only_decodes:
                return o[:, :, 0][None]
            out[idx] = o[:, :, 0]
        return out[None]
