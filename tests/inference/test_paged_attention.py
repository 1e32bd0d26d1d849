"""Paged attention: the torch reference (the CPU path) against plain softmax attention; the split-KV
decode kernels, run by Triton's interpreter, against the same dense attention. All the Triton kernels
are compared with it on a GPU too (test_gpu_engine.py)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from attention_cases import DECODES, MIXED, dense_reference, mixed_step, reference


@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_reference_attention_equals_dense_softmax_attention(shapes):
    q, k, v, k_cache, v_cache, meta = mixed_step("cpu", torch.float32, shapes=shapes)
    out = reference(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(out.double(), dense_reference(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)


INTERPRETED_KERNELS = """
import sys
sys.path.insert(0, {tests!r})
import torch
from attention_cases import MIXED, check_split_decode, dense_reference, mixed_step
from tandem.kernels.attention import paged_attention

check_split_decode("cpu", torch.float32, heads=6, kv_heads=2, head_dim=16, tolerance=1e-5)
q, k, v, k_cache, v_cache, meta = mixed_step("cpu", torch.float32, shapes=MIXED)
out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start, meta.tiles, meta.block_q)
torch.testing.assert_close(out.double(), dense_reference(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4),
                    reason="Triton 3.6's interpreter fails on numpy >= 2.4 (int() of a one-element array)")
def test_kernels_under_tritons_interpreter_equal_dense_attention_and_decodes_are_batch_invariant():
    """The kernels on CPU tensors (fp32, exact dot products), run by Triton's interpreter. Split-KV decode:
    GQA groups of 3 (padded to 4), contexts around the chunk size, a padding row; each sequence's output
    bitwise equal alone and in the batch, whatever the grid's bound. Then a mixed step (prefill tiles)."""
    script = INTERPRETED_KERNELS.format(tests=str(Path(__file__).parent))
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
