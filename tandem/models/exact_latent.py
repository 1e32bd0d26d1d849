"""Exact mode (`tandem.models.exact`) for latent attention blocks (`tandem.models.mla`; GLM-5's DSA:
`tandem.models.dsa`): every token computed alone, in one form on both sides.

Outside exact mode the engine attends prefill chunks in MLA's expanded form and decodes in the absorbed one, the
trainer in the expanded form: each rounds its own way. Exact mode takes the absorbed form everywhere, one query token
against exactly the latent entries [c | RoPE(k_rope)] it attends to (`attend_token`). The trainer's packed row holds
every token's entry, the engine's paged cache the same numbers; a backend hands each token its context
(`ExactLatentBackend`), and the block does the rest, so the arithmetic is one function's on both sides. Every shape
depends only on the token's position (and DSA's top-k), hence every reduction order does too.

DSA: a token's index scores against exactly its visible context keys, in fp32 (`choose_token`); its `index_topk`
best by descending score, ties to the earlier position (a stable sort), attended in ascending position, so that no
sum depends on the order the scores came in. A token seeing `index_topk` tokens or fewer attends to all of them. A
`shared` layer reuses the last full layer's choice: one entry per token of the forward (None: its whole context).

The block's other parts (norms, projections, the indexer's, o_proj, the feed-forward: a mixture of experts routes
token by token) run on [1, 1, hidden] tensors, as exact mode's token-by-token path runs a decoder block. Torch ops on
every device (no Triton kernel, hence no CUDA graph in the engine), differentiated by autograd in the trainer; a
token's products hold [heads, context, entry features] in fp32 at once: for checking and small runs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from tandem.models.decoder import after_attention
from tandem.models.dsa import IndexerProjections, SparseContext
from tandem.models.exact_attention import exact_attention
from tandem.models.glm_moe_dsa import LatentAttentionBlock
from tandem.models.layers import projection_weight, rms_norm
from tandem.models.mla import LatentAttention, LatentProjections

TokenContext = tuple[torch.Tensor, "torch.Tensor | None"]
"""One token's context: its entries [C, kv_lora_rank + Dr] and indexer keys [C, index_head_dim] (None in a layer
without indexer), C = its position + 1, in position order."""


@runtime_checkable
class ExactLatentBackend(Protocol):
    """An attention backend that gives exact mode's latent blocks each token's context (the trainer's packed rows,
    the engine's paged cache)."""

    def latent_contexts(self, layer_idx: int, entries: torch.Tensor,
                        index_keys: torch.Tensor | None) -> list[TokenContext]:
        """The forward's entries [B, T, E] and indexer keys [B, T, D] (None: no indexer in this layer) -> each token's
        `TokenContext`, the B x T tokens in order; a backend that keeps a cache writes them into it first."""
        ...


def exact_latent_block_forward(block: LatentAttentionBlock, index_topk: int, x: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, backend: ExactLatentBackend, sparse: SparseContext | None = None,
                               selection: list[torch.Tensor | None] | None = None
                               ) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
    """`LatentAttentionBlock.forward` token by token (x [B, T, hidden]): (x after the block, each token's DSA choice
    for the next `shared` layer). `sparse` is unused: each token's choice is made over its own context."""
    if not isinstance(backend, ExactLatentBackend):
        raise TypeError(f"exact mode's latent blocks need an `ExactLatentBackend`, got {type(backend).__name__}")
    B, T, hidden = x.shape
    attention = block.self_attn
    x_N, cos_N, sin_N = x.reshape(B * T, 1, 1, hidden), cos.reshape(B * T, 1, 1, -1), sin.reshape(B * T, 1, 1, -1)
    tokens = [token_projections(block, x_N[i], cos_N[i], sin_N[i]) for i in range(B * T)]
    entries = torch.cat([projections.entries for projections, _ in tokens], dim=1).view(B, T, -1)
    keys = (torch.cat([index.keys for _, index in tokens], dim=1).view(B, T, -1)
            if attention.indexer is not None else None)
    contexts = backend.latent_contexts(block.layer_idx, entries, keys)
    if attention.indexer is not None:
        selection = [choose_token(index.queries[0, 0], index.weights[0, 0], context_keys, index_topk)
                     for (_, index), (_, context_keys) in zip(tokens, contexts)]
    wo, bo = projection_weight(attention.o_proj), attention.o_proj.bias
    out = []
    for i, ((projections, _), (context, _)) in enumerate(zip(tokens, contexts)):
        chosen = selection[i] if selection is not None else None
        attended = attend_token(attention, projections.q_nope, projections.q_rope,
                                context if chosen is None else context[chosen])
        out.append(after_attention(x_N[i], attended, wo, bo, block.post_attention_layernorm.weight, block.eps, block.mlp))
    return torch.cat(out, dim=1).view(B, T, hidden), selection


def token_projections(block: LatentAttentionBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[LatentProjections, IndexerProjections | None]:
    """One token's (x [1, 1, hidden]) latent projections and indexer projections (None without indexer)."""
    attention = block.self_attn
    h = rms_norm(x, block.input_layernorm.weight, block.eps)
    projections = attention.project_latent(h, cos, sin)
    indexer = attention.indexer
    return projections, indexer.project(h, projections.query_latent, cos, sin) if indexer is not None else None


def attend_token(attention: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor,
                 context: torch.Tensor) -> torch.Tensor:
    """One query token (q_nope [1, 1, H, Dn], q_rope [1, 1, H, Dr]) in the absorbed form against exactly the entries
    it attends to, `context` [C, kv_lora_rank + Dr] in ascending position: [1, 1, H, Dv]. `exact_attention`
    with one key head for every query head, the entries as keys and their latents as values."""
    entries = context[:, None]  # [C, 1, E]
    out = exact_attention(attention.absorbed_queries(q_nope, q_rope)[0, 0], entries,
                          entries[..., :attention.kv_lora_rank], attention.absorbed_scale)  # [H, kv_lora_rank]
    return attention.latent_values(out)[None, None]


@torch.no_grad()
def choose_token(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor | None:
    """DSA's choice for one query (queries [index_n_heads, D], weights [index_n_heads] fp32) over its context's
    indexer keys [C, D]: the positions of its `k` highest index scores (`dsa.index_scores`' formula, fp32), ties to
    the earlier position, in ascending order; None where it sees k tokens or fewer (all of them)."""
    if keys.shape[0] <= k:
        return None
    scores = F.relu((keys.float()[None] * queries.float()[:, None]).sum(-1) * queries.shape[-1] ** -0.5)  # [heads, C]
    total = (weights.float()[:, None] * scores).sum(0)  # [C]
    return torch.sort(total, descending=True, stable=True).indices[:k].sort().values
