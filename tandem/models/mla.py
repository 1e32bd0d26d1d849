"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-5): queries, keys and values through low-rank chains.

    x -> q_a_proj -> q_a_layernorm -> q_b_proj -> per head [q_nope (Dn) | q_rope (Dr)]   (`q_lora_rank`; else q_proj)
    x -> kv_a_proj_with_mqa -> [latent c (kv_lora_rank) | k_rope (Dr, one head that every head shares)]
         c -> kv_a_layernorm -> kv_b_proj -> per head [k_nope (Dn) | v (Dv)]
    q = [q_nope | RoPE(q_rope)], k = [k_nope | RoPE(k_rope)]; softmax(q.k * scale) v per head, then o_proj

A decoding cache needs only c (after its norm) and RoPE(k_rope) per token, kv_lora_rank + Dr numbers for all heads
together: a latent cache "entry" [c | RoPE(k_rope)]. Attention over entries has two forms, equal in exact arithmetic:
- expanded (the form dense training uses, and the engine's for prefill chunks without DSA): kv_b_proj turns every
  entry into each head's k_nope and v, then attention per head (Hq = Hkv heads, q and k of Dn + Dr features, v of
  Dv);
- absorbed (the engine's for decodes, and trainer's and engine's over DSA's chosen entries): kv_b_proj = per head
  [W_UK (Dn x c) ; W_UV (Dv x c)], so q_nope . (W_UK c) = (W_UK^T q_nope) . c and sum_s p_s W_UV c_s =
  W_UV sum_s p_s c_s: each query becomes [W_UK^T q_nope | q_rope] over the entries themselves (one key head of
  kv_lora_rank + Dr features shared by every query head, values their first kv_lora_rank features), and W_UV
  applies after attention. A token's keys and values are never expanded: the step reads kv_lora_rank + Dr numbers
  per context token, not H x (Dn + Dr + Dv).

The scale is 1 / sqrt(Dn + Dr), times YaRN's mscale(factor, mscale_all_dim)^2 where the rope parameters set
`mscale_all_dim` (DeepSeek-V3). RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`, the
checkpoints' layout), else the two halves (Qwen3's rotate-half). The norms of the two latents use eps 1e-6 whatever
`rms_norm_eps` says, as DeepSeek's reference code and transformers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.chosen_attention import attend_chosen, query_slices
from tandem.models.layers import RMSNorm, apply_rope, projection_weight, rms_norm

if TYPE_CHECKING:
    from tandem.models.dsa import IndexerProjections

LATENT_NORM_EPS = 1e-6
"""Epsilon of `q_a_layernorm` and `kv_a_layernorm`."""


@dataclass
class LatentProjections:
    """One layer's projections of normed hidden states [B, T, hidden], before any head is expanded."""

    q_nope: torch.Tensor
    """[B, T, H, Dn]"""
    q_rope: torch.Tensor
    """[B, T, H, Dr], rotated"""
    entries: torch.Tensor
    """[B, T, kv_lora_rank + Dr]: each token's normed latent c and its rotated shared key part, what a cache keeps"""
    query_latent: torch.Tensor | None
    """[B, T, q_lora_rank], normed (None without `q_lora_rank`): what the DSA indexer reads"""


@runtime_checkable
class LatentBackend(Protocol):
    """An attention backend that keeps latent entries itself (the inference engine's paged latent cache, the
    trainer's context-parallel gather of a row's entries): a block hands it its projections instead of expanded keys
    and values.

    `selection`: the DSA choice of the last `full` layer, in the backend's own form (None: none made, every visible
    token attends); `index`: this layer's indexer projections (None: no indexer here). Returns the attention's
    output [B, T, H, Dv] and the choice a following `shared` layer reuses."""

    def attend_latent(self, layer_idx: int, attention: "LatentAttention", projections: LatentProjections,
                      index: "IndexerProjections | None", selection: Any) -> tuple[torch.Tensor, Any]: ...


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

    def project_latent(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> LatentProjections:
        """Normed hidden states h [B, T, hidden] -> the layer's `LatentProjections`."""
        B, T, _ = h.shape
        H, Dn, Dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        q_input, kv_input = self.input_projections(h)
        if self.q_lora_rank is None:
            latent, q = None, q_input
        else:
            latent = rms_norm(q_input, self.q_a_layernorm.weight, LATENT_NORM_EPS)
            q = self.q_b_proj(latent)
        q_nope, q_rope = q.view(B, T, H, Dn + Dr).split((Dn, Dr), dim=-1)
        c, k_rope = kv_input.split((self.kv_lora_rank, Dr), dim=-1)
        c = rms_norm(c, self.kv_a_layernorm.weight, LATENT_NORM_EPS)
        k_rope = rotate(k_rope.view(B, T, 1, Dr), cos, sin, self.rope_interleave)[:, :, 0]
        return LatentProjections(q_nope, rotate(q_rope, cos, sin, self.rope_interleave), torch.cat((c, k_rope), dim=-1),
                                 latent)

    def input_projections(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two products of the normed hidden states h [B, T, hidden]: q_a_proj's (q_proj's without a query rank)
        and kv_a_proj_with_mqa's. A method of its own because both read h: the engine's FP8 blocks compute them as
        one stacked product (`tandem.inference.engine.fp8_blocks`)."""
        return (self.q_proj if self.q_lora_rank is None else self.q_a_proj)(h), self.kv_a_proj_with_mqa(h)

    def queries(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """The expanded queries [..., H, Dn + Dr], times `query_factor`."""
        q = torch.cat((q_nope, q_rope), dim=-1)
        return q * self.query_factor if self.query_factor != 1.0 else q

    def keys_values(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent entries [B, S, kv_lora_rank + Dr] -> the expanded keys [B, S, H, Dn + Dr] and values [B, S, H, Dv]."""
        B, S, _ = entries.shape
        H, Dn, Dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        c, k_rope = entries.split((self.kv_lora_rank, Dr), dim=-1)
        k_nope, v = F.linear(c, projection_weight(self.kv_b_proj)).view(B, S, H, Dn + self.v_head_dim).split(
            (Dn, self.v_head_dim), dim=-1)
        return torch.cat((k_nope, k_rope[:, :, None].expand(B, S, H, Dr)), dim=-1), v

    def attend_expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor,
                        max_pairs: int | None = None) -> torch.Tensor:
        """Queries q_nope [G, L, H, Dn], q_rope [G, L, H, Dr] over latent entries [G, S, kv_lora_rank + Dr] where
        `visible` [G, L, S] (each query sees one at least) -> [G, L, H, Dv], every entry expanded per head once.
        `max_pairs`: attend in slices of the queries, each of at most that many (query, entry) pairs (one query at
        least), so that the logits of a slice (H x pairs) bound the memory; None: all at once."""
        k, v = (t.transpose(1, 2) for t in self.keys_values(entries))
        q = self.queries(q_nope, q_rope)
        out = [F.scaled_dot_product_attention(q[:, part].transpose(1, 2), k, v, attn_mask=visible[:, None, part])
               for part in query_slices(q.shape[0] * q.shape[1] * entries.shape[1], q.shape[1], max_pairs)]
        return torch.cat(out, dim=2).transpose(1, 2)

    def attend_absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor,
                        max_pairs: int | None = None) -> torch.Tensor:
        """What `attend_expanded` computes, in the absorbed form (the module docstring): [G, L, H, Dv]."""
        q = self.absorbed_queries(q_nope, q_rope)  # [G, L, H, kv_lora_rank + Dr]
        k, v = entries[:, None], entries[:, None, :, :self.kv_lora_rank]  # one head, which every query head reads
        out = [F.scaled_dot_product_attention(q[:, part].transpose(1, 2), k, v, attn_mask=visible[:, None, part],
                                              scale=self.absorbed_scale, enable_gqa=True)
               for part in query_slices(q.shape[0] * q.shape[1] * entries.shape[1], q.shape[1], max_pairs)]
        return self.latent_values(torch.cat(out, dim=2).transpose(1, 2))

    def attend_chosen(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor,
                      kept: torch.Tensor) -> torch.Tensor:
        """What `attend_absorbed` computes where each query [B, T, H, ...] sees only the entries [B, S, ...] at its
        `positions` [B, T, k] that it keeps (`kept`), without a [T, S] mask (`tandem.models.chosen_attention`):
        [B, T, H, Dv]."""
        q = self.absorbed_queries(q_nope, q_rope)
        return self.latent_values(attend_chosen(q, entries, positions, kept, self.absorbed_scale, self.kv_lora_rank))

    def absorbed_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's per-head W_UK [H, Dn, kv_lora_rank] and W_UV [H, Dv, kv_lora_rank]."""
        H, Dn = self.num_heads, self.qk_nope_head_dim
        return projection_weight(self.kv_b_proj).view(H, Dn + self.v_head_dim, self.kv_lora_rank).split(
            (Dn, self.v_head_dim), dim=1)

    def absorbed_queries(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """Queries q_nope [..., H, Dn], q_rope [..., H, Dr] in the absorbed form, [W_UK^T q_nope | q_rope] times
        `query_factor`: [..., H, kv_lora_rank + Dr], to attend over entries at `absorbed_scale`."""
        return self.queries(torch.einsum("...hd,hdc->...hc", q_nope, self.absorbed_projections()[0]), q_rope)

    @property
    def absorbed_scale(self) -> float:
        """The softmax scale of absorbed queries on entries: attention's default of the expanded heads."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def latent_values(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output over entries [..., H, kv_lora_rank] -> each head's values [..., H, Dv] (W_UV)."""
        return torch.einsum("...hc,hvc->...hv", out, self.absorbed_projections()[1])
