"""Block-scaled FP8 products (`tandem.kernels.fp8`, weights from `tandem.models.fp8`).

Error bounds come from e4m3 itself: 3 mantissa bits, rounding to nearest, so a value in the normal range moves by
at most 2^-4 of itself; below it (|value / scale| < 2^-6) values sit 2^-9 apart and move by at most 2^-10 of the
scale. Each product x * w then errs by at most |x| e_w + e_x (|w| + e_w), and a sum by the sum of those: the bound
each test asserts element by element. The Triton kernel is held to the torch reference on the same quantized inputs
(CUDA of compute capability 8.9 on; and under Triton's interpreter on the CPU where that runs FP8)."""

from pathlib import Path

import pytest
import torch

from tandem.kernels.fp8 import (FP8, FP8_MAX, GROUP, INV_FP8_MAX, SCALED_MM_ROWS, BlockFp8Weight, expand_scales,
                                fp8_linear, kernel_serves, matmul, quantize_activations, reference_matmul,
                                reference_quantize_activations, scaled_mm, scaled_mm_serves)
from tandem.kernels.fp8_tiles import ProductTiles
from tandem.models.fp8 import Fp8Linear, dequantize_weight, quantize_weight, stack_fp8_rows
from triton_interpreter import needs_triton_interpreter, run_interpreted

UNIT = 2.0 ** -4
"""Largest relative rounding error of an e4m3 normal number: half the spacing of 3 mantissa bits."""
SUBNORMAL = 2.0 ** -10
"""Largest rounding error below e4m3's normal range, as a fraction of the scale: half the subnormal spacing 2^-9."""
FP32_SLACK = 2.0 ** -20
"""Room for fp32 roundings of the scale division and the dequantizing product (each 2^-24 of the value)."""
TENSOR_CORE_SUM = 2.0 ** -12
"""Error of a 128-wide group's sum on FP8 tensor cores, as a fraction of the sum of its terms' magnitudes: they keep
about 14 bits of the running sum inside one matrix instruction (DeepSeek-V3's report), and a group takes 4 (32 wide
each), so a few units of 2^-14; the kernel adds the groups in fp32."""


def rounding_bound(values: torch.Tensor, scales_per_element: torch.Tensor) -> torch.Tensor:
    """Largest |dequantized - value| e4m3 allows each element, given the scale of its group or block."""
    return (UNIT + FP32_SLACK) * values.abs() + SUBNORMAL * scales_per_element


def block_weight(weight: torch.Tensor) -> BlockFp8Weight:
    q, scale_inv = quantize_weight(weight)
    return BlockFp8Weight(q, scale_inv, torch.arange(weight.shape[0], device=weight.device, dtype=torch.int32) // GROUP)


def product_bound(x: torch.Tensor, w: torch.Tensor, x_error: torch.Tensor, w_error: torch.Tensor) -> torch.Tensor:
    """|x^ @ w^.T - x @ w.T| element by element, given bounds of each factor's error; plus fp32 summation."""
    x, w, x_error, w_error = (t.double() for t in (x, w, x_error, w_error))
    bound = x.abs() @ w_error.T + x_error @ (w.abs() + w_error).T
    summed = (x.abs() + x_error) @ (w.abs() + w_error).T
    return bound + x.shape[1] * 2.0 ** -24 * summed


def test_weight_blocks_round_within_e4m3_and_keep_each_blocks_largest_value():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 1, 200)  # blocks of very different sizes
    weight[128:256, 128:] = 0  # an all-zero block stays zero
    q, scale_inv = quantize_weight(weight)
    assert q.dtype == FP8 and scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    back = dequantize_weight(q, scale_inv)
    rows = torch.arange(300) // GROUP
    assert ((back - weight).abs() <= rounding_bound(weight, expand_scales(scale_inv, rows, 200))).all()
    assert (back[128:256, 128:] == 0).all()
    # Each block's largest magnitude maps to +-448 exactly: the scale uses e4m3's whole range.
    blocks = q.float().abs()[:256, :128].reshape(2, GROUP, GROUP)
    assert torch.equal(blocks.amax(dim=(1, 2)), torch.full((2,), FP8_MAX))
    assert not torch.equal(back, weight)  # it did quantize


def test_activations_are_scaled_per_token_and_group_of_128_columns():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 300, generator=gen) * torch.tensor([1e-3, 1, 10, 100, 1e4])[:, None]
    q, scale = reference_quantize_activations(x)
    assert q.shape == (5, 300) and scale.shape == (5, 3)
    back = q.float() * expand_scales(scale, None, 300)
    assert ((back - x).abs() <= rounding_bound(x, expand_scales(scale, None, 300))).all()
    assert torch.equal(scale[:, 0], x[:, :128].abs().amax(-1) * INV_FP8_MAX)  # one scale per token and group
    assert torch.equal(scale[:, 2], x[:, 256:].abs().amax(-1) * INV_FP8_MAX)  # the last group is 44 wide


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_error_is_within_the_bound_of_e4m3(dtype):
    """A linear layer in FP8 against the exact product of the same (unquantized) factors, on random weights."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(33, 200, generator=gen).to(dtype)
    w = (torch.randn(130, 200, generator=gen) / 200 ** 0.5).to(dtype)
    bias = torch.randn(130, generator=gen).to(dtype)
    weight = block_weight(w)
    got = fp8_linear(x, weight, bias)
    assert got.dtype == dtype and got.shape == (33, 130)
    x_scale = reference_quantize_activations(x)[1]
    bound = product_bound(x, w, rounding_bound(x.float(), expand_scales(x_scale, None, 200)),
                          rounding_bound(w.float(), expand_scales(weight.scale_inv, weight.scale_rows, 200)))
    exact = x.double() @ w.double().T + bias.double()
    bound = bound + (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23) * exact.abs()  # the result's own rounding
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"worst excess {(error - bound).max():.3g}"
    relative = (error.norm() / exact.norm()).item()
    assert 0 < relative < UNIT  # quantized, and far from the worst case: rounding errors of independent terms cancel


def test_stacked_layers_keep_their_own_blocks_where_a_part_is_not_a_multiple_of_128_rows():
    """q, k, v of 128, 64 and 64 rows (the tiny model's): k's and v's blocks are 64 rows, each with its own scales,
    so the stacked product equals the three products, and the layers' tensors stay views of the stack."""
    gen = torch.Generator().manual_seed(3)
    K = 200
    weights = [torch.randn(n, K, generator=gen) * s for n, s in ((128, 1.0), (64, 100.0), (64, 0.01))]
    layers = []
    for w in weights:
        layer = Fp8Linear(K, w.shape[0], None)
        layer.weight, layer.weight_scale_inv = quantize_weight(w)
        layers.append(layer)
    separate = [BlockFp8Weight(layer.weight, layer.weight_scale_inv,
                               torch.arange(layer.out_features, dtype=torch.int32) // GROUP) for layer in layers]
    stacked, bias = stack_fp8_rows(layers)
    assert bias is None and stacked.weight.shape == (256, K) and stacked.scale_inv.shape == (3, 2)
    assert torch.equal(stacked.scale_rows, torch.cat([torch.zeros(128), torch.ones(64), torch.full((64,), 2)]).int())
    x = torch.randn(9, K, generator=gen)
    torch.testing.assert_close(fp8_linear(x, stacked), torch.cat([fp8_linear(x, w) for w in separate], dim=-1),
                               rtol=1e-6, atol=1e-6)
    q, scale_inv = quantize_weight(torch.randn(64, K, generator=gen))
    layers[2].weight.copy_(q)  # an update of v reaches the stack
    layers[2].weight_scale_inv.copy_(scale_inv)
    assert torch.equal(stacked.weight[192:].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(stacked.scale_inv[2], scale_inv[0])


SHAPES = [(1, 256, 128), (7, 130, 200), (16, 384, 384), (33, 1024, 1024), (200, 320, 448), (1000, 256, 256)]
"""(M, N, K): one token (decode) to many, widths off the 128 grid, each tile size of `launch_config`."""


def fp8_layers(parts: list[torch.Tensor]) -> BlockFp8Weight:
    """The weights `parts` quantized as layers of their own, stacked."""
    layers = []
    for w in parts:
        layer = Fp8Linear(w.shape[1], w.shape[0], None).to(w.device)
        layer.weight, layer.weight_scale_inv = quantize_weight(w)
        layers.append(layer)
    return stack_fp8_rows(layers)[0]


def assert_product_close(got: torch.Tensor, x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: BlockFp8Weight,
                         bias: torch.Tensor, what: str, group_sum: float) -> None:
    """`got` is the reference's product of the same quantized factors, up to the rounding of the result, the order
    of fp32 sums and `group_sum` (the relative error of each group's sum, `TENSOR_CORE_SUM` on a GPU)."""
    K = x_fp8.shape[1]
    expected = reference_matmul(x_fp8, x_scale, weight, bias, torch.float64)
    x_deq = x_fp8.double() * expand_scales(x_scale, None, K).double()
    w_deq = weight.weight.double() * expand_scales(weight.scale_inv, weight.scale_rows, K).double()
    result_rounding = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -23
    bound = result_rounding * expected.abs() + (group_sum + 2 * K * 2.0 ** -24) * (x_deq.abs() @ w_deq.abs().T) + 1e-30
    error = (got.double() - expected).abs()
    assert (error <= bound).all(), (what, float((error - bound).max()))


SPLIT_TILES = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=3, SPLIT_K=3)
"""Small tiles and a reduction split in 3 (more shares than some shapes have groups: empty shares add nothing)."""


def check_kernel_against_reference(device: str, dtype: torch.dtype, casts_round: bool = True,
                                   shapes: list[tuple[int, int, int]] = SHAPES) -> None:
    """The Triton kernels against the torch reference on `device`: activation quantization bit for bit (where
    `casts_round`: Triton's interpreter truncates its casts to FP8, a GPU rounds to nearest as torch does), products
    of the same quantized inputs to the rounding of the result."""
    gen = torch.Generator().manual_seed(4)
    assert kernel_serves(torch.device(device))
    for M, N, K in shapes:
        x = (torch.randn(M, K, generator=gen) * torch.logspace(-2, 2, K)).to(device, dtype)
        q, scale = quantize_activations(x)
        q_ref, scale_ref = reference_quantize_activations(x)
        assert torch.equal(scale, scale_ref), (M, N, K)
        if casts_round:
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (M, N, K)
        # Padded to a multiple of 16 rows (cuBLAS's product): the same rows, then rows of zeros with a zero row's scale.
        q_padded, scale_padded = quantize_activations(x, SCALED_MM_ROWS)
        rows = -(-M // SCALED_MM_ROWS) * SCALED_MM_ROWS
        assert q_padded.shape == (rows, K) and scale_padded.shape == (rows, scale.shape[1])
        assert scale_padded.stride() == (1, rows)  # token-minor, as cuBLAS's 1 x 128 scales must be
        assert torch.equal(q_padded[:M].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale_padded[:M], scale)
        zero_scale = reference_quantize_activations(torch.zeros(1, K, device=device, dtype=dtype))[1]
        assert (q_padded[M:].float() == 0).all() and torch.equal(scale_padded[M:], zero_scale.expand(rows - M, -1))
        bias = torch.randn(N, generator=gen).to(device, dtype)
        # A stacked weight: parts of 64 rows beside full blocks, so scale rows jump inside a tile; and one matrix.
        stacked = fp8_layers([torch.randn(n, K, generator=gen).to(device) * s for n, s in ((N - 128, 1.0), (64, 30.0), (64, 0.03))])
        single = fp8_layers([torch.randn(N, K, generator=gen).to(device)])
        for weight in (stacked, single):
            got = matmul(q_ref, scale_ref, weight, bias, dtype)
            assert_product_close(got, q_ref, scale_ref, weight, bias, str((M, N, K)),
                                 TENSOR_CORE_SUM if device == "cuda" else 0.0)
            if casts_round:
                assert torch.equal(fp8_linear(x, weight, bias), got)
            # The reduction split in shares of K's groups, added after in fp32 (the tiles a benchmark may choose).
            split = matmul(q_ref, scale_ref, weight, bias, dtype, SPLIT_TILES)
            assert_product_close(split, q_ref, scale_ref, weight, bias, f"{(M, N, K)} split",
                                 TENSOR_CORE_SUM if device == "cuda" else 0.0)
            # A table's tiles reach the kernel through `fp8_linear`.
            weight.tiles = ProductTiles([{"num_tokens": M, "product": "triton", "tiles": SPLIT_TILES}])
            assert torch.equal(fp8_linear(x, weight, bias), matmul(q, scale, weight, bias, dtype, SPLIT_TILES))
            weight.tiles = None


INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
import torch
from test_fp8 import check_kernel_against_reference

check_kernel_against_reference("cpu", torch.float32, casts_round=False, shapes=[(1, 256, 128), (7, 130, 200), (200, 320, 448)])
print("ok")
"""


@needs_triton_interpreter
def test_kernels_under_tritons_interpreter_match_the_reference():
    script = INTERPRETED.format(tests=str(Path(__file__).parent))
    run_interpreted(script, timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weights_quantize_to_the_same_bits_on_cuda_as_on_the_cpu():
    """A trainer that quantizes a broadcast on its GPU and an engine that quantizes a folder where it reads it make
    the same FP8 values and scales: a block's scale is one rounded product, each value one IEEE division and one
    round to nearest even, on either device."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 200, generator=gen) * torch.logspace(-3, 1, 200)).to(torch.bfloat16)
    q_cpu, scale_cpu = quantize_weight(weight)
    q_cuda, scale_cuda = quantize_weight(weight.cuda())
    assert torch.equal(q_cuda.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    assert torch.equal(scale_cuda.cpu(), scale_cpu)


@pytest.mark.skipif(not torch.cuda.is_available() or not kernel_serves(torch.device("cuda")),
                    reason="needs a CUDA GPU of compute capability 8.9 or newer, and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_on_cuda_match_the_reference(dtype):
    check_kernel_against_reference("cuda", dtype)


WHOLE_BLOCK_SHAPES = [(1, 128, 384), (5, 384, 512), (16, 1024, 1024), (33, 256, 2048), (1000, 512, 1536), (4093, 256, 512)]
"""(M, N, K) of weights `scaled_mm` serves (`scaled_mm_serves`: whole 128 x 128 blocks, K / 128 a multiple of 4
beyond one block of rows): one token to a prefill chunk of an odd number of rows, which the activations' padding
makes a multiple of 16."""


@pytest.mark.skipif(not torch.cuda.is_available() or not kernel_serves(torch.device("cuda")),
                    reason="needs a CUDA GPU of compute capability 8.9 or newer, and Triton")
def test_cublas_block_scaled_product_on_cuda_matches_the_reference():
    """`scaled_mm` (cuBLAS through `torch._scaled_mm`) computes the scheme: the reference's product of the same
    quantized factors, to the rounding of the result and the tensor cores' sums, with and without a bias; and a table
    that names it is what `fp8_linear` runs."""
    gen = torch.Generator().manual_seed(5)
    for M, N, K in WHOLE_BLOCK_SHAPES:
        x = (torch.randn(M, K, generator=gen) * torch.logspace(-2, 2, K)).to("cuda", torch.bfloat16)
        weight = fp8_layers([torch.randn(N, K, generator=gen).cuda()])
        assert scaled_mm_serves(weight)
        for bias in (None, torch.randn(N, generator=gen).to("cuda", torch.bfloat16)):
            q, scale = quantize_activations(x, SCALED_MM_ROWS)
            got = scaled_mm(q, scale, weight, bias, torch.bfloat16)[:M]
            assert got.shape == (M, N) and got.dtype == torch.bfloat16
            assert_product_close(got, q[:M], scale[:M], weight, bias, f"{(M, N, K)} bias={bias is not None}", TENSOR_CORE_SUM)
            weight.tiles = ProductTiles([{"num_tokens": 1, "product": "scaled_mm", "tiles": None}])
            assert torch.equal(fp8_linear(x, weight, bias), got)
            weight.tiles = None
