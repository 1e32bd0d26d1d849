"""Paged attention's Triton kernels (`tandem.kernels.attention`) against dense softmax attention in float64
(`attention_cases.dense_reference`, which the torch reference `reference_attention` is checked against too, in
`tests/inference/test_paged_attention.py`): run by Triton's interpreter on CPU tensors, and on CUDA; over caches in
the step's dtype and over FP8 caches with their scales (dense attention over what those hold, so the bounds are
the same: the scales are applied in fp32, and an e4m3 number widens to bf16 exactly). Also the decode grids'
context bounds, which CUDA graphs are captured for."""

from pathlib import Path

import pytest
import torch
from triton_interpreter import needs_triton_interpreter, run_interpreted
from attention_cases import DECODES, MIXED, check_split_decode, dense_reference, kernel_caches, mixed_step

from tandem.inference.engine.cuda_graphs import padded_batch_size
from tandem.kernels.attention import SPLIT_KEYS, decode_context_bounds, decode_splits, paged_attention

INTERPRETED_KERNELS = """
import sys
sys.path.insert(0, {tests!r})
import torch
from attention_cases import MIXED, check_split_decode, dense_reference, kernel_caches, mixed_step
from tandem.kernels.attention import paged_attention

for fp8 in (False, True):
    check_split_decode("cpu", torch.float32, heads=6, kv_heads=2, head_dim=16, tolerance=1e-5, fp8=fp8)
    q, k, v, cache, meta = mixed_step("cpu", torch.float32, shapes=MIXED, fp8=fp8)
    out = paged_attention(q, block_tables=meta.block_tables, seq_lens=meta.seq_lens, query_start=meta.query_start,
                          tiles=meta.tiles, block_q=meta.block_q, **kernel_caches(cache))
    torch.testing.assert_close(out.double(), dense_reference(q, cache, meta), rtol=1e-5, atol=1e-5)
print("ok")
"""


@needs_triton_interpreter
def test_kernels_under_tritons_interpreter_equal_dense_attention_and_decodes_are_batch_invariant():
    """The kernels on CPU tensors (fp32, exact dot products), run by Triton's interpreter. Split-KV decode:
    GQA groups of 3 (padded to 4), contexts around the chunk size, a padding row; each sequence's output
    bitwise equal alone and in the batch, whatever the grid's bound. Then a mixed step (prefill tiles). Both over
    an fp32 cache and over an FP8 one."""
    run_interpreted(INTERPRETED_KERNELS.format(tests=str(Path(__file__).parents[1])), timeout=300)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="FP8 caches: a CUDA GPU of compute capability 8.9 or newer")
FP8_CACHE = [pytest.param(False, id="model-dtype-cache"), pytest.param(True, id="fp8-cache", marks=needs_fp8)]


@needs_cuda
@pytest.mark.parametrize("fp8", FP8_CACHE)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (40, 8)], ids=["qwen3-0.6b", "group-of-5"])
def test_kernel_equals_dense_attention(dtype, tolerance, shapes, heads, kv_heads, fp8):
    for seed in range(2):
        q, k, v, cache, meta = mixed_step("cuda", dtype, heads=heads, kv_heads=kv_heads, head_dim=128, block_size=16,
                                          seed=seed, shapes=shapes, fp8=fp8)
        out = paged_attention(q, block_tables=meta.block_tables, seq_lens=meta.seq_lens, query_start=meta.query_start,
                              tiles=meta.tiles, block_q=meta.block_q, **kernel_caches(cache))
        ref = dense_reference(q, cache, meta)
        assert (out.double().cpu() - ref).abs().max().item() < tolerance


@needs_cuda
@pytest.mark.parametrize("fp8", FP8_CACHE)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (40, 8)], ids=["qwen3-0.6b", "group-of-5"])
def test_split_decode_equals_dense_attention_and_is_batch_invariant(dtype, tolerance, heads, kv_heads, fp8):
    for seed in range(2):
        check_split_decode("cuda", dtype, heads, kv_heads, 128, tolerance, seed, fp8=fp8)


def test_decode_graph_context_bounds_hold_every_context_with_few_idle_chunks():
    assert decode_context_bounds(300) == [300] and decode_context_bounds(9216) == [512, 2048, 9216]
    assert decode_context_bounds(40960) == [512, 2048, 8192, 40960]
    for max_model_len in (1, 511, 512, 513, 640, 4352, 9216, 33_000, 131_072):
        bounds = decode_context_bounds(max_model_len)
        assert bounds == sorted(set(bounds)) and bounds[-1] == max_model_len
        for context in range(1, max_model_len + 1, 97):
            bound = padded_batch_size(bounds, context)
            assert context <= bound and decode_splits(bound) * SPLIT_KEYS >= bound
            # Idle chunk programs: at most 4 chunks per chunk in use, or the short class's one.
            assert decode_splits(bound) <= max(4 * decode_splits(context), decode_splits(bounds[0]), 4)
