"""Turn a scheduled batch into logits: input prep, one forward pass, the LM head on last tokens.

Two runners share the interface `run(batch) -> logits [S, V]` (float32, one row per sequence
that samples this step, in batch order):
- `PagedModelRunner`: tandem's native models; every token is computed once and its keys and
  values kept in the paged cache;
- `RecomputeModelRunner`: any transformers model (the slow path); no cache, each sampling
  sequence runs again from its first token.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.inference.engine.kv_cache import KVCache
from tandem.inference.engine.paged_attention import AttentionMetadata, PagedAttention, PrefillSpan
from tandem.inference.engine.scheduler import ScheduledBatch


class PagedModelRunner:
    def __init__(self, model: nn.Module, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.device = device

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        input_ids, positions, metadata, sample_index = self.prepare(batch)
        hidden = self.model(input_ids[None], positions[None], attention=PagedAttention(self.cache, metadata))
        return self.model.lm_head(hidden[0, sample_index]).float()

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flattened input ids and positions [N], attention metadata, and the rows to sample from."""
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        sample_index: list[int] = []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end, offset = seq.num_computed_tokens, seq.num_computed_tokens + num_new, len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq.block_table, start, end))
            if num_new == 1 and start > 0:
                decode_index.append(offset)
                decode_tables.append(seq.block_table)
                decode_lens.append(end)
            else:
                context = None
                if start > 0:
                    context = torch.tensor(seq.block_table[:-(-end // self.block_size)], device=self.device)
                prefills.append(PrefillSpan(offset, num_new, end, context))
            if batch.samples(i):
                sample_index.append(offset + num_new - 1)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, device=self.device),
            prefills=prefills,
            decode_token_index=torch.tensor(decode_index, dtype=torch.long, device=self.device),
            **self._decode_blocks(decode_tables, decode_lens),
        )
        return (torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), metadata,
                torch.tensor(sample_index, dtype=torch.long, device=self.device))

    def _decode_blocks(self, tables: list[list[int]], lens: list[int]) -> dict[str, torch.Tensor]:
        """Padded block tables [Bd, M] and the mask [Bd, 1, 1, M * block_size] of the decode contexts."""
        width = max((len(t) for t in tables), default=1)
        padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)
        positions = torch.arange(width * self.block_size, device=self.device)
        mask = positions[None] < torch.tensor(lens, dtype=torch.long, device=self.device)[:, None]
        return {"decode_blocks": padded.view(len(tables), width), "decode_mask": mask[:, None, None]}


class RecomputeModelRunner:
    """No KV cache: each sampling sequence runs again from its first token, one forward pass each.

    One pass per sequence, not one packed row: a packed row's attention mask grows with the square
    of the whole batch's tokens, a sequence's only with its own.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model
        self.device = device

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        rows = []
        for i, seq in enumerate(batch.seqs):
            if batch.samples(i):  # a chunk that does not reach the end leaves nothing to keep
                ids = torch.tensor([seq.token_ids], device=self.device)
                hidden = self.model(ids, torch.arange(seq.num_tokens, device=self.device)[None])
                rows.append(hidden[0, -1])
        if not rows:
            return torch.empty(0, self.model.lm_head.weight.shape[0], device=self.device)
        return self.model.lm_head(torch.stack(rows)).float()
