"""Training attention: each document of a packed row attends only to itself, with no mask tensor."""

from __future__ import annotations

import pytest
import torch

from tandem.models.attention import DocumentCausalAttention, PackedCausalAttention, document_lengths

BACKENDS = ["cudnn", "flash", "efficient", "math"]


def causal_reference(q, k, v):
    """Plain softmax attention of one document, [T, H, D] inputs, key/value heads repeated."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    T = q.shape[0]
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_packed_documents_attend_as_if_alone():
    gen = torch.Generator().manual_seed(0)
    rows = [[5, 9, 2], [16]]
    q = torch.randn(2, 16, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 16, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out = DocumentCausalAttention(rows, torch.device("cpu"), BACKENDS).attend(0, q, k, v)
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            doc = slice(start, start + n)
            torch.testing.assert_close(out[b, doc], causal_reference(q[b, doc], k[b, doc], v[b, doc]))
            start += n


def test_same_result_as_the_dense_mask_of_position_ids():
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([list(range(7)) + list(range(3)) + list(range(6))])
    q = torch.randn(1, 16, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 16, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    lengths = [document_lengths(positions[0].tolist())]
    assert lengths == [[7, 3, 6]]
    mine = DocumentCausalAttention(lengths, torch.device("cpu"), BACKENDS).attend(0, q, k, v)
    torch.testing.assert_close(mine, PackedCausalAttention(positions).attend(0, q, k, v))


def test_bad_inputs_are_refused_with_their_name():
    with pytest.raises(ValueError, match="start with position 0"):
        document_lengths([1, 2, 0])
    with pytest.raises(ValueError, match="unknown SDPA backends \\['fast'\\]"):
        DocumentCausalAttention([[4]], torch.device("cpu"), ["cudnn", "fast"])
