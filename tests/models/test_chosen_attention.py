"""`tandem.models.chosen_attention`: attention over each query's chosen entries, forward and backward, against dense
attention under the mask those choices make, through autograd."""

from __future__ import annotations

import pytest
import torch

from tandem.models.chosen_attention import attend_chosen

B, T, S, H, F, V, K = 2, 13, 17, 3, 10, 6, 5


def choices(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct positions [B, T, K] into S entries, the first 1 to K of each query kept (as a top-k ranks them)."""
    positions = torch.rand(B, T, S, generator=generator).argsort(dim=-1)[..., :K]
    counts = torch.randint(1, K + 1, (B, T), generator=generator)
    counts[0, 0], counts[1, 1] = 1, K
    return positions, torch.arange(K) < counts[..., None]


def masked_attention(q: torch.Tensor, entries: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense attention of q [B, T, H, F] over every entry [B, S, F] where mask [B, T, S]: [B, T, H, V]."""
    scores = torch.einsum("bthf,bsf->bths", q, entries) * scale
    p = scores.masked_fill(~mask[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bths,bsv->bthv", p, entries[..., :V])


@pytest.mark.parametrize("max_pairs", [1, 3 * K, 10**6], ids=["one-query-a-slice", "three-a-slice", "all-at-once"])
def test_outputs_and_gradients_equal_dense_attention_under_the_mask(max_pairs):
    """fp64: outputs, and the gradients of queries and entries (an entry chosen by several queries sums theirs),
    within 1e-12 of autograd through the dense masked attention; chosen positions a query does not keep take no part."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, F, dtype=torch.float64, generator=generator, requires_grad=True)
    entries = torch.randn(B, S, F, dtype=torch.float64, generator=generator, requires_grad=True)
    positions, kept = choices(generator)
    mask = torch.zeros(B, T, S, dtype=torch.bool).scatter_(-1, positions, kept)
    weights = torch.randn(B, T, H, V, dtype=torch.float64, generator=generator)

    got = attend_chosen(q, entries, positions, kept, 0.3, V, max_pairs)
    (got * weights).sum().backward()
    grads = q.grad.clone(), entries.grad.clone()
    q.grad = entries.grad = None
    expected = masked_attention(q, entries, mask, 0.3)
    (expected * weights).sum().backward()

    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(grads[0], q.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(grads[1], entries.grad, atol=1e-12, rtol=0)
    kept_by = torch.zeros(B, S).scatter_add_(1, positions.flatten(1), kept.flatten(1).float())
    assert (mask.sum(-1) < K).any() and (kept_by > 1).any()  # queries keeping fewer; entries several queries keep


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_bf16_inputs_give_bf16_outputs_and_gradients_near_the_fp32_ones(device):
    """The trainer's dtype: bf16 products with fp32 softmax statistics and an fp32 sum of the entries' gradient,
    within bf16 rounding of the fp32 computation."""
    generator = torch.Generator().manual_seed(1)
    q32 = torch.randn(B, T, H, F, generator=generator).to(device)
    e32 = torch.randn(B, S, F, generator=generator).to(device)
    positions, kept = (x.to(device) for x in choices(generator))
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        q, entries = (x.to(dtype).clone().requires_grad_() for x in (q32, e32))
        out = attend_chosen(q, entries, positions, kept, 0.3, V, 2 * K)
        out.float().square().sum().backward()
        assert out.dtype == q.grad.dtype == entries.grad.dtype == dtype
        results.append((out.float(), q.grad.float(), entries.grad.float()))
    for full, half in zip(*results):
        torch.testing.assert_close(half, full, atol=0.05 * full.abs().max().item(), rtol=0.02)
