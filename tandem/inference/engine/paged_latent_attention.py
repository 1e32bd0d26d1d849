"""The engine's `LatentBackend` (`tandem.models.mla`): write each step's latent entries (and DSA indexer keys) into
the paged `LatentCache`, then attend over each sequence's cached context.

Legend: N = tokens of the step, G = sequences attended together, L = most queries of one of them, W = most blocks
of one of them, S = block size, E = latent entry features (kv_lora_rank + Dr).

The step's queries form groups, planned once per step and the same for every layer:
- a sequence that computes a chunk (more than `SHORT_QUERY_TOKENS` new tokens, or nothing cached before them) is a
  group of its own and attends in the expanded form: its many queries share each context token, so expanding the
  token once (kv_b_proj) is cheaper than the absorbed form's wider products for every query and key (where DSA
  chooses, it takes the absorbed form over its chosen entries, below);
- the others (decodes; a token and its drafts) form one group padded to the longest query and context, in the
  absorbed form: each context token's entry is read once for all heads and never expanded. The kernels below take
  its real queries alone (`QueryGroup.real`): a step's one short chunk does not multiply every decode's work.
A decode-only step plans from device tensors alone (the contexts' bound is the step's `max_context`).

DSA (`tandem.models.dsa`): a layer with an indexer scores each query's visible context against the cached indexer
keys and keeps its `index_topk` best (`dsa.choose`); a group whose contexts all fit in
`index_topk` keeps every visible token and skips the scores. A chunk reads its context once and attends each query
over its chosen entries of it in the absorbed form (`LatentAttention.attend_chosen`, the trainer's own DSA
attention); a short query gathers its chosen entries alone from the cache ([G, L, index_topk, E]) and attends to
those, so that past `index_topk` tokens its attention reads no more entries however long the context. The choice of each
group is what the block passes on, and a `shared` layer attends under the last one.

Short queries take Triton kernels where they serve the shape (CUDA, `kernels_serve`): DSA's index scores and the
absorbed-form attention read the cache in place through the block tables (`tandem.kernels.latent_attention`), so a
decode-only step's work is sized by its bound alone and a CUDA graph captures it (`cuda_graphs.py`). Chunks, and
everything on the CPU, take the torch path: each group gathers its sequences' whole blocks (W x S entries per
sequence, padded to the group's longest context; a chunk expands them all once), and scores its queries in slices of
at most `QUERY_KEY_PAIRS` (query, context token) pairs, so that logits and index scores stay bounded at long
contexts. Both paths hand on the same `Chosen`, so a `shared` layer reads either's.

An FP8 cache (`LatentCache`, `engine.kv_cache_dtype = "fp8"`) changes no plan: the cache quantizes what it is
written, the torch path reads entries and keys through it (dequantized, in the model's dtype), and the kernels take
its scales and RoPE parts beside the FP8 tensors and dequantize in registers.

Exact mode (`[run] exact`, `tandem.models.exact_latent`) plans no groups and takes no kernel: its blocks ask this
backend for each token's context alone (`latent_contexts`), as the trainer's packed rows give it, and attend to it
themselves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tandem.inference.engine.kv_cache import LatentCache
from tandem.inference.engine.paged_attention import SHORT_QUERY_TOKENS, AttentionMetadata
from tandem.kernels import latent_attention as latent_kernels
from tandem.models.dsa import Chosen, IndexerProjections, choose
from tandem.models.exact_latent import TokenContext
from tandem.models.mla import LatentAttention, LatentProjections

QUERY_KEY_PAIRS = 2**22
"""Most (query, context token) pairs one op of a group scores: the logits of 64 heads in fp32 take 1 GiB."""


@dataclass
class QueryGroup:
    """Sequences attended together by one batched op."""

    rows: torch.Tensor
    """[G, L] the step's token of each query; a padding query repeats its sequence's last one (and its output)."""
    positions: torch.Tensor
    """[G, L] each query's position (it sees context tokens 0 to it); negative: a CUDA-graph padding row, context 0."""
    blocks: torch.Tensor
    """[G, W] cache blocks of each sequence's context."""
    block_size: int
    longest: int
    """A bound on every context of the group (W x S at most)."""
    expanded: bool
    """Attend in the expanded form (a chunk), else the absorbed one."""
    real: torch.Tensor | None = None
    """[Q] where the padding leaves queries out (sequences of fewer than L): the flat [G x L] indices of the others,
    which the kernels take alone; None: every query is real."""

    @functools.cached_property
    def kernel_queries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries the kernels take, the real ones: each one's token of the step, row of `blocks` and position,
        [Q] each; made once a step, for every layer."""
        G, L = self.rows.shape
        seqs = torch.arange(G, device=self.rows.device)[:, None].expand(G, L)
        queries = (self.rows.flatten(), seqs.flatten(), self.positions.flatten())
        return queries if self.real is None else tuple(t[self.real] for t in queries)

    @property
    def visible(self) -> torch.Tensor:
        """[G, L, W x S] bool: context token s is at or before the query's position; a padding row sees its first
        slot, so that its softmax stays finite."""
        keys = torch.arange(self.blocks.shape[1] * self.block_size, device=self.positions.device)
        return keys[None, None] <= self.positions.clamp(min=0)[..., None]


def kernels_serve(cache: LatentCache, kv_lora_rank: int) -> bool:
    """Whether short queries over `cache` take the Triton kernels (`tandem.kernels.latent_attention.serves`)."""
    index_dim = cache.index_keys.shape[-1] if cache.index_keys.shape[0] else None
    return latent_kernels.serves(kv_lora_rank, cache.entry_dim - kv_lora_rank, index_dim, cache.entries.device)


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
            return [QueryGroup(rows, (m.seq_lens - 1)[:, None], m.block_tables[:b, :-(-bound // S)], S, bound, False)]
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
                groups.append(QueryGroup(rows, positions, m.block_tables[i:i + 1, :-(-ctx // S)], S, ctx, True))
            start += q_len
        if short:
            q_lens_host = [m.query_lens_host[i] for i in short]
            lens = [m.seq_lens_host[i] for i in short]
            q_lens = torch.tensor(q_lens_host, device=device)
            seqs = torch.tensor(short, device=device)
            offsets = torch.minimum(torch.arange(max(q_lens_host), device=device)[None], q_lens[:, None] - 1)  # [G, L]
            rows = m.query_start[seqs][:, None] + offsets
            positions = (torch.tensor(lens, device=device) - q_lens)[:, None] + offsets
            L = max(q_lens_host)
            real = None if min(q_lens_host) == L else torch.tensor(
                [g * L + j for g, q_len in enumerate(q_lens_host) for j in range(q_len)], device=device)
            groups.append(QueryGroup(rows, positions, m.block_tables[seqs, :-(-max(lens) // S)], S, max(lens), False,
                                     real))
        return groups

    def attend_latent(self, layer_idx: int, attention: LatentAttention, projections: LatentProjections,
                      index: IndexerProjections | None, selection: list[Chosen | None] | None
                      ) -> tuple[torch.Tensor, list[Chosen | None] | None]:
        slots = self.meta.slot_mapping
        self.cache.write(layer_idx, slots, projections.entries[0])
        groups = self.groups()
        in_place = kernels_serve(self.cache, attention.kv_lora_rank)
        if index is not None:
            self.cache.write_index_keys(layer_idx, slots, index.keys[0])
            selection = [self._select_in_place(group, layer_idx, index) if in_place and not group.expanded
                         else self._select(group, layer_idx, index) for group in groups]
        q_nope, q_rope = projections.q_nope[0], projections.q_rope[0]  # [N, H, Dn], [N, H, Dr]
        out = q_nope.new_empty(*q_nope.shape[:2], attention.v_head_dim)
        for group, chosen in zip(groups, selection or [None] * len(groups)):
            if in_place and not group.expanded:
                rows = group.kernel_queries[0]
                out[rows] = self._attend_in_place(attention, q_nope[rows], q_rope[rows], layer_idx, group, chosen)
                continue
            if chosen is not None and not group.expanded:
                out[group.rows] = self._attend_chosen(attention, q_nope[group.rows], q_rope[group.rows], layer_idx,
                                                      group, chosen)
                continue
            context = self.cache.read_entries(layer_idx, group.blocks).flatten(1, 2)  # [G, W x S, E]
            if chosen is not None:  # a chunk: the context read once, each query over its chosen entries of it
                out[group.rows] = attention.attend_chosen(q_nope[group.rows], q_rope[group.rows], context,
                                                          chosen.positions, chosen.kept)
                continue
            attend = attention.attend_expanded if group.expanded else attention.attend_absorbed
            out[group.rows] = attend(q_nope[group.rows], q_rope[group.rows], context, group.visible, QUERY_KEY_PAIRS)
        return out[None], selection

    def latent_contexts(self, layer_idx: int, entries: torch.Tensor,
                        index_keys: torch.Tensor | None) -> list[TokenContext]:
        """Exact mode (`tandem.models.exact_latent.ExactLatentBackend`): write the step's entries [1, N, E] (and
        indexer keys), then read each token's context back from the cache, in the step's token order. Its steps
        run eager: the host knows every length."""
        m, S = self.meta, self.cache.block_size
        assert m.query_lens_host is not None and m.seq_lens_host is not None, "exact attention needs host lengths"
        self.cache.write(layer_idx, m.slot_mapping, entries[0])
        if index_keys is not None:
            self.cache.write_index_keys(layer_idx, m.slot_mapping, index_keys[0])
        contexts: list[TokenContext] = []
        for i, (q_len, ctx) in enumerate(zip(m.query_lens_host, m.seq_lens_host)):
            blocks = m.block_tables[i, :-(-ctx // S)]
            seq_entries = self.cache.read_entries(layer_idx, blocks).flatten(0, 1)[:ctx]
            seq_keys = self.cache.read_index_keys(layer_idx, blocks).flatten(0, 1)[:ctx] if index_keys is not None else None
            contexts.extend((seq_entries[:p + 1], seq_keys[:p + 1] if seq_keys is not None else None)
                            for p in range(ctx - q_len, ctx))
        return contexts

    def _attend_chosen(self, attention: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_idx: int,
                       group: QueryGroup, chosen: Chosen) -> torch.Tensor:
        """Short queries q_nope [G, L, H, Dn], q_rope [G, L, H, Dr] over their chosen entries only, each query one
        group of the absorbed form: [G, L, H, Dv]."""
        G, L, K = chosen.positions.shape
        S = self.cache.block_size
        blocks = group.blocks.gather(1, (chosen.positions // S).flatten(1)).view(G, L, K)
        context = self.cache.read_entries(layer_idx, blocks * S + chosen.positions % S, per_slot=True)  # [G, L, K, E]
        out = attention.attend_absorbed(q_nope.flatten(0, 1)[:, None], q_rope.flatten(0, 1)[:, None],
                                        context.flatten(0, 1), chosen.kept.flatten(0, 1)[:, None], QUERY_KEY_PAIRS)
        return out.view(G, L, *out.shape[2:])

    def _attend_in_place(self, attention: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_idx: int,
                         group: QueryGroup, chosen: Chosen | None) -> torch.Tensor:
        """`_attend_chosen`'s result (`chosen`), or the absorbed form's over every visible entry (None), of the
        group's kernel queries (`QueryGroup.kernel_queries`; q_nope [Q, H, Dn], q_rope [Q, H, Dr]), from the kernels
        reading the cache in place: [Q, H, Dv]."""
        _, query_seq, query_pos = group.kernel_queries
        q = attention.absorbed_queries(q_nope, q_rope)  # [Q, H, kv_lora_rank + Dr]
        if chosen is None:
            lengths, bound, positions = (query_pos + 1).clamp(min=0), group.longest, None
        else:
            positions, lengths, bound = chosen.positions, chosen.counts, chosen.positions.shape[1]
        out = latent_kernels.latent_attention(q, self.cache.layer(layer_idx), group.blocks, query_seq, lengths, bound,
                                              attention.absorbed_scale, attention.kv_lora_rank, positions,
                                              *self.cache.layer_scales(layer_idx))
        return attention.latent_values(out)

    def _select_in_place(self, group: QueryGroup, layer_idx: int, index: IndexerProjections) -> Chosen | None:
        """`_select` of short queries by the index-score kernel over the cached keys in place: the choice of each of
        the group's kernel queries (`QueryGroup.kernel_queries`)."""
        if group.longest <= self.index_topk:
            return None
        rows, query_seq, query_pos = group.kernel_queries
        positions, counts = latent_kernels.choose(index.queries[0][rows], index.weights[0][rows],
                                                  self.cache.layer_index_keys(layer_idx), group.blocks, query_seq,
                                                  query_pos, group.longest, self.index_topk, QUERY_KEY_PAIRS,
                                                  self.cache.layer_index_key_scales(layer_idx))
        return Chosen(positions, counts)

    def _select(self, group: QueryGroup, layer_idx: int, index: IndexerProjections) -> Chosen | None:
        """The group's DSA choice from a layer's cached indexer keys: each query's chosen positions of its context
        (`QueryGroup.visible`'s W x S); None where it is every visible token."""
        if group.longest <= self.index_topk:
            return None
        context = self.cache.read_index_keys(layer_idx, group.blocks).flatten(1, 2)  # [G, W x S, index_head_dim]
        positions, kept = choose(index.queries[0][group.rows], index.weights[0][group.rows], context, group.visible,
                                 self.index_topk, QUERY_KEY_PAIRS)
        return Chosen(positions, kept.sum(-1))
