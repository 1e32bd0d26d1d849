"""Block-scaled FP8 matrix products (W8A8): y = x @ W.T with both factors in float8_e4m3fn.

The scheme (DeepSeek-V3's, which released FP8 checkpoints such as Qwen3's follow):
- weights in blocks of 128 rows x 128 columns, one fp32 scale per block (`scale_inv`: a weight is its
  FP8 value times its block's scale);
- activations quantized as they arrive, one fp32 scale per token and group of 128 columns;
- each 128-wide slice of the reduction multiplied in FP8 with fp32 sums, then scaled by its two scales
  and added up in fp32; the result is rounded once, to the activations' dtype.

A weight may be several matrices stacked by rows (the engine's q/k/v and gate/up): each keeps the
128-row blocks of its own checkpoint, so a block never spans two of them, and `scale_rows` gives
every row of the stack the row of `scale_inv` that scales it (for one matrix: row // 128).

Three implementations of one function: `reference_matmul` dequantizes in fp32 and multiplies with
torch (any device: the CPU path, and the reference the others are tested against); a Triton kernel
(`matmul`; CUDA, compute capability 8.9 or newer: FP8 tensor cores) whose tiles span exactly one
128-column group, so that each partial product meets its own scales; and cuBLAS's block-scaled product
(`scaled_mm`, through `torch._scaled_mm`; weights of whole 128 x 128 blocks). Which one a weight's product takes,
and with which tiles, by token count: `BlockFp8Weight.tiles` (`tandem.kernels.fp8_tiles`: a table tuned on the
GPU, else the Triton kernel with `launch_config`'s tiles).

Reference: `reference_matmul`, `reference_quantize_activations`.
Tests: `tests/kernels/test_fp8.py`; in the engine: `tests/inference/test_fp8_engine.py`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tandem.kernels.fp8_tiles import ProductTiles

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
"""448: the largest e4m3 value; a group's largest magnitude maps to it."""
INV_FP8_MAX = 1.0 / FP8_MAX
"""A scale is amax times this (one rounded product, the same in torch on any device and in Triton; torch's CUDA
division by a number is itself a product by its reciprocal, so amax / 448 would round otherwise there)."""
GROUP = 128
"""Columns (and weight rows) sharing one scale."""
MIN_AMAX = 1e-12
"""Floor of a group's largest magnitude, so that an all-zero group gets a finite scale (its values stay 0)."""
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) on."""


@dataclass
class BlockFp8Weight:
    """One weight matrix, or several stacked by rows, in FP8 128 x 128 blocks."""

    weight: torch.Tensor
    """float8_e4m3fn [N, K]."""
    scale_inv: torch.Tensor
    """fp32 [blocks of rows, ceil(K / 128)]: a weight's value is its FP8 value times its block's entry."""
    scale_rows: torch.Tensor
    """int32 [N]: the row of `scale_inv` of each row of `weight`."""
    tiles: ProductTiles | None = None
    """The product's implementation and tiles by token count (the engine sets them from a table); None: the Triton
    kernel with `launch_config`'s tiles."""


def kernel_serves(device: torch.device) -> bool:
    """The Triton kernel runs here: a CUDA GPU of compute capability 8.9 or newer, or Triton's interpreter on the CPU."""
    if triton is None:
        return False
    if device.type == "cuda":
        return _capability(device.index) >= MIN_CAPABILITY
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    """Read once per device: `fp8_linear` asks at every call, and the driver's answer costs microseconds."""
    return torch.cuda.get_device_capability(index)


def fp8_linear(x: torch.Tensor, weight: BlockFp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with a block-FP8 weight: x [..., K] -> [..., N] in x's dtype (bias added after the product, in fp32)."""
    x2 = x.reshape(-1, x.shape[-1])
    if kernel_serves(x.device):
        out = fp8_product(quantize_activations(x2, SCALED_MM_ROWS), x2.shape[0], weight, bias, x.dtype)
    else:
        x_fp8, x_scale = reference_quantize_activations(x2)
        out = reference_matmul(x_fp8, x_scale, weight, bias, x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def fp8_product(quantized: tuple[torch.Tensor, torch.Tensor], num_rows: int, weight: BlockFp8Weight,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x @ W.T (+ bias) -> [num_rows, N] for x [num_rows, K] already quantized: `quantize_activations(x,
    SCALED_MM_ROWS)`, or a kernel that quantizes as it does (`tandem.kernels.pointwise.rms_norm_fp8`), its rows padded
    so (cuBLAS's product wants them so); by the implementation and tiles `weight.tiles` chooses for `num_rows`."""
    x_fp8, x_scale = quantized
    product, tiles = weight.tiles.choose(num_rows) if weight.tiles is not None else ("triton", None)
    if product == "scaled_mm":
        return scaled_mm(x_fp8, x_scale, weight, bias, out_dtype)[:num_rows]
    return matmul(x_fp8[:num_rows], x_scale[:num_rows], weight, bias, out_dtype, tiles)


def reference_quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales [M, ceil(K / group)]): each row's groups of `group` columns scaled so
    that their largest magnitude is 448, then rounded to nearest (ties to even). (The FP8 KV cache quantizes with a
    group of one head: `tandem.inference.engine.kv_cache.quantize_heads`.)"""
    M, K = x.shape
    groups = -(-K // group)
    padded = F.pad(x.float(), (0, groups * group - K)).view(M, groups, group)
    scale = padded.abs().amax(-1).clamp(min=MIN_AMAX) * INV_FP8_MAX
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(M, groups * group)[:, :K], scale


def expand_scales(scales: torch.Tensor, rows: torch.Tensor | None, K: int) -> torch.Tensor:
    """Per-group scales [R, ceil(K / 128)] -> one per element [len(rows), K] (`rows`: which row of `scales` each
    row takes; None: every row its own)."""
    per_row = scales if rows is None else scales[rows.long()]
    return per_row.repeat_interleave(GROUP, dim=1)[:, :K]


def reference_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: BlockFp8Weight, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """The scheme in torch: both factors dequantized to fp32, one fp32 product (sums in another order than the
    kernel's: results agree to fp32 rounding)."""
    K = x_fp8.shape[1]
    x = x_fp8.float() * expand_scales(x_scale, None, K)
    w = weight.weight.float() * expand_scales(weight.scale_inv, weight.scale_rows, K)
    out = x @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


QUANTIZE_ROWS = 16
"""Rows of one program of the activation quantizer (each program: QUANTIZE_ROWS x 128 values)."""


def quantize_activations(x: torch.Tensor, row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_quantize_activations` by a Triton kernel; the scales come token-minor ([M, groups] with strides
    (1, M)): a tile of the product reads one group's scales of consecutive tokens, contiguous so. `row_multiple`:
    rows of zeros (FP8 0, scale of `MIN_AMAX`) are added up to a multiple of it."""
    M, K = x.shape
    rows = -(-M // row_multiple) * row_multiple
    groups = -(-K // GROUP)
    x = x.contiguous()
    q = torch.empty(rows, K, dtype=FP8, device=x.device)
    scale = torch.empty(groups, rows, dtype=torch.float32, device=x.device)
    _quantize_kernel[(triton.cdiv(rows, QUANTIZE_ROWS), groups)](x, q, scale, M, rows, K, FP8_MAX=FP8_MAX,
                                                                INV_FP8_MAX=INV_FP8_MAX, MIN_AMAX=MIN_AMAX, GROUP=GROUP,
                                                                ROWS=QUANTIZE_ROWS)
    return q, scale.t()


SCALED_MM_ROWS = 16
"""`scaled_mm`'s activations are padded to a multiple of this many rows: cuBLAS reads the activations' scales
with 16-byte aligned columns, whose length is the number of rows."""


def scaled_mm_serves(weight: BlockFp8Weight) -> bool:
    """Whether `scaled_mm` computes `weight`'s product: whole 128 x 128 blocks (each row's scales are those of
    row // 128: a stack whose parts are multiples of 128 rows), and weight scales cuBLAS reads as they are held. It
    reads them as [K / 128, N / 128] with 16-byte aligned columns, so beyond one block of rows K / 128 must be a
    multiple of 4 (and torch refuses scales padded to it)."""
    rows = torch.arange(weight.weight.shape[0], device=weight.scale_rows.device) // GROUP
    row_blocks, column_blocks = weight.scale_inv.shape
    return (torch.equal(weight.scale_rows.long(), rows) and row_blocks == -(-weight.weight.shape[0] // GROUP)
            and (column_blocks % 4 == 0 or row_blocks == 1))


def scaled_mm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: BlockFp8Weight, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    """`reference_matmul` by cuBLAS's block-scaled product (`torch._scaled_mm`: 1 x 128 activation scales, token-minor
    as `quantize_activations` gives them, and 128 x 128 weight scales, which it takes as [K / 128, N / 128]), for a
    weight it serves (`scaled_mm_serves`). With a bias the product comes in fp32, so that
    the result is rounded once, after the bias, as the reference rounds it."""
    dtype = out_dtype if bias is None else torch.float32
    out = torch._scaled_mm(x_fp8, weight.weight.t(), scale_a=x_scale, scale_b=weight.scale_inv.t(), out_dtype=dtype)
    return out if bias is None else (out + bias.float()).to(out_dtype)


def launch_config(M: int) -> dict:
    """Tiles by the number of rows: small tiles where few tokens run (decode), so that more programs share the
    weight's columns; BLOCK_K is the scale group, so each partial product has one pair of scales. One program per
    tile: the kernel can also split the reduction (`SPLIT_K`, for decode steps whose few column tiles leave most
    multiprocessors idle), which `benchmarks/fp8_matmul.py` times; the engine does not split, since splitting has not
    been shown to pay there."""
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: BlockFp8Weight, bias: torch.Tensor | None,
           out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """`reference_matmul` by the Triton kernel; `config`: its tiles (default `launch_config`'s; the benchmark
    `benchmarks/fp8_matmul.py` tries others), with `SPLIT_K` shares of K's groups each summed by a program of its own
    and added after in fp32, in a fixed order (deterministic)."""
    M, K = x_fp8.shape
    N = weight.weight.shape[0]
    w = weight.weight
    if w.stride(1) != 1:
        raise ValueError(f"the FP8 weight must have contiguous rows, got strides {tuple(w.stride())}")
    config = dict(config or launch_config(M))
    split = config.pop("SPLIT_K", 1)
    out = torch.empty(M, N, dtype=out_dtype, device=x_fp8.device)
    # Split: each share writes its fp32 partial sums, added after in a fixed order (then the bias, then the rounding).
    target = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x_fp8.device)
    groups_per_split = triton.cdiv(triton.cdiv(K, GROUP), split)
    grid = (triton.cdiv(M, config["BLOCK_M"]), triton.cdiv(N, config["BLOCK_N"]), split)
    _matmul_kernel[grid](x_fp8, x_scale, w, weight.scale_inv, weight.scale_rows, bias if bias is not None else out, target,
                         M, N, K, groups_per_split, x_fp8.stride(0), *x_scale.stride(), w.stride(0),
                         weight.scale_inv.stride(0), target.stride(-2), M * N, HAS_BIAS=bias is not None and split == 1,
                         BLOCK_K=GROUP, **config)
    if split > 1:
        total = target.sum(0)
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out


if triton is not None:

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, M, rows_out, K, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                         MIN_AMAX: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
        # Rows M to rows_out (padding) read as zeros and are written as such.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)
        offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=(rows < M)[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX) * INV_FP8_MAX
        # Rounded as IEEE division (torch's of two tensors) rounds, not approximated: the reference's values bit for bit.
        q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=(rows < rows_out)[:, None] & (cols < K)[None, :])
        tl.store(scale_ptr + group * rows_out + rows, scale, mask=rows < rows_out)

    @triton.jit(do_not_specialize=["M", "split_stride"])
    def _matmul_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, rows_ptr, b_ptr, y_ptr, M, N, K, groups_per_split, stride_xm,
                       stride_xsm, stride_xsg, stride_wn, stride_wsr, stride_ym, split_stride, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program (m, n, s) sums groups [s * groups_per_split, (s + 1) * groups_per_split) of K into y's share s.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
        xs_rows = xs_ptr + rm.to(tl.int64) * stride_xsm
        ws_rows = ws_ptr + tl.load(rows_ptr + rn, mask=n_ok, other=0).to(tl.int64) * stride_wsr
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        first = tl.program_id(2) * groups_per_split
        for group in range(first, tl.minimum(first + groups_per_split, tl.cdiv(K, BLOCK_K))):
            k = group * BLOCK_K + rk
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            a_scale = tl.load(xs_rows + group * stride_xsg, mask=m_ok, other=0.0)
            b_scale = tl.load(ws_rows + group, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + tl.program_id(2).to(tl.int64) * split_stride + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
