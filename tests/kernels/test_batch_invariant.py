"""Exact mode's kernels (`tandem.kernels.batch_invariant`, `pointwise`, `tandem.kernels.attention.attend_each_token`): a row's result is
bitwise the same alone and among other rows (several batch sizes, several positions in a tile), and close to
torch's; the trainer's packed documents attend bitwise as the engine's paged cache does. Run by Triton's
interpreter on the CPU (fp32), and on CUDA in bf16."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import batch_invariant, pointwise
from tandem.models.attention import DocumentCausalAttention
from tandem.kernels.attention import attend_each_token, exact_tile_tokens, exact_tiles
from tandem.models.decoder import normed_rotated
from tandem.models.exact import ExactDocumentAttention, exact_causal_attention, normed_rotated_tokens, residual_norm, silu_mul
from tandem.models.layers import rms_norm
from triton_interpreter import needs_triton_interpreter, run_interpreted


def among_others(fn, probe: torch.Tensor, gen: torch.Generator, sizes=(1, 5, 64, 70, 130)) -> None:
    """fn(rows)[i] for the row `probe` at the first, a middle and the last row of batches of these sizes equals
    fn(probe alone)."""
    alone = fn(probe[None])[0]
    for size in sizes:
        for at in sorted({0, size // 2, size - 1}):
            rows = torch.randn(size, *probe.shape, generator=gen).to(probe.device, probe.dtype)
            rows[at] = probe
            assert torch.equal(fn(rows)[at], alone), f"row {at} of {size} differs from the row alone"


def check_kernels(device: str, dtype: torch.dtype, hidden: int, out: int, vocab: int, tolerance: float) -> None:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    weight, bias, x = randn(out, hidden) / hidden ** 0.5, randn(out), randn(hidden)
    among_others(lambda rows: batch_invariant.linear(rows, weight, bias), x, gen)
    rows = randn(70, hidden)
    torch.testing.assert_close(batch_invariant.linear(rows, weight, bias), F.linear(rows, weight, bias),
                               atol=tolerance, rtol=tolerance)

    norm_weight = randn(hidden)
    among_others(lambda rows: batch_invariant.rms_norm(rows, norm_weight, 1e-6), x, gen)
    torch.testing.assert_close(batch_invariant.rms_norm(rows, norm_weight, 1e-6), rms_norm(rows, norm_weight, 1e-6),
                               atol=tolerance, rtol=tolerance)

    # The block kernels exact mode runs around attention: the norm with its residual add, silu(gate) * up, and the
    # q/k norms with RoPE, keys and values written to one slot per token.
    among_others(lambda rows: torch.stack(pointwise.rms_norm(rows[:, 0].contiguous(), norm_weight, 1e-6,
                                                                 rows[:, 1].contiguous()), 1), torch.stack([x, randn(hidden)]), gen)
    among_others(pointwise.silu_mul, randn(2 * out), gen)
    heads, kv_heads, D = 4, 2, 64
    widths = [heads * D, kv_heads * D, kv_heads * D, D, D]
    qk_norm_weights = randn(D), randn(D)

    def normed_rotated_rows(rows):
        q, k, v, cos, sin = rows.split(widths, dim=-1)
        return torch.cat([t.flatten(1) for t in normed_rotated_tokens(q, k, v, cos, sin, *qk_norm_weights, 1e-6, D)], 1)

    among_others(normed_rotated_rows, randn(sum(widths)), gen)
    q, k, v, cos, sin = randn(9, sum(widths)).split(widths, dim=-1)
    for got, expected in zip(normed_rotated_tokens(q, k, v, cos, sin, *qk_norm_weights, 1e-6, D),
                             normed_rotated(q[None], k[None], v[None], cos[None], sin[None], *qk_norm_weights, 1e-6, D)):
        torch.testing.assert_close(got, expected[0], atol=tolerance, rtol=tolerance)

    logits = torch.randn(vocab, generator=gen).to(device) * 4
    among_others(lambda rows: batch_invariant.log_softmax(rows, torch.full((rows.shape[0],), 0.7, device=device)), logits, gen,
                 sizes=(1, 3, 9))
    batch = torch.randn(9, vocab, generator=gen).to(device) * 4
    temperatures = torch.rand(9, generator=gen).to(device) + 0.5
    torch.testing.assert_close(batch_invariant.log_softmax(batch, temperatures), (batch / temperatures[:, None]).log_softmax(-1),
                               atol=1e-5, rtol=1e-5)


def paged(k_TKD: torch.Tensor, v_TKD: torch.Tensor, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Keys and values of one sequence in a paged cache of shuffled blocks: (k and v caches [blocks, S, Hkv, D],
    the block table [1, M])."""
    T, num_kv, D = k_TKD.shape
    num_blocks = -(-T // block_size)
    table = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks].to(k_TKD.device)
    caches = []
    for x in (k_TKD, v_TKD):
        cache = torch.zeros(num_blocks + 3, block_size, num_kv, D, dtype=x.dtype, device=x.device)
        cache[table] = torch.cat([x, x.new_zeros(num_blocks * block_size - T, num_kv, D)]).view(num_blocks, block_size, num_kv, D)
        caches.append(cache)
    return *caches, table[None]


def check_packed_attention_equals_paged(device: str, dtype: torch.dtype, lengths: list[int], tolerance: float) -> None:
    """Documents packed in one row through the trainer's exact backend; each document's tokens through the engine's
    paged cache (block size 4): as one prefill of all its tokens, and as decodes one token at a time."""
    gen = torch.Generator().manual_seed(1)
    heads, num_kv, D = 6, 2, 16
    T = sum(lengths)
    q, k, v = (torch.randn(1, T, h, D, generator=gen).to(device, dtype) for h in (heads, num_kv, num_kv))
    packed = ExactDocumentAttention([lengths]).attend(0, q, k, v)[0]
    tile_tokens = exact_tile_tokens(heads, num_kv)
    start = 0
    for n in lengths:
        k_cache, v_cache, table = paged(k[0, start:start + n], v[0, start:start + n], 4, gen)
        contexts = torch.arange(1, n + 1, device=device)

        def attend(first: int, count: int, max_context: int) -> torch.Tensor:
            """Tokens first..first+count-1 of the document as one prefill chunk of its sequence."""
            return attend_each_token(q[0, start + first:start + first + count], k_cache, v_cache, table,
                                     contexts[first + count - 1:first + count], torch.tensor([0, count], device=device),
                                     exact_tiles([count], tile_tokens, device), contexts[first:first + count], max_context)

        assert torch.equal(attend(0, n, n), packed[start:start + n])  # one prefill of the whole document
        for t in range(n):  # a decode: one query, a grid sized for a longer context than it has
            assert torch.equal(attend(t, 1, 4 * n + 600)[0], packed[start + t])
        if n > 2:  # two chunks whose tiles start at other tokens than the whole prefill's
            assert torch.equal(torch.cat([attend(0, 3, n), attend(3, n - 3, n)]), packed[start:start + n])
        reference = exact_causal_attention(*(t[0, start:start + n].float() for t in (q, k, v)))
        torch.testing.assert_close(packed[start:start + n].float(), reference, atol=tolerance, rtol=tolerance)
        start += n


def check_gradients(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """The kernels' backward passes (the trainer's, in torch) give the gradients of torch's forward."""
    gen = torch.Generator().manual_seed(2)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()

    lengths = [5, 9, 2]
    reference_attention = DocumentCausalAttention([lengths], torch.device(device), ["flash", "efficient", "math"])
    temperatures = torch.tensor([0.7, 1.0, 1.3], device=device)
    cos, sin = (torch.randn(5, 16, generator=gen).to(device, dtype) for _ in range(2))
    cases = [(batch_invariant.linear, F.linear, (randn(2, 3, 80), randn(96, 80), randn(96))),
             (lambda x, w: batch_invariant.rms_norm(x, w, 1e-6), lambda x, w: rms_norm(x, w, 1e-6), (randn(4, 80), randn(80))),
             (lambda x: batch_invariant.log_softmax(x, temperatures), lambda x: (x / temperatures[:, None]).log_softmax(-1),
              (randn(3, 5000),)),
             (ExactDocumentAttention([lengths]).attend, reference_attention.attend,
              (0, randn(1, 16, 6, 16), randn(1, 16, 2, 16), randn(1, 16, 2, 16))),
             (lambda x, w: residual_norm(x, None, w, 1e-6), lambda x, w: rms_norm(x, w, 1e-6), (randn(4, 80), randn(80))),
             (lambda x, d, w: torch.cat(residual_norm(x, d, w, 1e-6), -1),
              lambda x, d, w: torch.cat([x + d, rms_norm(x + d, w, 1e-6)], -1), (randn(4, 80), randn(4, 80), randn(80))),
             (silu_mul, lambda gu: F.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1], (randn(4, 96),)),
             (lambda q, k, v, qw, kw: torch.cat([t.flatten(1) for t in normed_rotated_tokens(q, k, v, cos, sin, qw, kw, 1e-6, 16)], 1),
              lambda q, k, v, qw, kw: torch.cat([t[0].flatten(1) for t in normed_rotated(q[None], k[None], v[None], cos[None],
                                                                                          sin[None], qw, kw, 1e-6, 16)], 1),
              (randn(5, 64), randn(5, 32), randn(5, 32), randn(16), randn(16)))]
    for kernel, reference, inputs in cases:
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        out = kernel(*inputs)
        upstream = torch.randn(out.shape, generator=gen).to(device, out.dtype)
        got = torch.autograd.grad(out, tensors, upstream)
        expected = torch.autograd.grad(reference(*inputs), tensors, upstream)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=tolerance, rtol=tolerance)


INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
import torch
from test_batch_invariant import check_gradients, check_kernels, check_packed_attention_equals_paged
from triton_interpreter import dots_row_by_row

dots_row_by_row()
check_kernels("cpu", torch.float32, hidden=80, out=96, vocab=5000, tolerance=1e-5)
check_packed_attention_equals_paged("cpu", torch.float32, [5, 9, 1, 3], tolerance=1e-5)
check_gradients("cpu", torch.float32, tolerance=1e-4)
print("ok")
"""


@needs_triton_interpreter
def test_kernels_under_tritons_interpreter_are_batch_invariant():
    script = INTERPRETED.format(tests=str(Path(__file__).parent))
    run_interpreted(script, timeout=300)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and Triton")
def test_kernels_on_cuda_are_batch_invariant_in_bf16():
    """Qwen3-0.6B's shapes (hidden 1024, MLP 3072, a vocabulary chunked unevenly); documents up to three 512-key
    chunks (the split decode's combination)."""
    check_kernels("cuda", torch.bfloat16, hidden=1024, out=3072, vocab=151_936, tolerance=2e-2)
    check_packed_attention_equals_paged("cuda", torch.bfloat16, [700, 1100, 1, 37], tolerance=2e-2)
    check_gradients("cuda", torch.float32, tolerance=1e-3)
