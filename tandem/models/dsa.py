"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): a light indexer picks, for each query, the `index_topk`
tokens of its document it attends to.

    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s]) / sqrt(D_I)     the index score of key s for query t
      q_I[t, j] = RoPE(wq_b(latent_t)) head j of `index_n_heads`     (latent: MLA's normed query latent)
      k_I[s]    = RoPE(LayerNorm(wk(x_s)))                          (one head, shared by the query heads)
      w[t, j]   = weights_proj(x_t)[j] / sqrt(index_n_heads)
RoPE turns the first Dr (`qk_rope_head_dim`) features of q_I and k_I, in interleaved pairs for GLM-5; x is the
block's normed input; scores are computed in fp32. Query t attends to the `index_topk` tokens s <= t of its
document with the highest I[t, s] (all of them where it sees fewer): MLA's softmax over those only. A `shared`
layer (GLM-5's `indexer_types`) has no indexer and reuses the selection of the last `full` layer before it.

The selection is a discrete choice: no gradient flows through it, and the indexer's weights get none (its forward
runs without autograd, as in DeepSeek-V3.2's and transformers' code); they are frozen (`requires_grad` off).
Training them needs DeepSeek-V3.2's separate indexer loss (a KL divergence to the dense attention's distribution),
which tandem does not implement. DeepSeek's kernels also turn q_I and k_I by a Hadamard matrix and quantize them to
FP8 before the product: the rotation is orthogonal (no dot product changes) and the quantization an inference
approximation, so both are left out, as transformers leaves them out.

Where no query sees more than `index_topk` tokens (no document longer), the selection is every visible token:
`sparse_context` is None and the layers attend densely through the model's attention backend, without indexer.
Otherwise each query's choice is its positions (`Chosen`) and attention reads only those
(`tandem.models.chosen_attention`): memory and work grow with T x `index_topk`, not T^2. The index scores would grow
with T^2 x index_n_heads in fp32: they are made and reduced to their top-k in slices of the queries (`choose`), each of
at most `SCORED_PAIRS` (query, key) pairs, each slice scoring only the keys up to its last query, under a
visibility made from the documents' ids (no [T, T] mask). Nothing of them is kept for backward (they carry no
gradient): only the chosen positions. A checkpointed block recomputing its forward in backward scores again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.attention import document_ids
from tandem.models.layers import projection_weight
from tandem.models.chosen_attention import query_slices
from tandem.models.mla import rotate

INDEXER_NORM_EPS = 1e-6
"""Epsilon of the indexer's key LayerNorm (`indexer.k_norm`)."""

SCORED_PAIRS = 2**22
"""Most (query, key) pairs whose index scores exist at once: 512 MiB of fp32 at GLM-5's 32 indexer heads."""


Visibility = torch.Tensor | Callable[[slice], torch.Tensor]
"""The keys each query may choose: [B, T, S] bool, or a function of a slice of the queries giving theirs [B, L, S]
(a trainer's row, whose [T, T] mask is never made whole)."""


@dataclass
class SparseContext:
    """What every DSA layer of one forward shares."""

    documents: torch.Tensor
    """[B, T] the packed document of each token."""
    index_topk: int

    def visible(self, part: slice) -> torch.Tensor:
        """[B, L, E] bool: the keys of their document at or before them that the L queries of slice `part` see,
        among the E keys up to the slice's last query (none after it sees any)."""
        end = min(part.stop, self.documents.shape[1])
        keys = torch.arange(end, device=self.documents.device)
        queries = keys[part]
        same_document = self.documents[:, part, None] == self.documents[:, None, :end]
        return same_document & (keys[None, None] <= queries[None, :, None])


def sparse_context(position_ids: torch.Tensor, index_topk: int) -> SparseContext | None:
    """The forward's `SparseContext`, or None where the selection would keep every visible token: query t sees
    position_t + 1 tokens (positions restart at each packed document). Reading the longest is a host sync."""
    if int(position_ids.max()) < index_topk:
        return None
    return SparseContext(document_ids(position_ids), index_topk)


@dataclass
class Chosen:
    """The DSA choice of queries [...]: a trainer's row [B, T], an engine group's [G, L] or its kernels' [Q]."""

    positions: torch.Tensor
    """[..., K] context positions of each query's chosen tokens, highest index score first (K <= index_topk)."""
    counts: torch.Tensor
    """[...] how many of them the query sees: its first ones (a query seeing fewer than K tokens has fewer; a top-k
    ranks the positions it cannot see last)."""

    @property
    def kept(self) -> torch.Tensor:
        """[..., K] bool: the position is one the query sees."""
        return torch.arange(self.positions.shape[-1], device=self.positions.device) < self.counts[..., None]


@dataclass
class IndexerProjections:
    queries: torch.Tensor
    """[B, T, index_n_heads, index_head_dim], rotated"""
    keys: torch.Tensor
    """[B, T, index_head_dim], rotated: what a cache keeps per token"""
    weights: torch.Tensor
    """[B, T, index_n_heads] fp32, w[t, j] (with its 1 / sqrt(index_n_heads))"""


class Indexer(nn.Module):
    """The DSA indexer of one layer under Hugging Face's names (`self_attn.indexer.wq_b`, ...); frozen."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int, interleaved: bool):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim, self.interleaved = num_heads, head_dim, rope_dim, interleaved
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.requires_grad_(False)

    @torch.no_grad()
    def project(self, x: torch.Tensor, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> IndexerProjections:
        """Normed block input x [B, T, hidden] and query latent [B, T, q_lora_rank] -> the indexer's queries, keys
        and head weights of each token."""
        B, T, _ = x.shape
        H, D, Dr = self.num_heads, self.head_dim, self.rope_dim
        q = self.wq_b(latent).view(B, T, H, D)
        q = torch.cat((rotate(q[..., :Dr], cos, sin, self.interleaved), q[..., Dr:]), dim=-1)
        k = self.k_norm(self.wk(x)).view(B, T, 1, D)
        k = torch.cat((rotate(k[..., :Dr], cos, sin, self.interleaved), k[..., Dr:]), dim=-1)[:, :, 0]
        weights = F.linear(x.float(), projection_weight(self.weights_proj).float()) * H ** -0.5
        return IndexerProjections(q, k, weights)


def index_scores(queries: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """I[t, s] in fp32 (the module docstring) of queries [B, T, H, D] with weights [B, T, H] against keys [B, S, D]:
    [B, T, S]. Memory: [B, T, H, S] fp32 at once. On CUDA, half-precision queries and keys multiply on tensor cores
    into fp32 (`out_dtype`): each product is exact in fp32 and the sums are fp32, as in the engine's score kernel,
    at the tensor cores' rate rather than fp32's."""
    B, T, H, D = queries.shape
    if queries.is_cuda and queries.dtype in (torch.bfloat16, torch.float16) and keys.dtype == queries.dtype:
        dots = torch.bmm(queries.reshape(B, T * H, D), keys.transpose(1, 2), out_dtype=torch.float32).view(B, T, H, -1)
    else:
        dots = torch.matmul(queries.float(), keys.float().transpose(-1, -2)[:, None])
    scores = F.relu(dots * D ** -0.5)  # [B, T, H, S]
    return torch.matmul(weights[:, :, None], scores)[:, :, 0]


def top_k(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index scores [B, T, S] -> each query's k keys of highest score among those `visible` [B, T, S] lets it see:
    their indices [B, T, k'] (k' = min(k, S)) and whether each is visible (a query that sees fewer than k' keys gets
    others after them, not visible)."""
    top = scores.masked_fill(~visible, float("-inf")).topk(min(k, scores.shape[-1]), dim=-1).indices
    return top, visible.gather(-1, top)


def choose(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: Visibility, k: int,
           max_pairs: int = SCORED_PAIRS) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k` of the index scores of queries [B, T, H, D] with weights [B, T, H] against keys [B, S, D] (a row's, a
    gathered row's or a cache's), among the keys `visible` lets each see; scored in slices of the queries of at most
    `max_pairs` (query, key) pairs each (one query at least). A slice's visibility may be narrower than S: the keys
    past it are seen by none of its queries and not scored (a causal row's slice scores the keys up to its last
    query). Positions [B, T, min(k, S)], the unkept ones last."""
    B, T, S = queries.shape[0], queries.shape[1], keys.shape[1]
    width = min(k, S)
    parts = []
    for part in query_slices(B * T * S, T, max_pairs):
        seen = visible(part) if callable(visible) else visible[:, part]
        positions, kept = top_k(index_scores(queries[:, part], keys[:, :seen.shape[-1]], weights[:, part]), seen, k)
        missing = width - positions.shape[-1]  # a slice that sees fewer keys than k keeps them all
        parts.append((F.pad(positions, (0, missing)), F.pad(kept, (0, missing))))
    positions, kept = (torch.cat(chosen, dim=1) for chosen in zip(*parts))
    return positions, kept


def chosen(index: IndexerProjections, keys: torch.Tensor, visible: Visibility, k: int) -> Chosen:
    """`choose` of `index`'s queries over `keys` as a `Chosen`."""
    positions, kept = choose(index.queries, index.weights, keys, visible, k)
    return Chosen(positions, kept.sum(-1))
