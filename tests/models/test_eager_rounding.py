"""Compiled model functions round where eager mode rounds (`tandem.models.eager_rounding`), so that the trainer's compiled
blocks and the engine compute the same bf16 numbers."""

import shutil

import pytest
import torch

from tandem.models.eager_rounding import compile_like_eager
from tandem.models.layers import rms_norm, swiglu


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_compiled_bf16_chains_equal_eager_bit_for_bit():
    """Inductor's default keeps fused intermediates in fp32: the norm then equalled eager in 75% of its elements
    (torch 2.13, CPU). The norm's rounding points: fp32 statistics, the normalised value rounded to bf16, then the
    weight; the feed-forward's: silu(gate) rounded, times up, rounded."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(1, 40, 256, generator=gen)).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(256, generator=gen)).to(torch.bfloat16)
    norm = compile_like_eager(rms_norm, fullgraph=True)
    assert torch.equal(norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    gate, up, down = (0.05 * torch.randn(3, 256, 256, generator=gen)).to(torch.bfloat16)  # [out, in] each
    feed_forward = compile_like_eager(swiglu, fullgraph=True)
    assert torch.equal(feed_forward(x, gate, up, down), swiglu(x, gate, up, down))
