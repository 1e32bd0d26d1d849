"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-5): queries, keys and values through low-rank chains.

    x -> q_a_proj -> q_a_layernorm -> q_b_proj -> per head [q_nope (Dn) | q_rope (Dr)]   (`q_lora_rank`; else q_proj)
    x -> kv_a_proj_with_mqa -> [latent c (kv_lora_rank) | k_rope (Dr, one head that every head shares)]
         c -> kv_a_layernorm -> kv_b_proj -> per head [k_nope (Dn) | v (Dv)]
    q = [q_nope | RoPE(q_rope)], k = [k_nope | RoPE(k_rope)]; softmax(q.k * scale) v per head, then o_proj

A decoding cache needs only c and k_rope per token (kv_lora_rank + Dr numbers for all heads together); this module
computes the expanded per-head q, k and v, the form training uses, so that any attention backend can take them
(Hq = Hkv heads, q and k of Dn + Dr features, v of Dv).

The scale is 1 / sqrt(Dn + Dr), times YaRN's mscale(factor, mscale_all_dim)^2 where the rope parameters set
`mscale_all_dim` (DeepSeek-V3). RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`, the
checkpoints' layout), else the two halves (Qwen3's rotate-half). The norms of the two latents use eps 1e-6 whatever
`rms_norm_eps` says, as DeepSeek's reference code and transformers do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers import RMSNorm, apply_rope, projection_weight, rms_norm

LATENT_NORM_EPS = 1e-6
"""Epsilon of `q_a_layernorm` and `kv_a_layernorm`."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of x [B, T, H, Dr] by cos/sin [B, T, Dr] (`layers.rope_cos_sin`). `interleaved`: pair i is (x[2i], x[2i+1]),
    turned by frequency i; the result comes out de-interleaved (the pairs' first members, then their second ones),
    which changes no dot product between two rotated vectors (q and k are permuted alike) and makes it rotate-half."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rope(x, cos, sin)


class LatentAttention(nn.Module):
    """MLA's projections under Hugging Face's names (`self_attn.q_a_proj`, ...), plus an optional `indexer` (DSA:
    `tandem.models.dsa`) that reads the query latent. `attention_bias`: biases on q_a_proj (q_proj has none),
    kv_a_proj_with_mqa and o_proj, as transformers places them."""

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, attention_bias: bool, softmax_scale: float, rope_interleave: bool,
                 indexer: nn.Module | None = None):
        super().__init__()
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_interleave = rope_interleave
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.query_factor = softmax_scale * math.sqrt(qk_head_dim)
        """The scale as a factor on q, so that attention's default 1 / sqrt(Dn + Dr) applies it (1 without YaRN)."""
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias)
        self.indexer = indexer

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Normed hidden states h [B, T, hidden] -> q, k [B, T, H, Dn + Dr] (q times `query_factor`), v [B, T, H, Dv]
        and the normed query latent [B, T, q_lora_rank] (None without `q_lora_rank`), which the DSA indexer reads."""
        B, T, _ = h.shape
        H, Dn, Dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            latent, q = None, self.q_proj(h)
        else:
            latent = rms_norm(self.q_a_proj(h), self.q_a_layernorm.weight, LATENT_NORM_EPS)
            q = self.q_b_proj(latent)
        q_nope, q_rope = q.view(B, T, H, Dn + Dr).split((Dn, Dr), dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(h).split((self.kv_lora_rank, Dr), dim=-1)
        kv = F.linear(rms_norm(c, self.kv_a_layernorm.weight, LATENT_NORM_EPS), projection_weight(self.kv_b_proj))
        k_nope, v = kv.view(B, T, H, Dn + self.v_head_dim).split((Dn, self.v_head_dim), dim=-1)
        k_rope = rotate(k_rope.view(B, T, 1, Dr), cos, sin, self.rope_interleave)
        q = torch.cat((q_nope, rotate(q_rope, cos, sin, self.rope_interleave)), dim=-1)
        if self.query_factor != 1.0:
            q = q * self.query_factor
        k = torch.cat((k_nope, k_rope.expand(B, T, H, Dr)), dim=-1)
        return q, k, v, latent
