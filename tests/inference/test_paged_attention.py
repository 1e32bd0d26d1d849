"""Paged attention's torch reference (`reference_attention`, the CPU path) against plain softmax attention. The
Triton kernels are checked against the same dense attention in `tests/kernels/test_paged_attention_kernels.py`."""

import pytest
import torch
from attention_cases import DECODES, MIXED, dense_reference, mixed_step, reference


@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_reference_attention_equals_dense_softmax_attention(shapes):
    q, k, v, k_cache, v_cache, meta = mixed_step("cpu", torch.float32, shapes=shapes)
    out = reference(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(out.double(), dense_reference(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)

