"""A random mixed step over a paged cache (one layer of a `KVCache`, in the step's dtype or in FP8), and dense
float64 attention over what it holds: what the Triton kernels (`tests/kernels/test_paged_attention_kernels.py`) and
the torch reference (`tests/inference/test_paged_attention.py`) are checked against."""

from __future__ import annotations

import torch

from tandem.inference.engine.kv_cache import KVCache
from tandem.inference.engine.paged_attention import AttentionMetadata, reference_attention
from tandem.inference.engine.step_inputs import PREFILL_BLOCK_Q


MIXED = [(7, 7), (5, 13), (1, 1), (1, 9), (1, 40), (1, 0)]
"""(tokens this step, context after it): a fresh prefill, a chunk after cached tokens, decodes with
short and long contexts, and a CUDA-graph padding row (context 0, last)."""
DECODES = [(1, 3), (1, 17), (1, 40), (1, 0)]


def mixed_step(device: str, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
               block_size: int = 4, seed: int = 0, shapes: list[tuple[int, int]] = MIXED, fp8: bool = False) -> tuple:
    """(q, k, v, cache, metadata) of a step of sequences of these `shapes`: k and v as the cache holds them (`fp8`:
    their round trip through FP8), already written to their slots of the one-layer `cache`; the other slots random."""
    gen = torch.Generator().manual_seed(seed)
    block_q = 1 if all(q_len == 1 for q_len, _ in shapes) else PREFILL_BLOCK_Q
    blocks_needed = [-(-ctx // block_size) for _, ctx in shapes]
    num_blocks = max(64, sum(blocks_needed))
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, torch.device(device), fp8)
    every_slot = torch.arange((num_blocks + 1) * block_size, device=device)
    cache.write(0, every_slot, *(torch.randn(len(every_slot), kv_heads, head_dim, generator=gen).to(device, dtype)
                                 for _ in range(2)))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(12, *blocks_needed)
    tables = torch.zeros(len(shapes), width, dtype=torch.long)
    slots: list[int] = []
    tiles: list[list[int]] = [[], []]
    for i, (q_len, ctx) in enumerate(shapes):
        need = blocks_needed[i]
        tables[i, :need] = torch.tensor(order[:need], dtype=torch.long)
        order = order[need:]
        if ctx == 0:
            slots.append(num_blocks * block_size)
        else:
            slots.extend(int(tables[i, p // block_size]) * block_size + p % block_size for p in range(ctx - q_len, ctx))
        q_starts = range(0, q_len, block_q)
        tiles[0].extend([i] * len(q_starts))
        tiles[1].extend(q_starts)
    n = sum(q for q, _ in shapes)
    q = torch.randn(n, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, dtype)
    slot_mapping = torch.tensor(slots, device=device)
    k, v = cache.write(0, slot_mapping, k, v)
    query_lens = [q_len for q_len, _ in shapes]
    query_start = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), device=device)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, query_start=query_start, seq_lens=torch.tensor([c for _, c in shapes], device=device),
        block_tables=tables.to(device), tiles=torch.tensor(tiles, device=device), block_q=block_q,
        query_lens_host=query_lens, seq_lens_host=[c for _, c in shapes],
    )
    return q, k, v, cache, meta


def kernel_caches(cache: KVCache) -> dict:
    """The kernels' cache arguments of the cache's one layer, by name."""
    (k_cache, v_cache), (k_scales, v_scales) = cache.layer(0), cache.layer_scales(0)
    return dict(k_cache=k_cache, v_cache=v_cache, k_scales=k_scales, v_scales=v_scales)


def reference(q, k, v, cache, meta) -> torch.Tensor:
    """The torch path's output; the padding row (context 0) is defined as zeros."""
    real = slice(0, q.shape[0] - 1)
    meta_real = AttentionMetadata(meta.slot_mapping[real], meta.query_start[:-1], meta.seq_lens[:-1], meta.block_tables[:-1],
                                  meta.tiles, meta.block_q, meta.query_lens_host[:-1], meta.seq_lens_host[:-1])
    out = reference_attention(q[real], k[real], v[real], cache, 0, meta_real)
    return torch.cat([out, torch.zeros_like(q[-1:])])


def dense_reference(q, cache, meta) -> torch.Tensor:
    """Each query token against its context, one softmax at a time, in float64 (no kernels involved), over the values
    the cache holds (FP8: its numbers times their scales, exactly)."""
    block_size = cache.block_size
    group = q.shape[1] // cache.keys.shape[3]
    (k_cache, v_cache), (k_scales, v_scales) = cache.layer(0), cache.layer_scales(0)
    if k_scales is not None:
        k_cache, v_cache = k_cache.double() * k_scales[..., None], v_cache.double() * v_scales[..., None]
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        slots = [int(meta.block_tables[i, p // block_size]) * block_size + p % block_size for p in range(ctx)]
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double().cpu()
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double().cpu()
        for j in range(q_len):
            pos = ctx - q_len + j
            for h in range(q.shape[1]):
                scores = keys[:pos + 1, h // group] @ q[start + j, h].double().cpu() / q.shape[-1] ** 0.5
                out[start + j, h] = scores.softmax(0) @ values[:pos + 1, h // group]
        start += q_len
    return out


SPLIT_DECODES = [(1, 40), (1, 512), (1, 1300), (1, 513), (1, 0)]
"""Decode contexts around the kernel's chunk of 512 keys (`tandem.kernels.attention.SPLIT_KEYS`): shorter, equal,
several chunks, one key past a chunk, and a CUDA-graph padding row (context 0, last)."""


def check_split_decode(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, tolerance: float,
                       seed: int = 0, fp8: bool = False) -> None:
    """The kernel's split decode of `SPLIT_DECODES` against dense attention (within `tolerance`), and each
    sequence's output bitwise the same alone (its own grid bound), in the batch, and under a CUDA graph's
    bound (what the block tables hold). `fp8`: over an FP8 cache."""
    from tandem.kernels.attention import SPLIT_KEYS, paged_attention

    assert SPLIT_KEYS == 512, "SPLIT_DECODES are chosen around a chunk of 512 keys"
    q, k, v, cache, meta = mixed_step(device, dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                      block_size=16, seed=seed, shapes=SPLIT_DECODES, fp8=fp8)

    def decode(rows: list[int], max_context: int | None) -> torch.Tensor:
        return paged_attention(q[rows], block_tables=meta.block_tables[rows], seq_lens=meta.seq_lens[rows],
                               query_start=torch.arange(len(rows) + 1, device=device), tiles=meta.tiles[:, :len(rows)],
                               block_q=1, max_context=max_context, **kernel_caches(cache))

    rows = list(range(len(SPLIT_DECODES)))
    batch = decode(rows, max(meta.seq_lens_host))
    error = (batch.double().cpu() - dense_reference(q, cache, meta)).abs().max().item()
    assert error < tolerance, f"split decode differs from dense attention by {error}"
    for i, (_, ctx) in enumerate(SPLIT_DECODES):
        assert torch.equal(decode([i], ctx)[0], batch[i]), f"sequence {i} (context {ctx}) differs alone and in the batch"
    assert torch.equal(decode(rows, None), batch), "the block tables' bound changed the outputs"


SHARED_PREFIXES = [(640, [1, 9, 16, 17, 40, 3, 5, 2, 33]), (48, [5, 17]), (16, [600, 2, 70]), (0, [30]), (0, [700]),
                   (32, [4, 4, 4, 4]), (0, [0])]
"""A decode step of RL groups, each (prompt tokens in shared blocks, each member's tokens after them): a group of 9
(one more than a prefix program of heads 2 per KV head holds) over a prefix of two chunks, members' own parts from a
partial block to past a block; a pair; a group whose members' own parts span chunks; sequences that share
nothing; a group of 4; and a CUDA-graph padding row (context 0, last)."""


def shared_prefix_step(device: str, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                       block_size: int = 16, seed: int = 0, groups: list[tuple[int, list[int]]] = SHARED_PREFIXES,
                       fp8: bool = False) -> tuple:
    """(q, cache, metadata, tables) of a decode step of `groups` (as `SHARED_PREFIXES`): the members of a group
    hold the same block ids for its prefix, then blocks of their own; every slot of the one-layer `cache` random
    (`fp8`: an FP8 cache). `tables`: each row's block ids, as the block manager holds them."""
    gen = torch.Generator().manual_seed(seed)
    rows = [(prefix, own) for prefix, members in groups for own in members]
    num_blocks = sum(prefix // block_size for prefix, _ in groups) + sum(-(-own // block_size) for _, own in rows) + 4
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, torch.device(device), fp8)
    every_slot = torch.arange((num_blocks + 1) * block_size, device=device)
    cache.write(0, every_slot, *(torch.randn(len(every_slot), kv_heads, head_dim, generator=gen).to(device, dtype)
                                 for _ in range(2)))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for prefix, members in groups:
        shared = [free.pop() for _ in range(prefix // block_size)]
        tables.extend(shared + [free.pop() for _ in range(-(-own // block_size))] for own in members)
    contexts = [prefix + own for prefix, own in rows]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    q = torch.randn(len(rows), heads, head_dim, generator=gen).to(device, dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(rows), dtype=torch.long, device=device),
        query_start=torch.arange(len(rows) + 1, device=device), seq_lens=torch.tensor(contexts, device=device),
        block_tables=block_tables, tiles=torch.tensor([list(range(len(rows))), [0] * len(rows)], device=device),
        block_q=1, query_lens_host=[1] * len(rows), seq_lens_host=contexts, max_context=max(contexts))
    return q, cache, meta, tables


def with_cascade(meta: AttentionMetadata, tables: list[list[int]], block_size: int, members: int,
                 num_slots: int | None = None) -> AttentionMetadata:
    """`meta` with the cascade plan of its tables (`find_shared_prefixes`), `num_slots` group slots (a CUDA graph's
    bound) or as many as its groups."""
    from dataclasses import replace

    from tandem.inference.engine.cascade import CascadeMetadata, find_shared_prefixes

    plan = find_shared_prefixes(tables, meta.seq_lens_host, block_size, members)
    row_prefix, group_prefix, table = plan.transfer_parts(len(tables), num_slots or len(plan.groups), members)
    device = meta.seq_lens.device
    cascade = CascadeMetadata(torch.tensor(row_prefix, device=device), torch.tensor(group_prefix, device=device),
                              torch.tensor(table, device=device).view(-1, members), plan)
    return replace(meta, cascade=cascade)
