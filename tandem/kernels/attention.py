"""Paged attention as Triton kernels: each query token of a step (a prefill chunk's or a decode's)
attends to its sequence's keys and values read in place from the paged KV cache.

Why kernels of our own: gathering a decode batch's blocks into a padded copy (the torch reference
in `paged_attention.py`) moves every cached byte three times per layer; these read it once. Work
items are *tiles*: `block_q` consecutive query tokens of one sequence times the query heads of
one KV head (GQA: they share every key load).

Decode steps (tiles of one token) split each tile's context into chunks of `SPLIT_KEYS` keys, one
program each, so that a few long sequences still fill the GPU (64 sequences x 8 KV heads are 512
programs for 132 SMs; at 8k context each would walk 8k keys alone). A sequence whose context fits
one chunk is finished by its one program; longer ones leave each chunk's running max, sum and
unnormalised output in a workspace, and a second small kernel combines the chunks in order.
Batch invariance (exact mode relies on it): the chunk size is a constant, never derived from the
batch, and a sequence's chunks and their combination depend only on its own context, so a token's
output is bitwise the same whatever else is in the batch and whatever the grid's bound. The grid
(sequences, KV heads, chunks of the longest context allowed) is fixed for a CUDA graph; programs
past their sequence's context do nothing.

FP8 caches (`tandem.inference.engine.kv_cache`: float8_e4m3fn keys and values, an fp32 scale per slot and KV
head) go through the same kernels: a key block is widened to q's dtype in registers (exact: e4m3 values are bf16
values) and its scales multiply the columns of q k^T; a value block's scales multiply the columns of p before p v.
So a step reads one byte per cached element instead of two, and the scaling costs a few products per key, not
per element.

Layouts: q and out [N, H, D] (the step's tokens, flattened), caches [blocks, S, Hkv, D] (FP8: with scales
[blocks, S, Hkv], heads contiguous), block_tables [rows, M], seq_lens [B] (context after the step), query_start [B + 1] (offsets of
each sequence's tokens in N), tiles [2, T] (sequence, first query offset). A row with
seq_len 0 (CUDA-graph padding) attends to nothing and outputs zeros. Query token j of a
sequence with q_len tokens and context c sits at position c - q_len + j and sees keys <= it.

Reference: `tandem.inference.engine.paged_attention.reference_attention` (the torch path); both equal dense attention.
Tests: `tests/kernels/test_paged_attention_kernels.py`; exact mode's `attend_each_token`: `tests/kernels/test_batch_invariant.py`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `paged_attention.py` falls back to its torch reference
    triton = None

SPLIT_KEYS = 512
"""Keys per chunk of a decode's context (a multiple of the decode launch's BLOCK_N). A constant: a
batch-dependent split would make a token's output depend on its batch (see the module docstring)."""


def is_available(q: torch.Tensor) -> bool:
    """Whether the kernel can serve this query tensor (see `serves`)."""
    return serves(q.shape[-1], q.device)


def serves(head_dim: int, device: torch.device) -> bool:
    """Whether the kernel can serve heads of `head_dim` on `device` (CUDA, Triton installed, `supports_head_dim`)."""
    return triton is not None and device.type == "cuda" and supports_head_dim(head_dim)


def supports_head_dim(head_dim: int) -> bool:
    """The kernels' head dims: powers of 2, at least 16 (`tl.dot`'s smallest)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _attend_keys(q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq, kv_head, lo, hi,
                     qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs,
                     stride_bt, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     IEEE: tl.constexpr, SCALED: tl.constexpr):
        """Online softmax of q [ROWS, D] over keys lo..hi-1 (causal at q_pos): running max (log2 units), sum, output.
        SCALED: FP8 caches, each key's and value's scale at `block * stride_zb + offset * stride_zs + kv_head`."""
        d = tl.arange(0, HEAD_DIM)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            k = tl.load(k_cache_ptr + block[:, None] * stride_kb + (n % PAGE)[:, None] * stride_ks + kv_head * stride_kh
                        + d[None, :], mask=n_ok[:, None], other=0.0)
            scale_at = block * stride_zb + (n % PAGE) * stride_zs + kv_head  # SCALED: this key's scale
            if SCALED:
                k = k.to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if SCALED:
                s = s * tl.load(k_scale_ptr + scale_at, mask=n_ok, other=0.0)[None, :]
            s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + block[:, None] * stride_vb + (n % PAGE)[:, None] * stride_vs + kv_head * stride_vh
                        + d[None, :], mask=n_ok[:, None], other=0.0)
            if SCALED:  # p's columns carry the values' scales; the sum and max stay p's own
                v = v.to(q.dtype)
                p = p * tl.load(v_scale_ptr + scale_at, mask=n_ok, other=0.0)[None, :]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        return m, l, acc

    # Triton compiles a variant per value class of each int argument (1, multiple of 16, other); the tile
    # count changes every step, and a new variant mid-run is a half-second stall.
    @triton.jit(do_not_specialize=["num_tiles"])
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_ptr, tiles_ptr, num_tiles, scale, stride_qn, stride_qh, stride_on, stride_oh, stride_kb, stride_ks,
        stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs, stride_bt,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tiles_ptr + tile)
        q0 = tl.load(tiles_ptr + num_tiles + tile)
        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        ctx = tl.load(seq_lens_ptr + seq)

        rows = tl.arange(0, ROWS)  # row = (query token of the tile, query head of the group)
        tok = rows // GROUP_P
        g = rows % GROUP_P
        row_ok = (tok < BLOCK_Q) & (g < GROUP) & (q0 + tok < q_len)
        head = kv_head * GROUP + g
        q_pos = ctx - q_len + q0 + tok
        d = tl.arange(0, HEAD_DIM)
        token = (q_begin + q0 + tok).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        end = tl.minimum(ctx, ctx - q_len + q0 + BLOCK_Q)  # the tile's last query sees no further
        m, l, acc = _attend_keys(q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq,
                                 kv_head, 0, end, scale * 1.4426950408889634,  # exp2 instead of exp
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs,
                                 stride_bt, ROWS, BLOCK_N, PAGE, HEAD_DIM, IEEE, SCALED)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + token[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    # The workspace strides follow the chunk count of the grid's bound (1, a multiple of 16, other), the tile
    # count every step: not specialised, so an eager step with a new bound compiles nothing mid-run.
    @triton.jit(do_not_specialize=["stride_sb", "stride_sh", "num_tiles"])
    def _split_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_out_ptr, part_stats_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr, tiles_ptr, num_tiles, scale, stride_qn, stride_qh, stride_on,
        stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs, stride_bt,
        stride_pb, stride_ph, stride_ps, stride_sm, stride_sb, stride_sh, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
    ):
        """Chunk `program_id(2)` of the queries of tile `program_id(0)` by the heads of KV head `program_id(1)`.
        BLOCK_Q = 1 (decode): the tile is sequence `program_id(0)`'s one query token; else `tiles` names its
        sequence and first query, and its BLOCK_Q tokens each see their own keys (causal) within the chunk."""
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if BLOCK_Q == 1:
            seq = tl.program_id(0)
            q0 = 0
            q_len = 1
            q_begin = tl.load(query_start_ptr + seq)
        else:
            seq = tl.load(tiles_ptr + tl.program_id(0))
            q0 = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
            q_begin = tl.load(query_start_ptr + seq)
            q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        ctx = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, ROWS)  # row = (query token of the tile, query head of the group)
        tok = rows // GROUP_P
        g = rows % GROUP_P
        row_ok = (tok < BLOCK_Q) & (g < GROUP) & (q0 + tok < q_len)
        head = kv_head * GROUP + g
        q_pos = ctx - q_len + q0 + tok  # a row sees keys 0..q_pos; its context is q_pos + 1
        lo = split * SPLIT
        hi = tl.minimum(tl.minimum(ctx, ctx - q_len + q0 + BLOCK_Q), lo + SPLIT)  # the tile's last query's keys
        d = tl.arange(0, HEAD_DIM)
        token = (q_begin + q0 + tok).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & (lo < hi), other=0.0)
        m, l, acc = _attend_keys(q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq,
                                 kv_head, lo, hi, scale * 1.4426950408889634,  # exp2 instead of exp
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs,
                                 stride_bt, ROWS, BLOCK_N, PAGE, HEAD_DIM, IEEE, SCALED)
        # A context of one chunk (or none: a padding row's zeros) is finished here; a longer one leaves its chunk.
        whole = row_ok & (q_pos < SPLIT) & (split == 0)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + token[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=whole[:, None])
        if BLOCK_Q == 1:  # the workspace's rows: sequences (decode), else tokens
            slot = seq.to(tl.int64) + tl.zeros([ROWS], tl.int64)
        else:
            slot = token
        keep = row_ok & (q_pos >= SPLIT) & (lo <= q_pos)
        part = slot * stride_pb + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + d[None, :], acc, mask=keep[:, None])
        stat = slot * stride_sb + head * stride_sh + split
        tl.store(part_stats_ptr + stat, m, mask=keep)
        tl.store(part_stats_ptr + stride_sm + stat, l, mask=keep)

    @triton.jit
    def _workspace_rows(seq, kv_head, stride_pb, stride_ph, stride_sb, stride_sh,
                        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Where the chunk results of sequence `seq`'s heads of KV head `kv_head` lie in the workspace: (real head
        rows of the padded group, the heads, the features, the outputs' and the statistics' offsets)."""
        g = tl.arange(0, GROUP_P)
        row_ok = g < GROUP
        head = kv_head * GROUP + g
        d = tl.arange(0, HEAD_DIM)
        part = seq.to(tl.int64) * stride_pb + head * stride_ph
        stat = seq.to(tl.int64) * stride_sb + head * stride_sh
        return row_ok, head, d, part, stat

    @triton.jit
    def _fold_chunks(m, l, acc, part_out_ptr, part_stats_ptr, part, stat, first, count, row_ok, d, stride_ps,
                     stride_sm):
        """Chunks first..first+count-1 of one sequence's workspace folded, in that order, into the running (max,
        sum, output); an empty chunk (its max -inf) adds nothing."""
        for split in range(first, first + count):
            m_s = tl.load(part_stats_ptr + stat + split, mask=row_ok, other=float("-inf"))
            l_s = tl.load(part_stats_ptr + stride_sm + stat + split, mask=row_ok, other=0.0)
            acc_s = tl.load(part_out_ptr + (part + split * stride_ps)[:, None] + d[None, :], mask=row_ok[:, None],
                            other=0.0)
            m_new = tl.maximum(m, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            beta = tl.exp2(m_s - m_safe)
            l = l * alpha + l_s * beta
            acc = acc * alpha[:, None] + acc_s * beta[:, None]
            m = m_new
        return m, l, acc

    @triton.jit(do_not_specialize=["stride_sb", "stride_sh"])
    def _combine_splits_kernel(
        out_ptr, part_out_ptr, part_stats_ptr, seq_lens_ptr, query_start_ptr, stride_on, stride_oh,
        stride_pb, stride_ph, stride_ps, stride_sm, stride_sb, stride_sh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        """The chunks of one sequence's decode, combined one after another in chunk order (a fixed order:
        the result depends only on the sequence's context)."""
        seq = tl.program_id(0)
        num_splits = tl.cdiv(tl.load(seq_lens_ptr + seq), SPLIT)
        row_ok, head, d, part, stat = _workspace_rows(seq, tl.program_id(1), stride_pb, stride_ph, stride_sb,
                                                      stride_sh, GROUP, GROUP_P, HEAD_DIM)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
        # A sequence of one chunk was finished by its chunk's program: nothing to combine.
        m, l, acc = _fold_chunks(m, l, acc, part_out_ptr, part_stats_ptr, part, stat, 0,
                                 tl.where(num_splits > 1, num_splits, 0), row_ok, d, stride_ps, stride_sm)
        token = tl.load(query_start_ptr + seq).to(tl.int64)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + token * stride_on + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (num_splits > 1))


_PREFILL_LAUNCH = dict(BLOCK_N=64, num_warps=4, num_stages=2)
_DECODE_LAUNCH = dict(BLOCK_N=32, num_warps=1, num_stages=2)
"""Decode tiles hold one token: one warp per program over 32-key blocks reads the cache faster at decode shapes
than the prefill setting; each chunk program keeps it (`benchmarks/decode_attention.py` times other settings)."""


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _cache_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> tuple:
    """The kernels' scale arguments: (key scales, value scales, block stride, slot stride). A cache in the model's
    dtype has none: the cache stands in for the pointers (never read) and the strides are 0."""
    if k_scales is None:
        return k_cache, k_cache, 0, 0
    assert v_scales is not None and k_scales.stride() == v_scales.stride() and k_scales.stride(2) == 1, \
        "keys' and values' scales share one layout, heads contiguous"
    return k_scales, v_scales, k_scales.stride(0), k_scales.stride(1)


def decode_splits(max_context: int) -> int:
    """Chunks of `SPLIT_KEYS` keys in a context of `max_context` tokens: the decode grid's third axis."""
    return max(1, -(-max_context // SPLIT_KEYS))


def decode_context_bounds(max_model_len: int) -> list[int]:
    """Context bounds for the decode grids of CUDA graphs, ascending, the last `max_model_len`: one chunk, then
    x4 steps (2k, 8k, 32k, ...), each kept where the next is at least twice it (a graph per bound and batch
    size: a few bounds keep idle chunk programs few without many captures)."""
    bounds = [max_model_len]
    step = SPLIT_KEYS
    candidates = []
    while step < max_model_len:
        candidates.append(step)
        step *= 4
    for bound in reversed(candidates):
        if 2 * bound <= bounds[0] or bound == SPLIT_KEYS:
            bounds.insert(0, bound)
    return bounds


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, tiles: torch.Tensor, block_q: int,
                    max_context: int | None = None, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [N, H, D] of q [N, H, D] over the paged cache (see the module docstring).

    `max_context`: a bound on every sequence's context this step (decode steps size their grid by it);
    None: what the block tables can hold. `k_scales`, `v_scales`: an FP8 cache's scales [blocks, S, Hkv].
    """
    out = torch.empty_like(q)
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return out
    if max_context is None:
        max_context = block_tables.shape[1] * k_cache.shape[1]
    if block_q == 1:
        _split_decode(q, k_cache, v_cache, out, block_tables, seq_lens, query_start, decode_splits(max_context),
                      k_scales=k_scales, v_scales=v_scales)
        return out
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = next_pow2(group)
    tiles = tiles.contiguous()
    scales = _cache_scales(k_cache, k_scales, v_scales)
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, *scales[:2], out, block_tables, seq_lens, query_start, tiles, num_tiles, head_dim ** -0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *scales[2:], block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, ROWS=max(16, block_q * group_p), PAGE=k_cache.shape[1],
        HEAD_DIM=head_dim, IEEE=q.dtype == torch.float32, SCALED=k_scales is not None, **_PREFILL_LAUNCH,
    )
    return out


def exact_tile_tokens(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per program of exact mode's attention: as many as fill the 16 rows a decode program of one
    token has (its heads of one KV head, padded to 16 for `tl.dot`), so that every exact program has a decode's shape."""
    return max(1, 16 // next_pow2(num_heads // num_kv_heads))


def query_tiles(query_lens: list[int], tile_tokens: int) -> list[list[int]]:
    """The kernels' work items, [sequences, first query tokens]: one for each `tile_tokens` consecutive query
    tokens of each sequence of `query_lens`."""
    starts = [range(0, n, tile_tokens) for n in query_lens]
    return [[b for b, s in enumerate(starts) for _ in s], [j for s in starts for j in s]]


def exact_tiles(query_lens: list[int], tile_tokens: int, device: torch.device) -> torch.Tensor:
    """`attend_each_token`'s work items [2, T] (`query_tiles`) on `device`."""
    return torch.tensor(query_tiles(query_lens, tile_tokens), dtype=torch.int32).view(2, -1).to(device)


def attend_each_token(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start: torch.Tensor, tiles: torch.Tensor, token_contexts: torch.Tensor,
                      max_context: int) -> torch.Tensor:
    """Exact mode's attention (`tandem.models.exact`): every token of q [N, H, D] over its own context as a decode
    query of its own would see it, [N, H, D]. Sequences as `paged_attention`'s (block_tables [B, >= M], seq_lens [B],
    query_start [B + 1]); `tiles` [2, T] from `exact_tiles` (`exact_tile_tokens` tokens each); token_contexts [N]:
    each token's position + 1, by which its chunks are combined.

    A row of a program (a token and a query head) is computed by the same instructions whatever the other rows
    hold: the same chunks of `SPLIT_KEYS` keys, keys past its own position weighing exactly nothing (its running
    max, sum and output pass through them unchanged), its chunks combined in order. So prefill or decode, in any
    batch, a token gets the same outputs: the engine's steps and the trainer's packed rows agree bit for bit."""
    out = torch.empty_like(q)
    if q.shape[0]:
        tokens = exact_tile_tokens(q.shape[1], k_cache.shape[2])
        _split_decode(q.contiguous(), k_cache, v_cache, out, block_tables, seq_lens, query_start, decode_splits(max_context),
                      tiles=tiles, block_q=tokens, token_contexts=token_contexts)
    return out


def _split_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor, num_splits: int,
                  split_keys: int = SPLIT_KEYS, launch: dict = _DECODE_LAUNCH, tiles: torch.Tensor | None = None,
                  block_q: int = 1, token_contexts: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> None:
    """One token per sequence (its row of `query_start`), `num_splits` chunk programs per (sequence, KV head); or,
    with `tiles` (exact mode), `block_q` tokens of one sequence per program, and `token_contexts` [N] to combine
    each token's chunks.

    The workspace is allocated per call: under CUDA-graph capture it comes from the graph's pool, so
    replays reuse the very same memory. `split_keys` and `launch` are the engine's constants; the sweep
    of `benchmarks/decode_attention.py` tries others.
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = next_pow2(group)
    num_rows = seq_lens.shape[0] if tiles is None else q.shape[0]  # the workspace's: sequences, or tokens
    num_programs = seq_lens.shape[0] if tiles is None else tiles.shape[1]
    if num_programs == 0:
        return
    # Each chunk's unnormalised output, then its running max (log2 units) and sum: read only where written.
    part_out = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_stats = torch.empty(2, num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    workspace_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                         part_stats.stride(0), part_stats.stride(1), part_stats.stride(2))
    scales = _cache_scales(k_cache, k_scales, v_scales)
    _split_decode_kernel[(num_programs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, *scales[:2], out, part_out, part_stats, block_tables, seq_lens, query_start,
        tiles if tiles is not None else seq_lens, num_programs, head_dim ** -0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *scales[2:], block_tables.stride(0), *workspace_strides,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, ROWS=max(16, block_q * group_p), SPLIT=split_keys,
        PAGE=k_cache.shape[1], HEAD_DIM=head_dim, IEEE=q.dtype == torch.float32, SCALED=k_scales is not None, **launch,
    )
    if num_splits > 1:  # no context has a second chunk otherwise: every output is already written
        if tiles is None:
            contexts, starts = seq_lens, query_start
        else:  # each token its own row of the combination
            contexts, starts = token_contexts, torch.arange(num_rows + 1, device=q.device)
        _combine_splits_kernel[(num_rows, num_kv_heads)](
            out, part_out, part_stats, contexts, starts, out.stride(0), out.stride(1), *workspace_strides,
            GROUP=group, GROUP_P=group_p, SPLIT=split_keys, HEAD_DIM=head_dim, num_warps=1,
        )
