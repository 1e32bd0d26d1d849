"""The engine's `LatentBackend` (`tandem.models.mla`): write each step's latent entries (and DSA indexer keys) into
the paged `LatentCache`, then attend over each sequence's cached context.

Legend: N = tokens of the step, G = sequences attended together, L = most queries of one of them, W = most blocks
of one of them, S = block size, E = latent entry features (kv_lora_rank + Dr).

The step's queries form groups, planned once per step and the same for every layer:
- a sequence that computes a chunk (more than `SHORT_QUERY_TOKENS` new tokens, or nothing cached before them) is a
  group of its own and attends in the expanded form: its many queries share each context token, so expanding the
  token once (kv_b_proj) is cheaper than the absorbed form's wider products for every query and key;
- the others (decodes; a token and its drafts) form one group padded to the longest query and context, in the
  absorbed form: each context token's entry is read once for all heads and never expanded.
A decode-only step plans from device tensors alone (the contexts' bound is the step's `max_context`).

DSA (`tandem.models.dsa`): a layer with an indexer scores each query's visible context against the cached indexer
keys (`dsa.index_scores`) and keeps its `index_topk` best (`dsa.select`); a group whose contexts all fit in
`index_topk` keeps every visible token and skips the scores. The choice, one [G, L, W x S] mask or None per group, is
what the block passes on, and a `shared` layer attends under the last one.

Torch only, on CPU and CUDA: each group gathers its sequences' whole blocks (W x S entries per sequence, padded to
the group's longest context; a chunk expands them all once), and scores its queries in slices of at most
`QUERY_KEY_PAIRS` (query, context token) pairs, so that logits and index scores stay bounded at long contexts. No
CUDA graph is captured for this cache: a graph would hold the gathered context of its largest bound for good.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.inference.engine.kv_cache import LatentCache
from tandem.inference.engine.paged_attention import SHORT_QUERY_TOKENS, AttentionMetadata
from tandem.models.dsa import IndexerProjections, SparseContext, index_scores, select
from tandem.models.mla import LatentAttention, LatentProjections, query_slices

QUERY_KEY_PAIRS = 2**22
"""Most (query, context token) pairs one op of a group scores: the logits of 64 heads in fp32 take 1 GiB."""


@dataclass
class QueryGroup:
    """Sequences attended together by one batched op."""

    rows: torch.Tensor
    """[G, L] the step's token of each query; a padding query repeats its sequence's last one (and its output)."""
    blocks: torch.Tensor
    """[G, W] cache blocks of each sequence's context."""
    visible: torch.Tensor
    """[G, L, W x S] bool: context token s is at or before the query's position."""
    longest: int
    """A bound on every context of the group (W x S at most)."""
    expanded: bool
    """Attend in the expanded form (a chunk), else the absorbed one."""


def query_group(rows: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor, block_size: int, longest: int,
                expanded: bool) -> QueryGroup:
    """A group of queries at `positions` [G, L]; a negative position (a CUDA-graph padding row, context 0) sees
    its first slot, so that its softmax stays finite."""
    keys = torch.arange(blocks.shape[1] * block_size, device=positions.device)
    visible = keys[None, None] <= positions.clamp(min=0)[..., None]
    return QueryGroup(rows, blocks, visible, longest, expanded)


class PagedLatentAttention:
    def __init__(self, cache: LatentCache, metadata: AttentionMetadata, index_topk: int):
        """`index_topk`: DSA's tokens per query (unused without indexers)."""
        self.cache = cache
        self.meta = metadata
        self.index_topk = index_topk
        self._groups: list[QueryGroup] | None = None

    def groups(self) -> list[QueryGroup]:
        """The step's query groups (the module docstring), planned when the first layer asks."""
        if self._groups is None:
            self._groups = self._plan()
        return self._groups

    def _plan(self) -> list[QueryGroup]:
        m, S = self.meta, self.cache.block_size
        device = m.seq_lens.device
        if m.block_q == 1:  # decode-only: one query per sequence, at its context's last position
            b = m.seq_lens.shape[0]
            bound = m.max_context if m.max_context is not None else m.block_tables.shape[1] * S
            rows = torch.arange(b, device=device)[:, None]
            return [query_group(rows, (m.seq_lens - 1)[:, None], m.block_tables[:b, :-(-bound // S)], S, bound, False)]
        assert m.query_lens_host is not None and m.seq_lens_host is not None, "a step that prefills has host lengths"
        groups: list[QueryGroup] = []
        short: list[int] = []
        start = 0
        for i, (q_len, ctx) in enumerate(zip(m.query_lens_host, m.seq_lens_host)):
            if q_len < ctx and q_len <= SHORT_QUERY_TOKENS:
                short.append(i)
            else:
                rows = torch.arange(start, start + q_len, device=device)[None]
                positions = torch.arange(ctx - q_len, ctx, device=device)[None]
                groups.append(query_group(rows, positions, m.block_tables[i:i + 1, :-(-ctx // S)], S, ctx, True))
            start += q_len
        if short:
            q_lens_host = [m.query_lens_host[i] for i in short]
            lens = [m.seq_lens_host[i] for i in short]
            q_lens = torch.tensor(q_lens_host, device=device)
            seqs = torch.tensor(short, device=device)
            offsets = torch.minimum(torch.arange(max(q_lens_host), device=device)[None], q_lens[:, None] - 1)  # [G, L]
            rows = m.query_start[seqs][:, None] + offsets
            positions = (torch.tensor(lens, device=device) - q_lens)[:, None] + offsets
            groups.append(query_group(rows, positions, m.block_tables[seqs, :-(-max(lens) // S)], S, max(lens), False))
        return groups

    def attend_latent(self, layer_idx: int, attention: LatentAttention, projections: LatentProjections,
                      index: IndexerProjections | None, selection: list[torch.Tensor | None] | None
                      ) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
        slots = self.meta.slot_mapping
        entries = self.cache.layer(layer_idx)  # [blocks, S, E]
        entries.view(-1, entries.shape[-1]).index_copy_(0, slots, projections.entries[0])
        groups = self.groups()
        if index is not None:
            keys = self.cache.layer_index_keys(layer_idx)
            keys.view(-1, keys.shape[-1]).index_copy_(0, slots, index.keys[0])
            selection = [self._select(group, keys, index) for group in groups]
        q_nope, q_rope = projections.q_nope[0], projections.q_rope[0]  # [N, H, Dn], [N, H, Dr]
        out = q_nope.new_empty(*q_nope.shape[:2], attention.v_head_dim)
        for group, chosen in zip(groups, selection or [None] * len(groups)):
            context = entries[group.blocks].flatten(1, 2)  # [G, W x S, E]
            visible = group.visible if chosen is None else chosen
            attend = attention.attend_expanded if group.expanded else attention.attend_absorbed
            out[group.rows] = attend(q_nope[group.rows], q_rope[group.rows], context, visible, QUERY_KEY_PAIRS)
        return out[None], selection

    def _select(self, group: QueryGroup, keys: torch.Tensor, index: IndexerProjections) -> torch.Tensor | None:
        """The group's DSA choice [G, L, W x S] from a layer's cached indexer keys; None where it is every token."""
        if group.longest <= self.index_topk:
            return None
        context = keys[group.blocks].flatten(1, 2)  # [G, W x S, index_head_dim]
        queries, weights = index.queries[0][group.rows], index.weights[0][group.rows]
        chosen = [select(index_scores(queries[:, part], context, weights[:, part]),
                         SparseContext(group.visible[:, part], self.index_topk))
                  for part in query_slices(group.visible.numel(), group.rows.shape[1], QUERY_KEY_PAIRS)]
        return torch.cat(chosen, dim=1)
