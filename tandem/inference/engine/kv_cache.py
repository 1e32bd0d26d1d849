"""The paged KV caches: per layer, keys and values [num_blocks, block_size, kv_heads, head_dim] (`KVCache`), or for
multi-head latent attention one latent entry per token [num_blocks, block_size, kv_lora_rank + rope dims] and the DSA
indexer's key beside it (`LatentCache`).

Token `offset` of block `b` lives at slot `b * block_size + offset` of the flat view that writes
use; reads gather whole blocks (one contiguous copy each, far cheaper than per-token gathers).
The cache is zero-filled, so padded reads (a decode batch gathers as many blocks as its longest
context) only ever see finite numbers, which the attention mask then weighs by exactly zero.
One block more than the block manager hands out holds the writes of padding tokens (CUDA-graph
batches are padded up to a captured size): `pad_slot` is its first slot.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size
        """A slot no sequence owns: padding tokens write their keys and values here."""

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [num_blocks, block_size, kv_heads, head_dim] of one layer (views, written in place)."""
        return self.keys[layer_idx], self.values[layer_idx]

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token over all layers: what a decode reads per token of its context."""
        return (self.keys.nbytes + self.values.nbytes) // (self.keys.shape[1] * self.block_size)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class LatentCache:
    """Multi-head latent attention's cache (`tandem.models.mla`): per layer one entry [c | RoPE(k_rope)] of
    `entry_dim` (kv_lora_rank + Dr) numbers per token for every head together, where `KVCache` would hold
    2 x heads x head_dim; and per layer with a DSA indexer (`indexed_layers`), the indexer's key of `index_dim`
    numbers per token, in the same blocks (a block holds the same tokens in every tensor). Same slots, zero fill
    and pad block as `KVCache`."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, entry_dim: int, indexed_layers: list[int],
                 index_dim: int, dtype: torch.dtype, device: torch.device):
        self.entries = torch.zeros(num_layers, num_blocks + 1, block_size, entry_dim, dtype=dtype, device=device)
        self.index_keys = torch.zeros(len(indexed_layers), num_blocks + 1, block_size, index_dim, dtype=dtype, device=device)
        self._index_row = {layer: row for row, layer in enumerate(indexed_layers)}
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size

    def layer(self, layer_idx: int) -> torch.Tensor:
        """Entries [num_blocks, block_size, entry_dim] of one layer (a view, written in place)."""
        return self.entries[layer_idx]

    def layer_index_keys(self, layer_idx: int) -> torch.Tensor:
        """The indexer's keys [num_blocks, block_size, index_dim] of a layer that has an indexer (a view)."""
        return self.index_keys[self._index_row[layer_idx]]

    @property
    def bytes_per_token(self) -> int:
        """Entries and indexer keys of one token over all layers: what a decode reads per token of its context
        without DSA. Under DSA past `index_topk` tokens a decode reads every token's indexer keys but only its
        chosen tokens' entries, so this overstates its reads there."""
        return (self.entries.nbytes + self.index_keys.nbytes) // (self.entries.shape[1] * self.block_size)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, entry_dim: int, indexed_layers: list[int], index_dim: int,
                        dtype: torch.dtype) -> int:
        per_token = num_layers * entry_dim + len(indexed_layers) * index_dim
        return block_size * per_token * torch.empty((), dtype=dtype).element_size()
