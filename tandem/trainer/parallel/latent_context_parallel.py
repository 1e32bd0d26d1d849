"""Context parallelism for latent attention (GLM-5, DeepSeek-V3): each rank's queries attend over the latent entries
of the whole row, gathered from the `cp` group.

A latent block hands its attention backend its projections instead of expanded keys and values
(`tandem.models.mla.LatentBackend`), so this backend, applied from outside as `RingAttention` is, sees each token's
latent entry [c | RoPE(k_rope)] (kv_lora_rank + Dr numbers shared by every head) and, in a DSA layer, the indexer's
projections of its tokens. Per layer it
1. all-gathers the group's entries into the padded row's order. The gather's backward is a reduce-scatter: each rank
   receives the gradient of its own tokens' entries from the queries of every rank, and from there its own
   projections (kv_a_proj_with_mqa, kv_a_layernorm) get their gradient;
2. in a `full` DSA layer, all-gathers the indexer's keys of the row (no gradient: the selection is a discrete choice)
   and keeps each local query's `index_topk` best among the keys it sees (`dsa.chosen`): the choice one rank makes
   over the whole row. A `shared` layer reuses it. Where no document of the row is longer than `index_topk`, every
   visible key is kept (what top-k would keep) and no score is computed;
3. attends the local queries over their chosen entries in the absorbed form (`LatentAttention.attend_chosen`, as
   the one-rank path does), or, where every visible key is kept, over the gathered entries expanded to each head's
   keys and values (`LatentAttention.attend_expanded`) under the document-causal mask by global token index, in
   slices of `parallel.cp_query_chunk` queries.

Why an all-gather of latents rather than a ring of keys and values: an entry is kv_lora_rank + Dr numbers a token
(576 for GLM-5) where the expanded keys and values are H x (Dn + Dr + Dv) (64 x 512 = 32,768): the whole row's
entries cost less to gather once than a ring's expanded blocks cost to pass, and the indexer's choice needs the keys
of the whole row anyway. Why expanded where every visible key is attended: the absorbed products are wider
(kv_lora_rank + Dr and kv_lora_rank features a head against Dn + Dr and Dv: about twice the attention FLOPs at
GLM-5's shape), which only a sparse choice repays. Its price: every rank expands the whole row's entries (kv_b_proj
over T tokens, small beside attention over T_local x T pairs) and holds the row's keys and values of the layer it
computes. What each rank holds for the whole row besides: the entries (T x 576 a layer), the indexer's keys
(T x index_head_dim) and the visibility mask (T_local x T booleans); everything else scales with T_local.

The document ids and global token indices come from the shard (`ContextShard`): padding is a document of its own
after every real token, so no real token sees it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd

from tandem.models.dsa import IndexerProjections, chosen
from tandem.models.mla import LatentAttention, LatentProjections
from tandem.trainer.micro_batch import ContextShard


class LatentContextAttention:
    """The `LatentBackend` of a context-parallel shard of a latent model (the module docstring).

    `index_topk`: the model's DSA budget (0 without DSA)."""

    def __init__(self, shard: ContextShard, query_chunk: int, index_topk: int):
        self.shard = shard
        self.query_chunk = query_chunk
        self.index_topk = index_topk
        doc = shard.row_document_ids
        gathered = torch.cat([shard.token_index(r) for r in range(shard.size)])  # row index of each gathered token
        self.row_order = torch.argsort(gathered)
        q_index = shard.token_index(shard.rank)
        keys = torch.arange(doc.numel(), device=doc.device)
        self.visible = ((doc[q_index][:, None] == doc[None]) & (keys[None] <= q_index[:, None]))[None]
        """[1, T_local, T_padded] bool: the keys of its document at or before it that each local query sees."""
        self.selects = index_topk > 0 and max(shard.row_document_lengths) > index_topk
        """Whether some query sees more than `index_topk` keys: known on the host, the same on every rank."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T_local, F] of every rank -> [1, T_padded, F] in row order, differentiable.

        An all-gather as an all-to-all of cp copies (each rank sends every rank its tokens): the same bytes on the
        links, and its backward (the reverse all-to-all, then the copies' gradients summed) is the reduce-scatter,
        through the one differentiable collective whose name all supported torch versions share."""
        copies = x[0].repeat(self.shard.size, 1)
        return all_to_all_single_autograd(copies, None, None, self.shard.group)[self.row_order][None]

    def attend_latent(self, layer_idx: int, attention: LatentAttention, projections: LatentProjections,
                      index: IndexerProjections | None, selection: Any) -> tuple[torch.Tensor, Any]:
        """The local queries over the row's entries: [1, T_local, H, Dv], and the DSA selection (a `Chosen` over
        the gathered row; None: every visible key) a following `shared` layer reuses."""
        entries = self.gather(projections.entries)
        if index is not None and self.selects:
            with torch.no_grad():
                selection = chosen(index, self.gather(index.keys), self.visible, self.index_topk)
        if selection is None:
            return attention.attend_expanded(projections.q_nope, projections.q_rope, entries, self.visible,
                                             self.query_chunk * self.visible.shape[-1]), None
        return attention.attend_chosen(projections.q_nope, projections.q_rope, entries, selection.positions,
                                       selection.kept), selection
