"""Paged attention's torch reference (`reference_attention`, the CPU path) against plain softmax attention, over a
cache in the step's dtype and over an FP8 one (dense attention then over the values the FP8 cache holds). The
Triton kernels are checked against the same dense attention in `tests/kernels/test_paged_attention_kernels.py`."""

import pytest
import torch
from attention_cases import DECODES, MIXED, dense_reference, mixed_step, reference


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32-cache", "fp8-cache"])
@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_reference_attention_equals_dense_softmax_attention(shapes, fp8):
    q, k, v, cache, meta = mixed_step("cpu", torch.float32, shapes=shapes, fp8=fp8)
    out = reference(q, k, v, cache, meta)
    torch.testing.assert_close(out.double(), dense_reference(q, cache, meta), rtol=1e-5, atol=1e-5)

