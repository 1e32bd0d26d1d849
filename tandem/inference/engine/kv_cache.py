"""The paged KV cache: one key and one value tensor per layer, indexed by cache slot.

Slot `block_id * block_size + offset` holds one token's keys (or values) for all KV heads. The
cache is zero-filled, so padded reads (batched decode gathers up to the longest context) only
ever see finite numbers, which the attention mask then weighs by exactly zero.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [num_slots, kv_heads, head_dim] of one layer (views, written in place)."""
        return self.keys[layer_idx], self.values[layer_idx]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
