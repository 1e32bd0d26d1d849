"""On CUDA: packed rows never attend across documents. Variable-length FlashAttention over a
packed row gives what cuDNN / flash SDPA gives for each document alone, forward and backward."""

from __future__ import annotations

import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.config.trainer import KernelsConfig, ParallelConfig
from tandem.models.attention import DocumentCausalAttention
from tandem.trainer.model import build_policy
from tandem.trainer.parallel.dims import close_parallel, init_parallel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BACKENDS = KernelsConfig().sdpa_backends


def test_packed_attention_equals_separate_documents_in_value_and_gradient():
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [300, 1000, 77, 671]  # Qwen3-0.6B's heads: 16 query, 8 key/value, 128 dims
    q = torch.randn(1, sum(lengths), 16, 128, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, sum(lengths), 8, 128, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    upstream = torch.randn(q.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    packed_attention = DocumentCausalAttention([lengths], torch.device("cuda"), BACKENDS)
    assert packed_attention.cu_seqlens is not None  # the varlen kernel, not the per-document loop
    packed = packed_attention.attend(0, q, k, v)
    packed_grads = torch.autograd.grad((packed * upstream).sum(), [q, k, v])

    pieces, start = [], 0
    for n in lengths:
        doc = slice(start, start + n)
        pieces.append(DocumentCausalAttention([[n]], torch.device("cuda"), BACKENDS).attend(0, q[:, doc], k[:, doc], v[:, doc]))
        start += n
    separate = torch.cat(pieces, dim=1)
    separate_grads = torch.autograd.grad((separate * upstream).sum(), [q, k, v])

    torch.testing.assert_close(packed, separate, rtol=2e-2, atol=2e-2)
    for mine, ref in zip(packed_grads, separate_grads):
        torch.testing.assert_close(mine, ref, rtol=5e-2, atol=5e-2)
    # A document's first token attends only to itself: its output is its own value, exactly.
    first = [0, 300, 1300, 1377]
    groups = torch.arange(16, device="cuda") // 2
    torch.testing.assert_close(packed[0, first], v[0, first][:, groups], rtol=0, atol=0)


def test_packed_row_logprobs_equal_separate_rows(tiny_model):
    dims = init_parallel("cuda")
    try:
        policy, hf_config = build_policy(ModelConfig(name=str(tiny_model), dtype="bfloat16"), ParallelConfig(), dims,
                                         chunk_size=64, kernels=KernelsConfig(compile="off"))
        gen = torch.Generator().manual_seed(1)
        lengths = [90, 33, 140]
        seqs = [torch.randint(0, hf_config["vocab_size"], (1, n), generator=gen).cuda() for n in lengths]

        def logprobs(ids_list):
            ids = torch.cat(ids_list, dim=1)
            pos = torch.cat([torch.arange(s.shape[1]) for s in ids_list])[None].cuda()
            mask = pos != 0
            with torch.no_grad():
                return policy(ids, pos, torch.full(ids.shape, 0.8, device="cuda"), mask).logprobs

        packed, start = logprobs(seqs), 0
        for seq in seqs:
            n = seq.shape[1]
            torch.testing.assert_close(packed[:, start:start + n], logprobs([seq]), rtol=0, atol=3e-2)
            start += n
    finally:
        close_parallel()
