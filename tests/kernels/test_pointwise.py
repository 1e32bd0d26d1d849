"""The pointwise kernels (`tandem.kernels.pointwise`: `rms_norm`, `silu_mul`, `qk_norm_rope_write`) against the
model's own functions (`tandem.models.layers.rms_norm`, `apply_rope`; silu(gate) * up): in fp32 under Triton's
interpreter, and in bf16 on CUDA. The interpreter truncates when it casts to bf16 (the GPU rounds to nearest, as
torch does), so bf16 runs on CUDA only. The cache write into an FP8 cache against `kv_cache.quantize_heads` of what
the kernel writes into a cache in the model's dtype. The engine's blocks that run them:
`tests/inference/test_fused_blocks.py`."""

from pathlib import Path

import pytest
import torch

from tandem.inference.engine.kv_cache import KVCache, quantize_heads
from tandem.models.layers import YarnScaling, apply_rope, rms_norm, rope_cos_sin
from triton_interpreter import needs_triton_interpreter, run_interpreted


def reference_qk(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim):
    """`before_attention`'s steps after the projections, on one step's tokens [N, heads * D]."""
    n = q.shape[0]
    if q_norm_weight is not None and q_norm_weight.shape[0] != head_dim:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k, v = (t.reshape(1, n, -1, head_dim) for t in (q, k, v))
    if q_norm_weight is not None and q_norm_weight.shape[0] == head_dim:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    return apply_rope(q, cos[None], sin[None])[0], apply_rope(k, cos[None], sin[None])[0], v[0]


KERNEL_CASES = [  # heads, kv heads, head dim, partial rotary factor, q/k norm, YaRN
    (4, 2, 16, 1.0, "head", None),  # Qwen3
    (5, 1, 16, 0.5, "none", None),  # GLM-4.5: partial rotary, no q/k norm, heads not a power of 2
    (3, 3, 8, 1.0, "all_heads", YarnScaling(4.0, 64, 1.2)),  # MiniMax-M2's norm over all heads, YaRN's cos/sin
]


def check_kernels(device: str, dtype: torch.dtype, num_tokens: int = 7, seed: int = 0) -> list[float]:
    """Both kernels against the model's functions on random inputs; returns the fraction of equal elements
    of each output (q, k, normed sum) after asserting they are close."""
    from tandem.kernels import pointwise

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    equal = []
    for heads, kv_heads, head_dim, rotary, norm, yarn in KERNEL_CASES:
        q = rand(num_tokens, heads * head_dim + 3)[:, :heads * head_dim]  # rows wider than their heads (a view)
        k, v = rand(num_tokens, kv_heads * head_dim), rand(num_tokens, kv_heads * head_dim)
        q_w, k_w = {"head": (rand(head_dim), rand(head_dim)), "none": (None, None),
                    "all_heads": (rand(heads * head_dim), rand(kv_heads * head_dim))}[norm]
        positions = torch.arange(3, 3 + num_tokens, device=device)[None]
        cos, sin = rope_cos_sin(positions, int(head_dim * rotary), 10_000.0, dtype, yarn)
        cache = KVCache(1, num_tokens, 4, kv_heads, head_dim, dtype, torch.device(device))
        slots = torch.randperm(4 * num_tokens, generator=gen)[:num_tokens].to(device)
        k_cache, v_cache = cache.layer(0)
        q_out = pointwise.qk_norm_rope_write(q, k, v, cos[0], sin[0], q_w, k_w, 1e-6, k_cache, v_cache, slots)
        ref_q, ref_k, ref_v = reference_qk(q, k, v, cos[0], sin[0], q_w, k_w, 1e-6, head_dim)
        written_k = k_cache.reshape(-1, kv_heads, head_dim)[slots]
        assert torch.equal(v_cache.reshape(-1, kv_heads, head_dim)[slots], ref_v)
        assert int((k_cache != 0).sum()) == int((written_k != 0).sum())  # nothing written outside the slots
        for out, ref in ((q_out, ref_q), (written_k, ref_k)):
            check_close(out, ref, dtype)
            equal.append((out == ref).float().mean().item())
    x, delta, weight = rand(num_tokens, 48), rand(num_tokens, 48), rand(48)
    total, normed = pointwise.rms_norm(x, weight, 1e-6, delta=delta)
    assert torch.equal(total, x + delta)
    check_close(normed, rms_norm(x + delta, weight, 1e-6), dtype)
    equal.append((normed == rms_norm(x + delta, weight, 1e-6)).float().mean().item())
    same, normed = pointwise.rms_norm(x, weight, 1e-6)
    assert same is x
    check_close(normed, rms_norm(x, weight, 1e-6), dtype)
    check_norm_quantized(rand, dtype, num_tokens)
    inter = 1100  # two programs per row, the second one part masked
    gate_up = rand(num_tokens, 2 * inter + 5)[:, :2 * inter]  # rows wider than gate and up (a view)
    ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    check_close(pointwise.silu_mul(gate_up), ref, dtype)
    equal.append((pointwise.silu_mul(gate_up) == ref).float().mean().item())
    check_silu_mul_quantized(rand, num_tokens)
    return equal


def check_norm_quantized(rand, dtype: torch.dtype, num_tokens: int) -> None:
    """`rms_norm_fp8` writes the sum and norm `rms_norm` writes, and the norm quantized as `fp8.quantize_activations`
    quantizes it (the same FP8 bits and scales, rows padded with zeros alike, scales token-minor): widths below one
    group of 128 columns and of three groups, the last part full; without the residual add and with it."""
    from tandem.kernels import fp8, pointwise

    for hidden in (48, 300):
        x, delta, weight = rand(num_tokens, hidden) * 10.0, rand(num_tokens, hidden), rand(hidden)
        for add in (None, delta):
            total, normed = pointwise.rms_norm(x, weight, 1e-6, delta=add)
            for store_norm, row_multiple in ((False, 16), (True, 1)):
                total_q, normed_q, (q, scale) = pointwise.rms_norm_fp8(x, weight, 1e-6, delta=add, store_norm=store_norm,
                                                                       row_multiple=row_multiple)
                q_ref, scale_ref = fp8.quantize_activations(normed, row_multiple)
                assert torch.equal(total_q, total) and (torch.equal(normed_q, normed) if store_norm else normed_q is None)
                assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (hidden, add is None, row_multiple)
                assert torch.equal(scale, scale_ref) and scale.stride() == scale_ref.stride()


def check_silu_mul_quantized(rand, num_tokens: int) -> None:
    """`silu_mul_fp8` gives `fp8.quantize_activations` of what `silu_mul` stores, bit for bit (rows padded alike,
    scales token-minor): widths of three groups of 128 columns, the last part full, in one program, and of groups
    across two programs, the second part masked."""
    from tandem.kernels import fp8, pointwise

    for inter in (300, 1100):
        gate_up = rand(num_tokens, 2 * inter) * 4.0
        for row_multiple in (1, 16):
            q, scale = pointwise.silu_mul_fp8(gate_up, row_multiple)
            q_ref, scale_ref = fp8.quantize_activations(pointwise.silu_mul(gate_up), row_multiple)
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (inter, row_multiple)
            assert torch.equal(scale, scale_ref) and scale.stride() == scale_ref.stride()


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: within a few ulps; bf16: within a few roundings of the largest element (a norm's sum in another
    order can move an intermediate rounding by an ulp, which the weight and RoPE carry on)."""
    scale = ref.abs().max().item()
    tolerance = 4e-6 * scale if dtype == torch.float32 else 2 ** -5 * scale
    assert (out.float() - ref.float()).abs().max().item() <= tolerance


def check_fp8_cache_write(device: str, dtype: torch.dtype, casts_round: bool, num_tokens: int = 7, seed: int = 0) -> None:
    """`qk_norm_rope_write` into an FP8 cache stores `quantize_heads` of the keys and values it stores into a cache in
    the model's dtype: scales bit for bit, and FP8 numbers bit for bit where `casts_round` (a GPU: to nearest, as
    torch); Triton's interpreter loses the carry where rounding up reaches a power of two (127 becomes 64, not 128),
    so there a power of two may come out as the one below it. Nothing is written outside the slots."""
    from tandem.kernels import pointwise

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    for heads, kv_heads, head_dim, rotary, norm, yarn in KERNEL_CASES:
        # Heads of very different sizes: each gets its own scale.
        q, k = rand(num_tokens, heads * head_dim), rand(num_tokens, kv_heads * head_dim) * 30.0
        v = rand(num_tokens, kv_heads * head_dim) * torch.logspace(-2, 2, kv_heads, device=device).repeat_interleave(head_dim)
        q_w, k_w = {"head": (rand(head_dim), rand(head_dim)), "none": (None, None),
                    "all_heads": (rand(heads * head_dim), rand(kv_heads * head_dim))}[norm]
        cos, sin = rope_cos_sin(torch.arange(num_tokens, device=device)[None], int(head_dim * rotary), 10_000.0, dtype, yarn)
        slots = torch.randperm(4 * num_tokens, generator=gen)[:num_tokens].to(device)
        written = {}
        for fp8 in (False, True):
            cache = KVCache(1, num_tokens, 4, kv_heads, head_dim, dtype, torch.device(device), fp8)
            pointwise.qk_norm_rope_write(q.to(dtype), k.to(dtype), v.to(dtype), cos[0], sin[0], q_w, k_w, 1e-6,
                                         *cache.layer(0), slots, *cache.layer_scales(0))
            written[fp8] = cache
        for i in range(2):
            plain = written[False].layer(0)[i].reshape(-1, kv_heads, head_dim)[slots]
            expected, expected_scales = quantize_heads(plain)
            stored = written[True].layer(0)[i].view(torch.uint8)
            scales = written[True].layer_scales(0)[i]
            assert torch.equal(scales.reshape(-1, kv_heads)[slots], expected_scales)
            assert int((scales != 0).sum()) == num_tokens * kv_heads and int((stored != 0).sum()) <= plain.numel()
            codes = stored.reshape(-1, kv_heads, head_dim)[slots]
            expected_codes = expected.view(torch.uint8)
            if casts_round:
                assert torch.equal(codes, expected_codes)
            else:  # e4m3 codes: sign, 4 exponent bits, 3 mantissa bits; a binade down is 8 codes down
                power_of_two = (expected_codes & 0x7) == 0
                carry_lost = power_of_two & (codes.int() == expected_codes.int() - 8)
                assert ((codes == expected_codes) | carry_lost).all()
                assert (codes == expected_codes).float().mean() > 0.8


INTERPRETED_KERNELS = """
import sys
sys.path.insert(0, {tests!r})
from test_pointwise import check_fp8_cache_write, check_kernels
import torch
check_kernels("cpu", torch.float32)
check_kernels("cpu", torch.float32, num_tokens=1, seed=1)
check_fp8_cache_write("cpu", torch.float32, casts_round=False)
print("ok")
"""


@needs_triton_interpreter
def test_the_kernels_under_tritons_interpreter_compute_the_models_functions():
    """fp32, CPU tensors: the kernels against the model's functions (Qwen3's per-head norms, GLM's partial
    rotary without norms, a norm over all heads with YaRN), at seven tokens and at one; the FP8 cache write."""
    run_interpreted(INTERPRETED_KERNELS.format(tests=str(Path(__file__).parent)), timeout=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_round_where_the_model_rounds():
    """bf16: within a few roundings (`check_close`), and most elements equal: the kernels round where the torch
    chain rounds, but a norm's sum in another order moves its result by an ulp now and then, which the weight and
    RoPE carry on (79-95% equal per output on the H200 at one token). Decode-sized and prefill-sized steps.
    (fp32: the interpreter's test, and the engine tests of `tests/inference/test_gpu_engine.py` and `test_gpu_moe.py`,
    which run these.)"""
    for num_tokens, seed in ((1, 0), (256, 1), (4096, 2)):
        equal = check_kernels("cuda", torch.bfloat16, num_tokens, seed)
        assert min(equal) > 0.7, equal


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 caches: a CUDA GPU of compute capability 8.9 or newer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fp8_cache_write_quantizes_as_the_reference(dtype):
    """Decode-sized and prefill-sized steps: FP8 numbers and scales bit for bit `quantize_heads`' of what the kernel
    writes into a cache in the model's dtype."""
    for num_tokens, seed in ((1, 0), (256, 1)):
        check_fp8_cache_write("cuda", dtype, casts_round=True, num_tokens=num_tokens, seed=seed)
