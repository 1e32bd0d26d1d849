"""The paged KV cache: per layer, keys and values [num_blocks, block_size, kv_heads, head_dim].

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

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the keys and values of `block_ids`, [2, num_layers, len(block_ids), block_size, kv_heads,
        head_dim] (keys, then values): what a prefill server hands a decode server."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys.device)
        return torch.stack([self.keys.index_select(1, index), self.values.index_select(1, index)])

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write `blocks` (as `read_blocks` returns them) into `block_ids`; ValueError if their shape is not this
        cache's (a peer serving another model) and nothing is written."""
        expected = (2, self.keys.shape[0], len(block_ids), *self.keys.shape[2:])
        if tuple(blocks.shape) != expected or blocks.dtype != self.keys.dtype:
            raise ValueError(f"KV blocks of shape {tuple(blocks.shape)} and {blocks.dtype}; this cache takes {expected} "
                             f"and {self.keys.dtype}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys.device)
        blocks = blocks.to(self.keys.device)
        self.keys.index_copy_(1, index, blocks[0])
        self.values.index_copy_(1, index, blocks[1])

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
