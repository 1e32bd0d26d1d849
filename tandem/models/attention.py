"""Attention backends: how a layer's q, k, v become its output.

The model code calls `backend.attend(layer_idx, q, k, v)` and knows nothing else: training uses
`PackedCausalAttention` (documents packed in a row, positions restart at each one, no attention
across documents); the inference engine passes its own backend that reads and writes a paged KV
cache. Shapes: q [B, T, Hq, D], k and v [B, T, Hkv, D], output [B, T, Hq, D].
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document index within each row: a new document starts where position is 0."""
    return torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)


class PackedCausalAttention:
    """Causal attention within each packed document, through `scaled_dot_product_attention`.

    Rows holding a single document take the `is_causal` path (no mask tensor); packed rows use a
    block-diagonal causal mask built once per forward and shared by all layers.
    """

    def __init__(self, position_ids: torch.Tensor):
        starts = (position_ids[:, 1:] == 0).any()
        self.mask: torch.Tensor | None = None
        if bool(starts):
            doc = document_ids(position_ids)
            T = position_ids.shape[-1]
            causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
            self.mask = (doc[:, :, None] == doc[:, None, :]) & causal  # [B, T, T]
            self.mask = self.mask[:, None]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
        gqa = q.shape[1] != k.shape[1]
        if self.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        return out.transpose(1, 2)
