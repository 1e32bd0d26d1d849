"""The paged KV caches: per layer, keys and values [num_blocks, block_size, kv_heads, head_dim] (`KVCache`), or for
multi-head latent attention one latent entry per token [num_blocks, block_size, kv_lora_rank + rope dims] and the DSA
indexer's key beside it (`LatentCache`).

Token `offset` of block `b` lives at slot `b * block_size + offset` of the flat view that writes
use; reads gather whole blocks (one contiguous copy each, far cheaper than per-token gathers).
The cache is zero-filled, so padded reads (a decode batch gathers as many blocks as its longest
context) only ever see finite numbers, which the attention mask then weighs by exactly zero.
One block more than the block manager hands out holds the writes of padding tokens (CUDA-graph
batches are padded up to a captured size): `pad_slot` is its first slot.

FP8 (`engine.kv_cache_dtype = "fp8"`): keys and values in float8_e4m3fn, each token's head scaled on its own,
with one fp32 scale per (layer, slot, KV head) beside the cache ([num_blocks, block_size, kv_heads] per layer;
a value is its FP8 number times its scale). Why per token and head, computed when the token is written: a slot
is written once and read until its sequence ends, so its scale can be fitted to exactly what it holds (its head's
largest magnitude maps to 448), and stays right however the weights move in RL; a static scale calibrated once
goes stale as training changes the activations' size, and a scale per block or per layer would have to cover
tokens written later, by other steps (or rescale those written before). Heads get their own because their
sizes differ by orders of magnitude (keys' outlier heads). The scales cost 4 bytes per head and token beside
the head's `head_dim` bytes: at head_dim 128 a token takes 264 bytes per KV head and layer for K and V, against
512 in bf16, so 1.94x the tokens fit in the same memory.
"""

from __future__ import annotations

import torch

from tandem.inference.engine.host_copies import to_device
from tandem.kernels.fp8 import FP8, reference_quantize_activations

SCALE_DTYPE = torch.float32


class KVCache:
    exported_block_dim = 2
    """The dimension of `export_blocks`'s tensor that runs over blocks (a decode engine drops the leading blocks
    its prefix cache already holds along it)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fp8: bool = False):
        """`dtype`: the model's (what attention computes in); `fp8`: keys and values stored in FP8 with scales."""
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=FP8 if fp8 else dtype, device=device)
        self.values = torch.zeros(shape, dtype=FP8 if fp8 else dtype, device=device)
        self.key_scales = self.value_scales = None
        """FP8: [layers, num_blocks + 1, block_size, kv_heads] fp32, the scale of each slot's head; else None."""
        if fp8:
            self.key_scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
            self.value_scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
        self.dtype = dtype
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size
        """A slot no sequence owns: padding tokens write their keys and values here."""

    @property
    def fp8(self) -> bool:
        return self.key_scales is not None

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [num_blocks, block_size, kv_heads, head_dim] of one layer (views, written in place)."""
        return self.keys[layer_idx], self.values[layer_idx]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """FP8: the scales of keys and values [num_blocks, block_size, kv_heads] of one layer (views); else Nones."""
        if not self.fp8:
            return None, None
        return self.key_scales[layer_idx], self.value_scales[layer_idx]

    def write(self, layer_idx: int, slots: torch.Tensor, k_NHD: torch.Tensor,
              v_NHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys and values [N, kv_heads, head_dim] of N tokens in their `slots` (FP8: quantized); returns
        what the cache now holds for them, in the model's dtype (FP8: dequantized)."""
        held = []
        for cache, scales, x in zip(self.layer(layer_idx), self.layer_scales(layer_idx), (k_NHD, v_NHD)):
            flat = cache.view(-1, *cache.shape[2:])
            if scales is None:
                flat.index_copy_(0, slots, x)
                held.append(x)
                continue
            x_fp8, x_scales = quantize_heads(x)
            flat.view(torch.uint8).index_copy_(0, slots, x_fp8.view(torch.uint8))  # torch copies no FP8 by index
            scales.view(-1, scales.shape[-1]).index_copy_(0, slots, x_scales)
            held.append(dequantize(x_fp8, x_scales, x.dtype))
        return held[0], held[1]

    def read_blocks(self, layer_idx: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the cache's `blocks` [n] of one layer, [n, block_size, kv_heads, head_dim] in the model's
        dtype (FP8: dequantized): what the torch path attends over."""
        out = []
        for cache, scales in zip(self.layer(layer_idx), self.layer_scales(layer_idx)):
            if scales is None:
                out.append(cache.index_select(0, blocks))
                continue
            x = cache.view(torch.uint8).index_select(0, blocks).view(FP8)  # torch gathers no FP8 by index
            out.append(dequantize(x, scales.index_select(0, blocks), self.dtype))
        return out[0], out[1]

    @property
    def layout(self) -> str:
        """What a block holds, besides its token count: two caches whose blocks can move between them say the same."""
        layers, _, _, num_kv_heads, head_dim = self.keys.shape
        numbers = "FP8 with fp32 scales" if self.fp8 else str(self.dtype).removeprefix("torch.")
        return f"keys and values of {num_kv_heads} KV heads x {head_dim} in each of {layers} layers, {numbers}"

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token over all layers, scales included."""
        layers, _, block_size, num_kv_heads, head_dim = self.keys.shape
        return self.bytes_per_block(layers, block_size, num_kv_heads, head_dim, self.dtype, self.fp8) // block_size

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the keys and values of `block_ids`, [2, num_layers, len(block_ids), block_size, kv_heads,
        head_dim] (keys, then values): what a prefill server hands a decode server. FP8: bytes, each head's
        `head_dim` FP8 values followed by the four bytes of its fp32 scale ([..., head_dim + 4] uint8), so the blocks
        travel as they are held, neither rounded again nor widened."""
        index = to_device(block_ids, torch.long, self.keys.device)  # no wait for the steps queued on the device
        if not self.fp8:  # gathered straight into the tensor handed over: one pass over the bytes
            out = self.keys.new_empty((2, self.keys.shape[0], len(block_ids), *self.keys.shape[2:]))
            for i, cache in enumerate((self.keys, self.values)):
                torch.index_select(cache, 1, index, out=out[i])
            return out
        parts = []
        for cache, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            held = cache.view(torch.uint8).index_select(1, index)  # torch gathers no FP8 by index
            parts.append(torch.cat([held, scales.index_select(1, index).unsqueeze(-1).view(torch.uint8)], dim=-1))
        return torch.stack(parts)

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write `blocks` (as `export_blocks` returns them) into `block_ids`; ValueError if their shape or dtype is
        not this cache's (a peer serving another model, or another `kv_cache_dtype`) and nothing is written."""
        head_dim = self.keys.shape[-1]
        width, dtype = (head_dim + SCALE_DTYPE.itemsize, torch.uint8) if self.fp8 else (head_dim, self.keys.dtype)
        expected = (2, self.keys.shape[0], len(block_ids), *self.keys.shape[2:-1], width)
        if tuple(blocks.shape) != expected or blocks.dtype != dtype:
            raise ValueError(f"KV blocks of shape {tuple(blocks.shape)} and {blocks.dtype}; this cache takes {expected} "
                             f"and {dtype}")
        index = to_device(block_ids, torch.long, self.keys.device)  # no wait for the steps queued on the device
        blocks = blocks.to(self.keys.device)
        for part, cache, scales in zip(blocks, (self.keys, self.values), (self.key_scales, self.value_scales)):
            if scales is None:
                cache.index_copy_(1, index, part)
                continue
            cache.view(torch.uint8).index_copy_(1, index, part[..., :head_dim].contiguous())
            scales.index_copy_(1, index, part[..., head_dim:].contiguous().view(SCALE_DTYPE).squeeze(-1))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        fp8: bool = False) -> int:
        """Bytes of one block's keys and values over all layers: what the memory plan divides its budget by."""
        per_head = head_dim * (FP8.itemsize if fp8 else dtype.itemsize) + (SCALE_DTYPE.itemsize if fp8 else 0)
        return 2 * num_layers * block_size * num_kv_heads * per_head


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, heads, D] -> (FP8 [N, heads, D], fp32 scales [N, heads]): each token's head scaled so that its largest
    magnitude is 448 (`tandem.kernels.fp8`'s activation scheme with a group of one head), rounded to nearest. The
    cache-writing kernel (`tandem.kernels.pointwise.qk_norm_rope_write`) computes the same numbers."""
    N, heads, D = x.shape
    x_fp8, scales = reference_quantize_activations(x.reshape(N * heads, D), group=D)
    return x_fp8.view(N, heads, D), scales.view(N, heads)


def dequantize(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 values [..., D] times their scales [...], rounded once to `dtype`."""
    return (x_fp8.float() * scales[..., None]).to(dtype)


class LatentCache:
    """Multi-head latent attention's cache (`tandem.models.mla`): per layer one entry [c | RoPE(k_rope)] of
    `entry_dim` (kv_lora_rank + Dr) numbers per token for every head together, where `KVCache` would hold
    2 x heads x head_dim; and per layer with a DSA indexer (`indexed_layers`), the indexer's key of `index_dim`
    numbers per token, in the same blocks (a block holds the same tokens in every tensor). Same slots, zero fill
    and pad block as `KVCache`.

    FP8 (`engine.kv_cache_dtype = "fp8"`): `entries` holds each entry's latent part c in float8_e4m3fn with one
    fp32 scale per token and layer (`entry_scales`), and `ropes` its last `rope_dim` numbers (RoPE(k_rope)) apart, in
    the model's dtype; the indexer's keys are FP8 with one fp32 scale per token (`index_key_scales`). Scales are
    fitted when the token is written, as `KVCache`'s are (its docstring says why). One scale covers all of c because
    c leaves the kv_a RMS norm, so its features share one size; a single scale is then applied once to the score
    q_c . c and once to the softmax weight, where group scales would split each product into pieces. The RoPE part
    stays unquantized: it carries the token's position (rotation angles that grow with it), so that rounding it to
    3 mantissa bits would blur the positional part of every score, and at 64 of the 576 numbers it is a small share of
    the bytes. A DSA indexer key (LayerNorm, then RoPE on part of it) is one head of `index_dim` numbers: one scale
    per token, as a `KVCache` head; the indexer's top-k then ranks over rounded keys, so that near-ties may choose
    otherwise (bounded in `tests/inference/test_fp8_kv_cache.py`), kept because at long contexts every token's key
    is read at every DSA decode step, most of what the step reads. At GLM-5's shape a token takes 644 bytes per
    layer against 1,152 in bf16 (776 against 1,408 in an indexed layer): about 1.8x the tokens fit."""

    exported_block_dim = 0
    """As `KVCache.exported_block_dim`."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, entry_dim: int, indexed_layers: list[int],
                 index_dim: int, dtype: torch.dtype, device: torch.device, fp8: bool = False, rope_dim: int = 0):
        """`dtype`: the model's; `fp8`: held in FP8 as the class docstring says, the entries' last `rope_dim`
        numbers (the RoPE part) in `dtype`."""
        held = FP8 if fp8 else dtype
        shape = (num_blocks + 1, block_size)
        self.entries = torch.zeros(num_layers, *shape, entry_dim - rope_dim if fp8 else entry_dim, dtype=held,
                                   device=device)
        """[layers, num_blocks + 1, block_size, entry_dim] (FP8: the latent part alone, entry_dim - rope_dim)."""
        self.index_keys = torch.zeros(len(indexed_layers), *shape, index_dim, dtype=held, device=device)
        self.entry_scales = self.ropes = self.index_key_scales = None
        """FP8: [layers, num_blocks + 1, block_size] fp32, [layers, num_blocks + 1, block_size, rope_dim] in `dtype`,
        [indexed layers, num_blocks + 1, block_size] fp32; else None."""
        if fp8:
            self.entry_scales = torch.zeros(num_layers, *shape, dtype=SCALE_DTYPE, device=device)
            self.ropes = torch.zeros(num_layers, *shape, rope_dim, dtype=dtype, device=device)
            self.index_key_scales = torch.zeros(len(indexed_layers), *shape, dtype=SCALE_DTYPE, device=device)
        self._index_row = {layer: row for row, layer in enumerate(indexed_layers)}
        self.dtype = dtype
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size

    @property
    def fp8(self) -> bool:
        return self.entry_scales is not None

    @property
    def indexed_layers(self) -> list[int]:
        """The layers with a DSA indexer, whose keys this cache holds."""
        return list(self._index_row)

    @property
    def entry_dim(self) -> int:
        """Numbers of one entry as attention reads it (latent part and RoPE part)."""
        return self.entries.shape[-1] + (self.ropes.shape[-1] if self.fp8 else 0)

    def layer(self, layer_idx: int) -> torch.Tensor:
        """Entries [num_blocks, block_size, entry_dim] of one layer as held (a view, written in place); FP8: their
        latent parts [num_blocks, block_size, kv_lora_rank]."""
        return self.entries[layer_idx]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """FP8: the scales of one layer's entries [num_blocks, block_size] and its entries' RoPE parts [num_blocks,
        block_size, rope_dim] (views); else Nones."""
        if not self.fp8:
            return None, None
        return self.entry_scales[layer_idx], self.ropes[layer_idx]

    def layer_index_keys(self, layer_idx: int) -> torch.Tensor:
        """The indexer's keys [num_blocks, block_size, index_dim] of a layer that has an indexer, as held (a view)."""
        return self.index_keys[self._index_row[layer_idx]]

    def layer_index_key_scales(self, layer_idx: int) -> torch.Tensor | None:
        """FP8: the scales [num_blocks, block_size] of a layer's indexer keys (a view); else None."""
        return self.index_key_scales[self._index_row[layer_idx]] if self.fp8 else None

    def write(self, layer_idx: int, slots: torch.Tensor, entries_NE: torch.Tensor) -> None:
        """Store the entries [N, entry_dim] of N tokens in their `slots` (FP8: the latent part quantized)."""
        scales, ropes = self.layer_scales(layer_idx)
        latent_dim = self.entries.shape[-1]
        _store(self.layer(layer_idx), scales, slots, entries_NE[:, :latent_dim])
        if ropes is not None:
            ropes.view(-1, ropes.shape[-1]).index_copy_(0, slots, entries_NE[:, latent_dim:])

    def write_index_keys(self, layer_idx: int, slots: torch.Tensor, keys_ND: torch.Tensor) -> None:
        """Store the indexer keys [N, index_dim] of N tokens in their `slots` (FP8: quantized)."""
        _store(self.layer_index_keys(layer_idx), self.layer_index_key_scales(layer_idx), slots, keys_ND)

    def read_entries(self, layer_idx: int, where: torch.Tensor, per_slot: bool = False) -> torch.Tensor:
        """The entries of blocks `where` (any shape) [..., block_size, entry_dim], or with `per_slot` of slots `where`
        [..., entry_dim], in the model's dtype (FP8: the latent part dequantized): what the torch path attends over."""
        scales, ropes = self.layer_scales(layer_idx)
        latent = _gather(self.layer(layer_idx), scales, where, per_slot, self.dtype)
        if ropes is None:
            return latent
        return torch.cat([latent, _gather(ropes, None, where, per_slot, self.dtype)], dim=-1)

    def read_index_keys(self, layer_idx: int, blocks: torch.Tensor) -> torch.Tensor:
        """The indexer keys of `blocks` (any shape) [..., block_size, index_dim] in the model's dtype (FP8:
        dequantized)."""
        return _gather(self.layer_index_keys(layer_idx), self.layer_index_key_scales(layer_idx), blocks, False,
                       self.dtype)

    @property
    def layout(self) -> str:
        """As `KVCache.layout`."""
        layers, _, _, _ = self.entries.shape
        if self.fp8:
            numbers = (f"FP8 latent parts and indexer keys with an fp32 scale per token, RoPE parts of "
                       f"{self.ropes.shape[-1]} in {str(self.dtype).removeprefix('torch.')}")
        else:
            numbers = str(self.dtype).removeprefix("torch.")
        return (f"latent entries of {self.entry_dim} in each of {layers} layers, DSA indexer keys of "
                f"{self.index_keys.shape[-1]} in layers {self.indexed_layers}, {numbers}")

    def _parts(self) -> list[torch.Tensor]:
        """The tensors a token is held in, [layers, num_blocks + 1, block_size, numbers], in the order
        `export_blocks` lays them out; under FP8 as bytes (uint8 views, a scale its four bytes)."""
        if not self.fp8:
            return [self.entries, self.index_keys]
        return [self.entries.view(torch.uint8), self.entry_scales.unsqueeze(-1).view(torch.uint8),
                self.ropes.view(torch.uint8), self.index_keys.view(torch.uint8),
                self.index_key_scales.unsqueeze(-1).view(torch.uint8)]

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of everything `block_ids` hold, [len(block_ids), block_size, layers x entry_dim + indexed layers x
        index_dim]: each token's latent entries, layer after layer, then its indexer keys, so that one tensor of one
        dtype crosses between servers as `KVCache`'s does (the transports need no other case). FP8: bytes (uint8), the
        layers' latent parts, their scales' four bytes each, their RoPE parts, then the indexer keys and their
        scales: the blocks travel as held, neither rounded again nor widened."""
        index = to_device(block_ids, torch.long, self.entries.device)
        return torch.cat([part.index_select(1, index).permute(1, 2, 0, 3).flatten(2) for part in self._parts()], dim=-1)

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write `blocks` (as `export_blocks` returns them) into `block_ids`; ValueError if their shape or dtype is
        not this cache's (a peer serving another model, or another `kv_cache_dtype`) and nothing is written."""
        parts = self._parts()
        widths = [part.shape[0] * part.shape[-1] for part in parts]
        expected = (len(block_ids), self.block_size, sum(widths))
        if tuple(blocks.shape) != expected or blocks.dtype != parts[0].dtype:
            raise ValueError(f"latent blocks of shape {tuple(blocks.shape)} and {blocks.dtype}; this cache takes "
                             f"{expected} and {parts[0].dtype}")
        index = to_device(block_ids, torch.long, self.entries.device)
        for part, landed in zip(parts, blocks.to(self.entries.device).split(widths, dim=-1)):
            part.index_copy_(1, index, landed.unflatten(-1, (part.shape[0], part.shape[-1])).permute(2, 0, 1, 3))

    @property
    def bytes_per_token(self) -> int:
        """Entries and indexer keys of one token over all layers, scales included: what a decode reads per token of
        its context without DSA. Under DSA past `index_topk` tokens a decode reads every token's indexer keys but
        only its chosen tokens' entries, so this overstates its reads there."""
        return sum(part.nbytes for part in self._parts()) // (self.entries.shape[1] * self.block_size)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, entry_dim: int, indexed_layers: list[int], index_dim: int,
                        dtype: torch.dtype, fp8: bool = False, rope_dim: int = 0) -> int:
        """Bytes of one block's entries and indexer keys over all layers, scales included: what the memory plan
        divides its budget by."""
        if not fp8:
            return block_size * (num_layers * entry_dim + len(indexed_layers) * index_dim) * dtype.itemsize
        entry = (entry_dim - rope_dim) * FP8.itemsize + SCALE_DTYPE.itemsize + rope_dim * dtype.itemsize
        key = index_dim * FP8.itemsize + SCALE_DTYPE.itemsize
        return block_size * (num_layers * entry + len(indexed_layers) * key)


def _store(held: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Rows x [N, D] into a layer's tensor [blocks, S, D] at their slots; with `scales` ([blocks, S]) quantized,
    one scale a row (`quantize_heads` with a head a token)."""
    flat = held.view(-1, held.shape[-1])
    if scales is None:
        flat.index_copy_(0, slots, x)
        return
    x_fp8, x_scales = quantize_heads(x[:, None])
    flat.view(torch.uint8).index_copy_(0, slots, x_fp8[:, 0].view(torch.uint8))  # torch copies no FP8 by index
    scales.view(-1).index_copy_(0, slots, x_scales[:, 0])


def _gather(held: torch.Tensor, scales: torch.Tensor | None, where: torch.Tensor, per_slot: bool,
            dtype: torch.dtype) -> torch.Tensor:
    """Rows of a layer's tensor [blocks, S, D] in `dtype`: of blocks `where` [..., S, D], or with `per_slot` of
    slots `where` [..., D]; with `scales` ([blocks, S]) dequantized."""
    if per_slot:
        held = held.flatten(0, 1)
        scales = scales.flatten() if scales is not None else None
    if scales is None:
        return held[where]
    return dequantize(held.view(torch.uint8)[where].view(FP8), scales[where], dtype)  # torch gathers no FP8 by index
