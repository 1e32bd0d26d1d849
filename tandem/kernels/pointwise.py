"""Triton kernels for the pointwise work of a decoder block around attention, one launch each.

Why: in eager mode a block's RMS norm is about eight kernels, RoPE about six per tensor and the
cache write two; a decode step of a small model spends more GPU time in those tiny launches than
in its matmuls. Here:
- `rms_norm`: a norm (optionally of x + delta, the residual add, whose sum it also returns); `rms_norm_fp8`: the
  same norm also quantized for a block-FP8 product (`tandem.kernels.fp8`), in the same launch: the norm is read
  back from memory by no separate quantization kernel;
- `silu_mul`: a dense feed-forward's silu(gate) * up, from its stacked gate/up projection; `silu_mul_fp8`: the same
  quantized for the block-FP8 down projection instead of stored;
- `qk_norm_rope_write`: the q/k norms (per head, over all heads, or none), RoPE (the model's cos
  and sin, so partial rotary and YaRN's scaling come with them) and the write of k and v into
  their paged-cache slots, for every token of a step; into an FP8 cache each token's head quantized
  with a scale of its own, written beside it (`tandem.inference.engine.kv_cache.quantize_heads`: the
  same numbers, the division rounded as torch's).
All three compute in fp32 and round to the activations' dtype exactly where the model's torch chain
rounds (`tandem.models.layers.rms_norm`, `apply_rope`): bf16 products and sums of bf16 values are
exact in fp32, so the only differences left are the order of the norms' sums. Shapes are fixed by
the token count and nothing is read on the host: decode steps run inside CUDA graphs.

Layouts: rows of q [N, Hq * D], k and v [N, Hkv * D] (a row stride, heads contiguous within it),
cos and sin [N, R] (R <= D rotary features), caches [blocks, S, Hkv, D] (contiguous; FP8: scales
[blocks, S, Hkv], contiguous), slots [N].

Reference: `tandem.models.layers.rms_norm` and `apply_rope` (the q/k steps of `decoder.before_attention`), silu * up.
Tests: `tests/kernels/test_pointwise.py`; inside the engine's blocks: `tests/inference/test_fused_blocks.py`.
"""

from __future__ import annotations

import torch

from tandem.kernels import fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine keeps the model's own block
    triton = None

NORM_NONE, NORM_PER_HEAD, NORM_ALL_HEADS = 0, 1, 2
"""Kinds of q/k norm, as `tandem.models.decoder.before_attention` tells them apart by the weight's length."""


def is_available(x: torch.Tensor) -> bool:
    """Whether the kernels can serve these activations (CUDA, Triton installed)."""
    return triton is not None and x.is_cuda


def warps_for(elements: int) -> int:
    """Warps of a program holding `elements` values: about 16 per thread, from 4 to 16 warps."""
    return min(16, max(4, elements // 512))


def qk_norm_kind(norm_weight: torch.Tensor | None, head_dim: int) -> int:
    if norm_weight is None:
        return NORM_NONE
    return NORM_PER_HEAD if norm_weight.shape[0] == head_dim else NORM_ALL_HEADS


if triton is not None:
    # The FP8 cache's quantization constants, as the kernels may read them (constexpr globals).
    FP8_MAX = tl.constexpr(fp8.FP8_MAX)
    INV_FP8_MAX = tl.constexpr(fp8.INV_FP8_MAX)
    MIN_AMAX = tl.constexpr(fp8.MIN_AMAX)

    @triton.jit
    def _rounded(x, like_ptr):
        """x rounded to the dtype `like_ptr` points to, back in fp32 (a no-op for fp32)."""
        return x.to(like_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit(do_not_specialize=["num_rows", "rows_out"])  # one compiled kernel for every row count
    def _rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, q_ptr, scale_ptr, num_rows, rows_out, stride_x,
                         stride_delta, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                         STORE_NORM: tl.constexpr, QUANTIZE: tl.constexpr, GROUP: tl.constexpr):
        # Rows from num_rows to rows_out (QUANTIZE's padding) read zeros and write only their FP8 zeros and scales.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = (cols < HIDDEN) & (row < num_rows)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:  # the residual add, rounded as the model's x + delta is
            x = _rounded(x + tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32), out_ptr)
            tl.store(sum_ptr + row * HIDDEN + cols, x, mask=mask)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = _rounded(weight * _rounded(x * rstd, out_ptr), out_ptr)  # the norm as stored in the activations' dtype
        if STORE_NORM:
            tl.store(out_ptr + row * HIDDEN + cols, normed, mask=mask)
        if QUANTIZE:  # `fp8._quantize_kernel`'s arithmetic on each group of GROUP columns of the stored norm
            groups = tl.reshape(normed, (BLOCK // GROUP, GROUP))
            scale = tl.maximum(tl.max(tl.abs(groups), axis=1), MIN_AMAX) * INV_FP8_MAX
            q = tl.clamp(tl.math.div_rn(groups, scale[:, None]), -FP8_MAX, FP8_MAX)
            group = tl.arange(0, BLOCK // GROUP)
            q_cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            tl.store(q_ptr + row * HIDDEN + q_cols, q.to(q_ptr.dtype.element_ty), mask=q_cols < HIDDEN)
            tl.store(scale_ptr + group * rows_out + row, scale, mask=group * GROUP < HIDDEN)

    @triton.jit(do_not_specialize=["num_rows", "rows_out"])  # one compiled kernel for every row count
    def _silu_mul_kernel(gate_up_ptr, out_ptr, q_ptr, scale_ptr, num_rows, rows_out, stride_row, INTER: tl.constexpr,
                         BLOCK: tl.constexpr, QUANTIZE: tl.constexpr, GROUP: tl.constexpr):
        # QUANTIZE: the product quantized instead of stored, rows from num_rows to rows_out (padding) as FP8 zeros.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = (cols < INTER) & (row < num_rows)
        gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * stride_row + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        silu = _rounded(gate / (1.0 + tl.exp(-gate)), out_ptr)  # F.silu's output, in the activations' dtype
        if QUANTIZE:  # `fp8._quantize_kernel`'s arithmetic on each group of GROUP columns of the product as stored
            groups = tl.reshape(_rounded(silu * up, out_ptr), (BLOCK // GROUP, GROUP))
            scale = tl.maximum(tl.max(tl.abs(groups), axis=1), MIN_AMAX) * INV_FP8_MAX
            q = tl.clamp(tl.math.div_rn(groups, scale[:, None]), -FP8_MAX, FP8_MAX)
            group = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
            q_cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            tl.store(q_ptr + row * INTER + q_cols, q.to(q_ptr.dtype.element_ty), mask=q_cols < INTER)
            tl.store(scale_ptr + group * rows_out + row, scale, mask=group * GROUP < INTER)
        else:
            tl.store(out_ptr + row * INTER + cols, silu * up, mask=mask)

    @triton.jit
    def _normed_rotated(row_ptr, weight_ptr, cos_row, sin_row, like_ptr, eps, H: tl.constexpr, D: tl.constexpr,
                        R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
        """One token's heads [BLOCK_H, BLOCK_D] (fp32, rounded as the model rounds), normed and rotated."""
        heads = tl.arange(0, BLOCK_H)[:, None]
        feats = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < H) & (feats < D)
        rotates = feats < R
        partner = tl.where(feats < R // 2, feats + R // 2, feats - R // 2)  # rotate-half's other feature
        x = tl.load(row_ptr + heads * D + feats, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(row_ptr + heads * D + partner, mask=mask & rotates, other=0.0).to(tl.float32)
        if NORM == 1:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            w = tl.load(weight_ptr + feats, mask=feats < D, other=0.0).to(tl.float32)
            wp = tl.load(weight_ptr + partner, mask=rotates, other=0.0).to(tl.float32)
        elif NORM == 2:
            rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (H * D) + eps)
            w = tl.load(weight_ptr + heads * D + feats, mask=mask, other=0.0).to(tl.float32)
            wp = tl.load(weight_ptr + heads * D + partner, mask=mask & rotates, other=0.0).to(tl.float32)
        if NORM != 0:
            x = _rounded(w * _rounded(x * rstd, like_ptr), like_ptr)
            xp = _rounded(wp * _rounded(xp * rstd, like_ptr), like_ptr)
        cos = tl.load(cos_row + feats, mask=rotates, other=0.0).to(tl.float32)
        sin = tl.load(sin_row + feats, mask=rotates, other=0.0).to(tl.float32)
        sign = tl.where(feats < R // 2, -1.0, 1.0)
        rotated = _rounded(_rounded(x * cos, like_ptr) + _rounded(sign * xp * sin, like_ptr), like_ptr)
        return tl.where(rotates, rotated, x)

    @triton.jit
    def _stored_heads(x, scale_ptr, slot, SCALED: tl.constexpr, HKV: tl.constexpr, BLOCK_HKV: tl.constexpr):
        """One token's heads [BLOCK_HKV, BLOCK_D] (fp32) as the cache stores them: as they are, or (SCALED) divided
        by a scale per head (its largest magnitude / 448), which is written to the head's entry of `scale_ptr`."""
        if SCALED:
            heads = tl.arange(0, BLOCK_HKV)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX) * INV_FP8_MAX
            tl.store(scale_ptr + slot * HKV + heads, scale, mask=heads < HKV)
            # Rounded as IEEE division (torch's of two tensors) rounds: `quantize_heads`' values bit for bit.
            x = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
        return x

    @triton.jit
    def _qk_norm_rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr,
                                   k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, stride_q, stride_k,
                                   stride_v, stride_rope, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                                   R: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                                   BLOCK_D: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cos_row, sin_row = cos_ptr + token * stride_rope, sin_ptr + token * stride_rope
        q = _normed_rotated(q_ptr + token * stride_q, q_weight_ptr, cos_row, sin_row, q_out_ptr, eps,
                            HQ, D, R, BLOCK_HQ, BLOCK_D, NORM)
        heads = tl.arange(0, BLOCK_HQ)[:, None]
        feats = tl.arange(0, BLOCK_D)[None, :]
        tl.store(q_out_ptr + token * HQ * D + heads * D + feats, q, mask=(heads < HQ) & (feats < D))
        # Rounded to the activations' dtype (k's), as the model's chain rounds, whatever the cache stores.
        k = _normed_rotated(k_ptr + token * stride_k, k_weight_ptr, cos_row, sin_row, k_ptr, eps,
                            HKV, D, R, BLOCK_HKV, BLOCK_D, NORM)
        kv_heads = tl.arange(0, BLOCK_HKV)[:, None]
        kv_mask = (kv_heads < HKV) & (feats < D)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        k = _stored_heads(k, k_scale_ptr, slot, SCALED, HKV, BLOCK_HKV)
        tl.store(k_cache_ptr + slot * HKV * D + kv_heads * D + feats, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v = tl.load(v_ptr + token * stride_v + kv_heads * D + feats, mask=kv_mask, other=0.0).to(tl.float32)
        v = _stored_heads(v, v_scale_ptr, slot, SCALED, HKV, BLOCK_HKV)
        tl.store(v_cache_ptr + slot * HKV * D + kv_heads * D + feats, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers.rms_norm` of x [N, hidden] (of x + delta where given, the residual add) -> (that sum, its norm).
    Without delta the sum is x itself."""
    total, out, _ = _launch_rms_norm(x, weight, eps, delta, store_norm=True)
    return total, out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
                 store_norm: bool = False, row_multiple: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
    """`rms_norm`, its norm also quantized in the same launch -> (sum, norm (None unless `store_norm`), (FP8, scales)):
    what `tandem.kernels.fp8.quantize_activations(norm, row_multiple)` gives, bit for bit (rows of zeros added up to a
    multiple of `row_multiple`; scales token-minor), for `tandem.kernels.fp8.fp8_product`."""
    return _launch_rms_norm(x, weight, eps, delta, store_norm, row_multiple)


def _launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None, store_norm: bool,
                     row_multiple: int | None = None):
    """The norm kernel; `row_multiple` None: no quantization."""
    num_rows, hidden = x.shape
    assert x.stride(-1) == 1 and (delta is None or delta.stride(-1) == 1), "features must be contiguous"
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device) if store_norm else None
    total = x if delta is None else torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    quantize = row_multiple is not None
    rows_out = -(-num_rows // row_multiple) * row_multiple if quantize else num_rows
    q = torch.empty(rows_out, hidden, dtype=fp8.FP8, device=x.device) if quantize else None
    scale = torch.empty(-(-hidden // fp8.GROUP), rows_out, dtype=torch.float32, device=x.device) if quantize else None
    if rows_out:
        other = x if delta is None else delta
        block = max(triton.next_power_of_2(hidden), fp8.GROUP if quantize else 1)
        like = out if store_norm else total  # the activations' dtype, whatever is stored
        _rms_norm_kernel[(rows_out,)](x, other, weight, total, like, q if quantize else like, scale if quantize else like,
                                      num_rows, rows_out, x.stride(0), other.stride(0), eps, HIDDEN=hidden, BLOCK=block,
                                      HAS_DELTA=delta is not None, STORE_NORM=store_norm, QUANTIZE=quantize,
                                      GROUP=fp8.GROUP, num_warps=warps_for(block))
    return total, out, ((q, scale.t()) if quantize else None)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 * I] (a dense feed-forward's gate and up projections side by side) -> silu(gate) * up [N, I]."""
    return _launch_silu_mul(gate_up, None)


def silu_mul_fp8(gate_up: torch.Tensor, row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul` quantized in the same launch, not stored -> (FP8, scales): what
    `tandem.kernels.fp8.quantize_activations(silu_mul(gate_up), row_multiple)` gives, bit for bit, for
    `tandem.kernels.fp8.fp8_product` (the down projection)."""
    return _launch_silu_mul(gate_up, row_multiple)


def _launch_silu_mul(gate_up: torch.Tensor, row_multiple: int | None):
    """The SiLU * up kernel; `row_multiple` None: the product stored, else quantized."""
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(-1) == 1, "features must be contiguous"
    quantize = row_multiple is not None
    rows_out = -(-num_rows // row_multiple) * row_multiple if quantize else num_rows
    out = (torch.empty(rows_out, inter, dtype=fp8.FP8, device=gate_up.device) if quantize
           else torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device))
    scale = torch.empty(-(-inter // fp8.GROUP), rows_out, dtype=torch.float32, device=gate_up.device) if quantize else out
    if rows_out:
        # Quantized, a program holds whole groups of 128 columns, and rounds the product to gate_up's dtype first.
        block = min(1024, max(triton.next_power_of_2(inter), fp8.GROUP if quantize else 1))
        stored = gate_up if quantize else out
        _silu_mul_kernel[(rows_out, triton.cdiv(inter, block))](gate_up, stored, out, scale, num_rows, rows_out,
                                                                gate_up.stride(0), INTER=inter, BLOCK=block,
                                                                QUANTIZE=quantize, GROUP=fp8.GROUP)
    return (out, scale.t()) if quantize else out


def qk_norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq * D], k, v [N, Hkv * D], cos, sin [N, R]: normed, rotated keys and the values written to the
    caches' `slot_mapping` slots (FP8 caches: quantized, their scales written to `k_scales` and `v_scales`
    [blocks, S, Hkv]); returns the normed, rotated queries [N, Hq, D]."""
    num_tokens = q.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_heads = q.shape[1] // head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the kernel addresses cache slots densely"
    scaled = k_scales is not None
    assert not scaled or (v_scales is not None and k_scales.is_contiguous() and v_scales.is_contiguous()), \
        "the kernel addresses the scales of slots densely"
    assert all(t.stride(-1) == 1 for t in (q, k, v, cos, sin)), "features must be contiguous"
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens:
        norm = qk_norm_kind(q_norm_weight, head_dim)
        block_heads, block_dim = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
        q_weight = q_norm_weight if q_norm_weight is not None else q
        k_weight = k_norm_weight if k_norm_weight is not None else k
        _qk_norm_rope_write_kernel[(num_tokens,)](
            q, k, v, cos, sin, q_weight, k_weight, q_out, k_cache, v_cache, k_scales if scaled else k_cache,
            v_scales if scaled else v_cache, slot_mapping, q.stride(0), k.stride(0), v.stride(0), cos.stride(0), eps,
            HQ=num_heads, HKV=num_kv_heads, D=head_dim, R=cos.shape[-1], BLOCK_HQ=block_heads,
            BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_D=block_dim, NORM=norm, SCALED=scaled,
            num_warps=warps_for(block_heads * block_dim))
    return q_out
