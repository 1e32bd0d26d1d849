"""Paged attention: the torch reference (the CPU path) against plain softmax attention. The Triton
kernel is compared with the same dense attention on a GPU (test_gpu_engine.py)."""

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


SPLIT_DECODES = [(1, 40), (1, 512), (1, 1300), (1, 513), (1, 0)]
"""Decode contexts shorter than a chunk of `SPLIT_KEYS` (512), equal to one, several chunks, one key past a
chunk, and a CUDA-graph padding row (context 0, last)."""

INTERPRETED_SPLIT_DECODE = """
import sys
sys.path.insert(0, {tests!r})
import torch
from attention_cases import dense_reference, mixed_step
from tandem.inference.engine.attention_kernel import SPLIT_KEYS, paged_attention

shapes = {shapes!r}
assert SPLIT_KEYS == 512, "the shapes are chosen around a chunk of 512 keys"
q, k, v, k_cache, v_cache, meta = mixed_step("cpu", torch.float32, heads=6, kv_heads=2, head_dim=16, block_size=16,
                                             shapes=shapes)
def decode(rows, max_context):
    return paged_attention(q[rows], k_cache, v_cache, meta.block_tables[rows], meta.seq_lens[rows],
                           torch.arange(len(rows) + 1), meta.tiles[:, :len(rows)], 1, max_context)
rows = list(range(len(shapes)))
batch = decode(rows, max(c for _, c in shapes))
torch.testing.assert_close(batch.double(), dense_reference(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)
# Batch invariance: alone (its own grid bound), or beside the others under a CUDA graph's bound.
for i, (_, ctx) in enumerate(shapes):
    assert torch.equal(decode([i], ctx)[0], batch[i]), f"sequence {{i}} (context {{ctx}}) differs alone"
assert torch.equal(decode(rows, None), batch), "the block tables' bound changed the outputs"
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4),
                    reason="Triton 3.6's interpreter fails on numpy >= 2.4 (int() of a one-element array)")
def test_split_decode_under_tritons_interpreter_equals_dense_attention_and_is_batch_invariant():
    """The split-KV decode kernels on CPU tensors (fp32, exact dot products), run by Triton's interpreter:
    GQA groups of 3 (padded to 4), contexts around the chunk size, a padding row; each sequence's output
    bitwise equal alone and in the batch, whatever the grid's bound."""
    script = INTERPRETED_SPLIT_DECODE.format(tests=str(Path(__file__).parent), shapes=SPLIT_DECODES)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
