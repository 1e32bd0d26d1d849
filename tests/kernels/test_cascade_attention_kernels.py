"""Cascade decode attention's Triton kernels (`tandem.kernels.cascade_attention`) against plain attention: dense
softmax attention in float64 over what the cache holds (`attention_cases.dense_reference`), for RL groups of 2 to
9 sequences over prefixes of whole blocks (one and several chunks), members' own parts from a partial block to
several chunks, sequences that share nothing and a CUDA-graph padding row; over a cache in the step's dtype and an
FP8 one. Run by Triton's interpreter on CPU tensors (fp32: 1e-5), and on CUDA (fp32 and bf16). The torch path's
cascade is checked against the same reference in `tests/inference/test_cascade.py`."""

from pathlib import Path

import pytest
import torch
from attention_cases import dense_reference, kernel_caches, shared_prefix_step, with_cascade
from tandem.inference.engine.cascade import group_slots
from triton_interpreter import needs_triton_interpreter, run_interpreted

INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
import torch
from attention_cases import dense_reference, kernel_caches, shared_prefix_step, with_cascade
from tandem.inference.engine.cascade import group_slots
from tandem.kernels.cascade_attention import cascade_decode, members_per_group

# As many group slots as groups, then a CUDA graph's bound of them (unused slots must do nothing).
for fp8, graph in ((False, False), (True, True)):
    q, cache, meta, tables = shared_prefix_step("cpu", torch.float32, fp8=fp8)
    slots = group_slots(len(tables)) if graph else None
    c = with_cascade(meta, tables, 16, members_per_group(4, 2), slots).cascade
    assert sorted(len(rows) for rows in c.plan.groups) == [2, 3, 4, 8], c.plan.groups
    out = cascade_decode(q, block_tables=meta.block_tables, seq_lens=meta.seq_lens, query_start=meta.query_start,
                         seq_prefix=c.row_prefix, group_prefix=c.group_prefix, group_members=c.group_members,
                         max_context=meta.max_context, **kernel_caches(cache))
    torch.testing.assert_close(out.double(), dense_reference(q, cache, meta), rtol=1e-5, atol=1e-5)
print("ok")
"""


@needs_triton_interpreter
def test_cascade_kernels_under_tritons_interpreter_equal_plain_attention():
    """On CPU tensors (fp32, exact dot products): groups of 2, 3, 4 and 9 (8 and 1: a prefix program's most),
    sequences that share nothing, a padding row: over an fp32 cache with as many group slots as groups, and over an
    FP8 cache with a CUDA graph's bound of them (unused slots do nothing)."""
    run_interpreted(INTERPRETED.format(tests=str(Path(__file__).parents[1])), timeout=600)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="FP8 caches: a CUDA GPU of compute capability 8.9 or newer")


@needs_cuda
@pytest.mark.parametrize("fp8", [pytest.param(False, id="model-dtype-cache"), pytest.param(True, id="fp8-cache", marks=needs_fp8)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (40, 8)], ids=["qwen3-0.6b", "group-of-5"])
@pytest.mark.parametrize("n", range(2, 9), ids=lambda n: f"n{n}")
def test_cascade_kernels_equal_plain_attention(n, heads, kv_heads, dtype, tolerance, fp8):
    """Groups of n over a prompt of 1,000 tokens in 62 whole blocks (the rest in each member's own first block),
    members decoding 1 to 700 tokens past it, beside sequences that share nothing and a padding row."""
    from tandem.kernels.cascade_attention import cascade_decode, members_per_group

    groups = [(992, [8 + 97 * i for i in range(n)]), (0, [300]), (496, [3] * n), (0, [1500]), (0, [0])]
    q, cache, meta, tables = shared_prefix_step("cuda", dtype, heads=heads, kv_heads=kv_heads, head_dim=128, groups=groups,
                                                fp8=fp8)
    members = members_per_group(heads, kv_heads)
    c = with_cascade(meta, tables, 16, members, group_slots(len(tables))).cascade
    sizes = [members] * (n // members) + ([n % members] if n % members > 1 else [])  # a group's pieces of two or more
    assert sorted(len(rows) for rows in c.plan.groups) == sorted(sizes * 2)
    out = cascade_decode(q, block_tables=meta.block_tables, seq_lens=meta.seq_lens, query_start=meta.query_start,
                         seq_prefix=c.row_prefix, group_prefix=c.group_prefix, group_members=c.group_members,
                         max_context=meta.max_context, **kernel_caches(cache))
    error = (out.double().cpu() - dense_reference(q, cache, meta)).abs().max().item()
    assert error < tolerance, f"cascade differs from plain attention by {error}"
