"""Multi-head latent attention's short queries (a decode token and its drafts) as Triton kernels over the paged
`LatentCache`, read in place through block tables: DSA's index scores, and absorbed-form attention over every
visible entry (dense MLA) or over each query's chosen ones (DSA). Formulas: `tandem.models.mla` (absorbed form),
`tandem.models.dsa` (index scores); the torch path, `tandem.inference.engine.paged_latent_attention`, is the
reference these kernels are tested against.

Why kernels: the torch path gathers each sequence's whole blocks into a padded copy per layer (and a CUDA graph would
hold the copy of its largest bound for good). Here every cached byte is read once where it lies, and a step's grid
depends on its context bound alone (the contexts themselves are read on the device): a CUDA graph captures it as it
captures the other families' decode attention.

Legend: Q = queries (a group's [G, L] flattened), H = heads, C = kv_lora_rank, Dr = RoPE dims, E = C + Dr (an
entry), Hi / Di = the indexer's heads / head dim, K = index_topk, S = block size.

- Index scores (`index_scores`): a program scores one query against `SCORE_KEYS` consecutive positions of its
  context, all indexer heads at once (each key loaded once for them), in fp32: sum_j w_j ReLU(q_j . k) / sqrt(Di);
  positions past the query's own score -inf. The scores are written out, [Q, bound] in slices of the queries of at
  most `max_pairs` (query, position) pairs, and `torch.topk` picks each query's K (`choose`): at decode shapes the
  scores are a few MiB (8 queries x 128k positions x 4 B), small beside the keys they come from, and a sorted top-k
  lists each query's visible positions first, so that its choice is a prefix of the list (`count`).
- Attention (`latent_attention`): a program takes `HEADS_PER_PROGRAM` heads of one query over one chunk of its keys
  (all visible positions, or its chosen ones gathered by position through the block table): online softmax of
  q_c . c + q_r . k_r over the entries, values the entries' first C features, fp32 accumulation. The heads of one
  chunk are neighbours in the grid, so an entry that one program brings into L2 serves the others. A query whose
  keys fit one chunk is finished by its program; longer ones leave each chunk's max, sum and unnormalised output,
  combined in chunk order by `tandem.kernels.attention`'s combining kernel (the same workspace layout, one query a
  row). The chunk size follows the step's bound (`chunk_keys`), so that long contexts split into a few dozen chunks:
  enough programs to fill the GPU, a workspace small beside the entries read.

Over an FP8 cache (`LatentCache` with `fp8`) the latent parts and indexer keys are FP8, each token's with one fp32
scale, and the RoPE parts a tensor of their own in the queries' dtype: the programs load the FP8 values, widen them
exactly to the queries' dtype and apply each token's scale to its products (index score s x (q . k8); attention
score s x (q_c . c8) + q_r . k_r, output sum p s c8), so nothing dequantized is written out.

A query of length 0 (a CUDA-graph padding row) attends to nothing and outputs zeros.
"""

from __future__ import annotations

import math

import torch

from tandem.kernels.attention import next_pow2, supports_head_dim

try:
    import triton
    import triton.language as tl

    from tandem.kernels.attention import _combine_splits_kernel
except ImportError:  # CPU-only installs: the engine keeps its torch path
    triton = None

HEADS_PER_PROGRAM = 32
"""Query heads one attention program takes (fewer where the heads are fewer). Each program reads its chunk's entries
for its heads alone, so fewer programs a query means fewer reads; at GLM-5's 512 latent features in bf16, 32 heads
over eight warps are the most whose output tile (64 KiB of fp32) stays in registers (sm_90's compiler: no spills)."""

SCORE_KEYS = 64
"""Context positions one index-score program scores."""

_SCORE_LAUNCH = dict(num_warps=4)
_ATTEND_LAUNCH = dict(BLOCK_N=32, num_warps=8, num_stages=2)
_FP8_ATTEND_LAUNCH = dict(_ATTEND_LAUNCH, BLOCK_N=16)
"""Over an FP8 cache a tile of keys is held twice while it widens to the queries' dtype: at 32 keys a step the dense
program spills on sm_90, at 16 it stays in registers."""
_COMBINE_LAUNCH = dict(num_warps=8)
"""Eight warps hold the combination's output tile of `HEADS_PER_PROGRAM` heads by 512 features without spilling."""


def serves(kv_lora_rank: int, rope_dim: int, index_head_dim: int | None, device: torch.device) -> bool:
    """Whether the kernels serve this shape on `device`: CUDA with Triton, and each of the latent, RoPE and indexer
    head dims a power of 2 of at least 16 (`tl.dot`'s)."""
    dims = [kv_lora_rank, rope_dim] + ([index_head_dim] if index_head_dim is not None else [])
    return triton is not None and device.type == "cuda" and all(supports_head_dim(d) for d in dims)


def chunk_keys(bound: int) -> int:
    """Keys per chunk of an attention over at most `bound` keys: about 32 chunks, 256 to 4,096 keys each."""
    return min(4096, max(256, next_pow2(-(-bound // 32))))


if triton is not None:

    # The bound (and the output's row stride, the same) changes with each eager step's longest context: not
    # specialised on its value class, so that a new one compiles nothing mid-run.
    @triton.jit(do_not_specialize=["bound", "stride_on"])
    def _index_scores_kernel(q_ptr, w_ptr, keys_ptr, key_scales_ptr, block_tables_ptr, query_seq_ptr, query_pos_ptr,
                             out_ptr, bound, scale, stride_qn, stride_qh, stride_wn, stride_kb, stride_ks, stride_xb,
                             stride_bt, stride_on, HEADS: tl.constexpr, HEADS_P: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
                             IEEE: tl.constexpr):
        """Scores of query `program_id(0)` against positions BLOCK_N x `program_id(1)` onward (FP8: keys in FP8, each
        times its scale, `key_scales_ptr` [blocks, PAGE])."""
        query = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        seq = tl.load(query_seq_ptr + query).to(tl.int64)
        pos = tl.load(query_pos_ptr + query)
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, HEAD_DIM)
        seen = n <= pos
        q = tl.load(q_ptr + query * stride_qn + h[:, None] * stride_qh + d[None, :], mask=(h < HEADS)[:, None], other=0.0)
        w = tl.load(w_ptr + query * stride_wn + h, mask=h < HEADS, other=0.0)
        block = tl.load(block_tables_ptr + seq * stride_bt + n // PAGE, mask=seen, other=0).to(tl.int64)
        k = tl.load(keys_ptr + block[:, None] * stride_kb + (n % PAGE)[:, None] * stride_ks + d[None, :],
                    mask=seen[:, None], other=0.0).to(q.dtype)  # FP8: exact in the queries' dtype
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if FP8:  # a key's scale is positive: it passes through the ReLU, so it multiplies q . k8 once
            s = s * tl.load(key_scales_ptr + block * stride_xb + n % PAGE, mask=seen, other=0.0)[None, :]
        score = tl.sum(tl.maximum(s * scale, 0.0) * w[:, None], 0)  # [BLOCK_N]: each head's ReLU, weighted
        tl.store(out_ptr + query * stride_on + n, tl.where(seen, score, float("-inf")), mask=n < bound)

    @triton.jit(do_not_specialize=["stride_sb", "stride_sh"])
    def _latent_chunk_kernel(q_ptr, entries_ptr, ropes_ptr, scales_ptr, out_ptr, part_out_ptr, part_stats_ptr,
                             block_tables_ptr, query_seq_ptr, lengths_ptr, chosen_ptr, qk_scale, stride_qn, stride_qh,
                             stride_on, stride_oh, stride_eb, stride_es, stride_rb, stride_rs, stride_xb, stride_bt,
                             stride_cn, stride_pb, stride_ph, stride_ps, stride_sm, stride_sb, stride_sh,
                             GROUP: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                             PAGE: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, SPARSE: tl.constexpr,
                             FP8: tl.constexpr, IEEE: tl.constexpr):
        """Heads GROUP x `program_id(0)` onward of query `program_id(1)` over its keys' chunk `program_id(2)`: keys
        0..length-1, each a context position (SPARSE: the position its chosen list holds there). An entry's latent
        part is read at `entries_ptr`, its RoPE part at `ropes_ptr`; FP8: the latent part in FP8, times the token's
        scale at `scales_ptr` [blocks, PAGE], applied to q_c . c8 and to the softmax weight of c8."""
        query = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        seq = tl.load(query_seq_ptr + query).to(tl.int64)
        length = tl.load(lengths_ptr + query)
        rows = tl.arange(0, ROWS)
        row_ok = rows < GROUP
        head = tl.program_id(0) * GROUP + rows
        lo = split * SPLIT
        hi = tl.minimum(length, lo + SPLIT)
        c = tl.arange(0, LATENT)
        r = tl.arange(0, ROPE)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, LATENT], tl.float32)
        q_at = q_ptr + query * stride_qn + head[:, None] * stride_qh  # the latent part, then the RoPE part
        q_c = tl.load(q_at + c[None, :], mask=row_ok[:, None] & (lo < hi), other=0.0)
        q_r = tl.load(q_at + LATENT + r[None, :], mask=row_ok[:, None] & (lo < hi), other=0.0)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            if SPARSE:
                pos = tl.load(chosen_ptr + query * stride_cn + n, mask=n_ok, other=0)
            else:
                pos = n
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
            slot = pos % PAGE
            at = entries_ptr + block * stride_eb + slot * stride_es
            k_c = tl.load(at[:, None] + c[None, :], mask=n_ok[:, None], other=0.0).to(q_c.dtype)  # FP8: exact
            k_r = tl.load((ropes_ptr + block * stride_rb + slot * stride_rs)[:, None] + r[None, :], mask=n_ok[:, None],
                          other=0.0)
            if IEEE:
                s_c = tl.dot(q_c, tl.trans(k_c), input_precision="ieee")
                s_r = tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
            else:
                s_c = tl.dot(q_c, tl.trans(k_c))
                s_r = tl.dot(q_r, tl.trans(k_r))
            if FP8:
                k_scale = tl.load(scales_ptr + block * stride_xb + slot, mask=n_ok, other=0.0)
                s_c = s_c * k_scale[None, :]
            s = tl.where(n_ok[None, :], (s_c + s_r) * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every chunk a program walks has a key
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            if FP8:  # the value c8 x scale: its weight takes the scale
                p = p * k_scale[None, :]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)
            m = m_new
        # Keys of one chunk (or none: a padding row's zeros) are finished here; longer lists leave their chunk.
        whole = row_ok & (length <= SPLIT) & (split == 0)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + query * stride_on + head[:, None] * stride_oh + c[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=whole[:, None])
        keep = row_ok & (length > SPLIT) & (lo < hi)
        part = query * stride_pb + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + c[None, :], acc, mask=keep[:, None])
        stat = query * stride_sb + head * stride_sh + split
        tl.store(part_stats_ptr + stat, m, mask=keep)
        tl.store(part_stats_ptr + stride_sm + stat, l, mask=keep)


def index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, block_tables: torch.Tensor,
                 query_seq: torch.Tensor, query_pos: torch.Tensor, bound: int,
                 key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """DSA's index scores in fp32 (`tandem.models.dsa`) of queries [Q, Hi, Di] with head weights [Q, Hi] against the
    cached indexer keys [blocks, S, Di] of positions 0..bound-1 of each query's sequence (`query_seq` [Q]: its row
    of `block_tables`), -inf past the query's position (`query_pos` [Q]): [Q, bound]. `key_scales` [blocks, S]: an
    FP8 cache's (`LatentCache.layer_index_key_scales`), the keys then FP8, each times its scale."""
    num_queries, heads, head_dim = queries.shape
    out = torch.empty(num_queries, bound, dtype=torch.float32, device=queries.device)
    if num_queries == 0 or bound == 0:
        return out
    queries, weights = queries.contiguous(), weights.float().contiguous()
    # The kernels read query i's sequence row and position at offset i: a strided view (an expanded row) is copied.
    query_seq, query_pos = query_seq.contiguous(), query_pos.contiguous()
    _index_scores_kernel[(num_queries, triton.cdiv(bound, SCORE_KEYS))](
        queries, weights, keys, key_scales if key_scales is not None else weights, block_tables, query_seq, query_pos,
        out, bound, head_dim ** -0.5, queries.stride(0), queries.stride(1), weights.stride(0), keys.stride(0),
        keys.stride(1), key_scales.stride(0) if key_scales is not None else 0, block_tables.stride(0), out.stride(0),
        HEADS=heads, HEADS_P=max(16, next_pow2(heads)), HEAD_DIM=head_dim, BLOCK_N=SCORE_KEYS, PAGE=keys.shape[1],
        FP8=key_scales is not None, IEEE=queries.dtype == torch.float32, **_SCORE_LAUNCH,
    )
    return out


def choose(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, block_tables: torch.Tensor,
           query_seq: torch.Tensor, query_pos: torch.Tensor, bound: int, k: int, max_pairs: int,
           key_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's `k` highest-scoring positions among the `bound` first of its context (`index_scores`' arguments),
    scored in slices of at most `max_pairs` (query, position) pairs (one query at least): the positions [Q, k'],
    highest first (k' = min(k, bound)), and how many of them it sees [Q] (its visible positions come first)."""
    size = max(1, max_pairs // max(bound, 1))
    parts = [index_scores(queries[i:i + size], weights[i:i + size], keys, block_tables, query_seq[i:i + size],
                          query_pos[i:i + size], bound, key_scales).topk(min(k, bound), dim=-1).indices
             for i in range(0, queries.shape[0], size)]
    positions = torch.cat(parts) if len(parts) != 1 else parts[0]
    return positions, (query_pos + 1).clamp(min=0, max=positions.shape[1])


def latent_attention(q: torch.Tensor, entries: torch.Tensor, block_tables: torch.Tensor, query_seq: torch.Tensor,
                     lengths: torch.Tensor, bound: int, scale: float, kv_lora_rank: int,
                     chosen: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                     ropes: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed-form attention of queries q [Q, H, E] over the cached entries [blocks, S, E] of their sequences
    (`query_seq` [Q]: each one's row of `block_tables`): the latent output [Q, H, C] in q's dtype.

    Query i attends to keys 0..lengths[i]-1, at most `bound` (the grid's): its context positions themselves, or with
    `chosen` [Q, >= bound] the positions that list holds (DSA). `scale`: the softmax's, on q . entry. An FP8 cache
    (`LatentCache.layer_scales`): `entries` [blocks, S, C] hold the latent parts in FP8, each token's times its
    `scales` [blocks, S], and `ropes` [blocks, S, Dr] the RoPE parts."""
    num_queries, heads, entry_dim = q.shape
    out = torch.empty(num_queries, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_queries == 0:
        return out
    group = math.gcd(heads, HEADS_PER_PROGRAM)
    split = chunk_keys(bound)
    num_splits = max(1, -(-bound // split))
    # Each chunk's unnormalised output, then its running max (log2 units) and sum: read only where written.
    part_out = torch.empty(num_queries, heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    part_stats = torch.empty(2, num_queries, heads, num_splits, dtype=torch.float32, device=q.device)
    workspace_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                         part_stats.stride(0), part_stats.stride(1), part_stats.stride(2))
    q, query_seq, lengths = q.contiguous(), query_seq.contiguous(), lengths.contiguous()  # as in `index_scores`
    if ropes is None:  # the entries hold them, after the latent part
        ropes = entries[..., kv_lora_rank:]
    _latent_chunk_kernel[(heads // group, num_queries, num_splits)](
        q, entries, ropes, scales if scales is not None else lengths, out, part_out, part_stats, block_tables,
        query_seq, lengths, chosen if chosen is not None else lengths, scale * 1.4426950408889634,  # exp2, not exp
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), entries.stride(0), entries.stride(1),
        ropes.stride(0), ropes.stride(1), scales.stride(0) if scales is not None else 0, block_tables.stride(0),
        chosen.stride(0) if chosen is not None else 0, *workspace_strides,
        GROUP=group, ROWS=max(16, group), SPLIT=split, PAGE=entries.shape[1], LATENT=kv_lora_rank,
        ROPE=entry_dim - kv_lora_rank, SPARSE=chosen is not None, FP8=scales is not None,
        IEEE=q.dtype == torch.float32, **(_FP8_ATTEND_LAUNCH if scales is not None else _ATTEND_LAUNCH),
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_queries, heads // group)](
            out, part_out, part_stats, lengths, torch.arange(num_queries + 1, device=q.device), out.stride(0),
            out.stride(1), *workspace_strides, GROUP=group, GROUP_P=group, SPLIT=split, HEAD_DIM=kv_lora_rank,
            **_COMBINE_LAUNCH,
        )
    return out
