"""Cascade decode attention as Triton kernels: the n samples of a prompt read their shared prompt's keys and values
once per step, not n times.

Why: in a decode step each query token reads its whole context from the paged cache, and the n sequences of an RL
group share their prompt's blocks (prefix caching gives them the same block ids), so plain decode reads those bytes
n times. Here a decode step's attention is split in two parts, merged by their log-sum-exp:
- the shared prefix: one program per (group, KV head, chunk of `SPLIT_KEYS` prefix keys) holds the queries of every
  member of the group (members x the query heads of one KV head: a small matrix, one `tl.dot` per key block) and
  reads each prefix key and value once for all of them;
- each sequence's own keys, from the end of its shared prefix to its context: the split decode of
  `tandem.kernels.attention`, one program per (sequence, KV head, chunk), starting at the sequence's prefix.
Each program leaves its chunk's running max, sum and unnormalised output in a workspace (fp32); a last kernel
combines a sequence's prefix chunks, then its own, in that fixed order.

A sequence outside any group has a prefix of 0 and attends over its whole context in its own part. Every grid is
sized by bounds (group slots, sequences, chunks of the longest context allowed), never by the plan's values, so
a CUDA graph captured once serves every plan that fits it; programs past their work do nothing. Not batch
invariant (a sequence's chunks depend on its group's prefix), so exact mode never takes it.

FP8 caches go through `_attend_keys` as in plain decode (scales applied to the columns of q k^T and of p).

Layouts: q and out [N, H, D] (a decode step: one token per sequence, at `query_start[seq]`), caches [blocks, S,
Hkv, D], block_tables [rows, M], seq_lens [B] (context after the step, 0 for a CUDA-graph padding row, whose
output is zeros), seq_prefix [B] (tokens of the sequence's shared prefix: whole blocks, fewer than its context),
group_prefix [G] (tokens of each group's prefix, 0 for an unused slot), group_members [G, MEMBERS] (batch rows of
each group's sequences, -1 past its last; the first member's block table row names the prefix's blocks).

Reference: `tandem.inference.engine.paged_attention.reference_cascade_attention` (the torch path); both equal plain
attention. Tests: `tests/kernels/test_cascade_attention_kernels.py`.
"""

from __future__ import annotations

import torch

from tandem.kernels.attention import SPLIT_KEYS, _cache_scales, next_pow2, decode_splits, triton

if triton is not None:
    import triton.language as tl

    from tandem.kernels.attention import _attend_keys, _fold_chunks, _workspace_rows

    @triton.jit(do_not_specialize=["stride_ps"])
    def _shared_prefix_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, part_out_ptr, part_stats_ptr, block_tables_ptr,
        query_start_ptr, group_prefix_ptr, group_members_ptr, scale, stride_qn, stride_qh, stride_kb,
        stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs, stride_bt, stride_pb, stride_ph,
        stride_ps, stride_sm, stride_sb, stride_sh, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        MEMBERS: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
    ):
        """Chunk `program_id(2)` of group `program_id(0)`'s shared prefix, for the queries of all its members by the
        heads of KV head `program_id(1)`: its partial result in the members' prefix chunk slots."""
        group = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        prefix = tl.load(group_prefix_ptr + group)
        lo = split * SPLIT
        hi = tl.minimum(prefix, lo + SPLIT)
        rows = tl.arange(0, ROWS)  # row = (member of the group, query head of the KV head's group)
        member = rows // GROUP_P
        g = rows % GROUP_P
        seq = tl.load(group_members_ptr + group * MEMBERS + member, mask=member < MEMBERS, other=-1)
        row_ok = (member < MEMBERS) & (g < GROUP) & (seq >= 0) & (lo < hi)
        head = kv_head * GROUP + g
        table_row = tl.load(group_members_ptr + group * MEMBERS)  # every member holds the prefix's blocks
        d = tl.arange(0, HEAD_DIM)
        token = tl.load(query_start_ptr + seq, mask=row_ok, other=0).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        sees_all = tl.zeros([ROWS], tl.int32) + hi  # the whole prefix precedes every member's query
        m, l, acc = _attend_keys(q, sees_all, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                                 table_row, kv_head, lo, hi, scale * 1.4426950408889634,  # exp2 instead of exp
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs,
                                 stride_bt, ROWS, BLOCK_N, PAGE, HEAD_DIM, IEEE, SCALED)
        slot = tl.where(row_ok, seq, 0).to(tl.int64)
        part = slot * stride_pb + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + d[None, :], acc, mask=row_ok[:, None])
        stat = slot * stride_sb + head * stride_sh + split
        tl.store(part_stats_ptr + stat, m, mask=row_ok)
        tl.store(part_stats_ptr + stride_sm + stat, l, mask=row_ok)

    @triton.jit(do_not_specialize=["num_prefix_splits", "stride_ps"])
    def _own_keys_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, part_out_ptr, part_stats_ptr, block_tables_ptr,
        seq_lens_ptr, query_start_ptr, seq_prefix_ptr, num_prefix_splits, scale, stride_qn, stride_qh, stride_kb,
        stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs, stride_bt, stride_pb, stride_ph,
        stride_ps, stride_sm, stride_sb, stride_sh, GROUP: tl.constexpr, GROUP_P: tl.constexpr, ROWS: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        """Chunk `program_id(2)` of sequence `program_id(0)`'s keys past its shared prefix, by the heads of KV head
        `program_id(1)`: its partial result in the sequence's own chunk slots (after the prefix's)."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(seq_lens_ptr + seq)
        lo = tl.load(seq_prefix_ptr + seq) + split * SPLIT
        hi = tl.minimum(ctx, lo + SPLIT)
        g = tl.arange(0, ROWS)
        row_ok = (g < GROUP) & (lo < hi)
        head = kv_head * GROUP + g
        d = tl.arange(0, HEAD_DIM)
        token = tl.load(query_start_ptr + seq).to(tl.int64)
        q = tl.load(q_ptr + token * stride_qn + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        q_pos = tl.zeros([ROWS], tl.int32) + (ctx - 1)
        m, l, acc = _attend_keys(q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq,
                                 kv_head, lo, hi, scale * 1.4426950408889634,
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_zb, stride_zs,
                                 stride_bt, ROWS, BLOCK_N, PAGE, HEAD_DIM, IEEE, SCALED)
        part = seq.to(tl.int64) * stride_pb + head * stride_ph + (num_prefix_splits + split) * stride_ps
        tl.store(part_out_ptr + part[:, None] + d[None, :], acc, mask=row_ok[:, None])
        stat = seq.to(tl.int64) * stride_sb + head * stride_sh + num_prefix_splits + split
        tl.store(part_stats_ptr + stat, m, mask=row_ok)
        tl.store(part_stats_ptr + stride_sm + stat, l, mask=row_ok)

    @triton.jit(do_not_specialize=["num_prefix_splits", "stride_ps", "stride_sb", "stride_sh"])
    def _merge_kernel(
        out_ptr, part_out_ptr, part_stats_ptr, seq_lens_ptr, query_start_ptr, seq_prefix_ptr, num_prefix_splits,
        stride_on, stride_oh, stride_pb, stride_ph, stride_ps, stride_sm, stride_sb, stride_sh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        """Sequence `program_id(0)`'s output by the heads of KV head `program_id(1)`: its prefix chunks, then its
        own, combined in that order."""
        seq = tl.program_id(0)
        ctx = tl.load(seq_lens_ptr + seq)
        prefix = tl.load(seq_prefix_ptr + seq)
        row_ok, head, d, part, stat = _workspace_rows(seq, tl.program_id(1), stride_pb, stride_ph, stride_sb,
                                                      stride_sh, GROUP, GROUP_P, HEAD_DIM)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
        m, l, acc = _fold_chunks(m, l, acc, part_out_ptr, part_stats_ptr, part, stat, 0, tl.cdiv(prefix, SPLIT),
                                 row_ok, d, stride_ps, stride_sm)
        m, l, acc = _fold_chunks(m, l, acc, part_out_ptr, part_stats_ptr, part, stat, num_prefix_splits,
                                 tl.cdiv(ctx - prefix, SPLIT), row_ok, d, stride_ps, stride_sm)
        token = tl.load(query_start_ptr + seq).to(tl.int64)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + token * stride_on + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


_LAUNCH = dict(BLOCK_N=32, num_warps=1, num_stages=2)
"""Plain decode's launch setting (`tandem.kernels.attention._DECODE_LAUNCH`): a prefix program holds 16 rows, as a
decode program padded for `tl.dot` does."""


def members_per_group(num_heads: int, num_kv_heads: int) -> int:
    """Most sequences a prefix program serves: as many as fill 16 rows of (member, query head of one KV head), at
    least 2. A larger group is served as several (each reads the prefix once)."""
    return max(2, 16 // next_pow2(num_heads // num_kv_heads))


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start: torch.Tensor, seq_prefix: torch.Tensor, group_prefix: torch.Tensor,
                   group_members: torch.Tensor, max_context: int, k_scales: torch.Tensor | None = None,
                   v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention output [N, H, D] of q [N, H, D] over the paged cache, each group's shared prefix read once
    (see the module docstring). `max_context`: a bound on every sequence's context this step (it sizes the grids).

    The workspace is allocated per call: under CUDA-graph capture it comes from the graph's pool."""
    out = torch.empty_like(q)  # the merge writes every sequence's token
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = next_pow2(group)
    members = group_members.shape[1]
    splits = decode_splits(max_context)  # per part: a prefix and a sequence's own keys are each < max_context
    part_out = torch.empty(num_seqs, num_heads, 2 * splits, head_dim, dtype=torch.float32, device=q.device)
    part_stats = torch.empty(2, num_seqs, num_heads, 2 * splits, dtype=torch.float32, device=q.device)
    workspace = (part_out, part_stats, part_out.stride(0), part_out.stride(1), part_out.stride(2), part_stats.stride(0),
                 part_stats.stride(1), part_stats.stride(2))
    scales = _cache_scales(k_cache, k_scales, v_scales)
    cache = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
             v_cache.stride(2), *scales[2:], block_tables.stride(0))
    shape = dict(GROUP=group, GROUP_P=group_p, SPLIT=SPLIT_KEYS, PAGE=k_cache.shape[1], HEAD_DIM=head_dim,
                 IEEE=q.dtype == torch.float32, SCALED=k_scales is not None, **_LAUNCH)
    num_slots = group_prefix.shape[0]
    if num_slots:
        _shared_prefix_kernel[(num_slots, num_kv_heads, splits)](
            q, k_cache, v_cache, *scales[:2], *workspace[:2], block_tables, query_start, group_prefix, group_members,
            head_dim ** -0.5, q.stride(0), q.stride(1), *cache, *workspace[2:],
            MEMBERS=members, ROWS=max(16, next_pow2(members) * group_p), **shape,
        )
    _own_keys_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, *scales[:2], *workspace[:2], block_tables, seq_lens, query_start, seq_prefix, splits,
        head_dim ** -0.5, q.stride(0), q.stride(1), *cache, *workspace[2:], ROWS=max(16, group_p), **shape,
    )
    _merge_kernel[(num_seqs, num_kv_heads)](
        out, *workspace[:2], seq_lens, query_start, seq_prefix, splits, out.stride(0), out.stride(1), *workspace[2:],
        GROUP=group, GROUP_P=group_p, SPLIT=SPLIT_KEYS, HEAD_DIM=head_dim, num_warps=1,
    )
    return out
