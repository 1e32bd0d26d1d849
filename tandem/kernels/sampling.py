"""Sampling as one Triton kernel: a pass over each row of logits draws the token and its logprob.

Why: on a decode batch of a 150k-token vocabulary the torch sampler writes and rereads several
[B, V] float32 tensors (scaled logits, log-softmax, probabilities, noise) in a dozen launches;
this reads the (bfloat16) logits once. Each program takes one slice of a row's vocabulary and
walks it in chunks, keeping an online log-sum-exp of x = logit / T and the argmax of x + Gumbel
noise (the Gumbel-max trick: an exact draw from softmax(x), the same law as the torch sampler's
exponential race); a second tiny kernel combines the slices of each row. The noise is counter-based (Philox: `tl.rand(seed, row * V + token)`), so a step needs no
generator state on the device and the host only picks a fresh `seed` per step.

Scope: rows without top-k / top-p / min-p, without a seed of their own and without top
logprobs; the sampler sends other batches through its torch path. A greedy row (T = 0) takes the
argmax and reports the T = 1 logprob, as the torch path does.

Reference: the sampler's torch path (`tandem.inference.engine.sampler`): softmax(logits / T) and its logprob.
Tests: `tests/kernels/test_sampling.py` (CUDA).
"""

from __future__ import annotations

import torch


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the sampler's torch path serves every batch
    triton = None


def is_available(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda


if triton is not None:

    # The seed changes every step: no compiled variant per value class of it (a stall each time one is new).
    @triton.jit(do_not_specialize=["seed"])
    def _sample_split_kernel(logits_ptr, inv_temp_ptr, noise_ptr, part_ptr, vocab, stride_row, split_len, seed,
                             SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """One (row, vocabulary split): its max, sum of exp, and best (x + noise, x, token)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        inv_temp = tl.load(inv_temp_ptr + row)
        use_noise = tl.load(noise_ptr + row) != 0
        offsets = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max of x
        s = tl.zeros([BLOCK], tl.float32)  # per lane: sum of exp(x - m)
        best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best x + noise
        best_x = tl.zeros([BLOCK], tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        base = logits_ptr + row.to(tl.int64) * stride_row
        lo = split * split_len
        hi = tl.minimum(lo + split_len, vocab)
        for start in range(lo, hi, BLOCK):
            idx = start + offsets
            ok = idx < hi
            x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.where(ok, tl.exp(x - m_safe), 0.0)
            m = m_new
            u = tl.maximum(tl.rand(seed, row * vocab + idx), 1e-20)
            gumbel = -tl.log(-tl.log(u))
            score = tl.where(ok, x + tl.where(use_noise, gumbel, 0.0), float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_x = tl.where(better, x, best_x)
            best_i = tl.where(better, idx, best_i)
        part_max = tl.max(m, 0)
        part_sum = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - part_max)), 0)
        winner = tl.argmax(best, 0)
        lane = offsets == winner
        out = part_ptr + (row * SPLITS + split) * 5
        tl.store(out, part_max)
        tl.store(out + 1, part_sum)
        tl.store(out + 2, tl.max(best, 0))
        tl.store(out + 3, tl.sum(tl.where(lane, best_x, 0.0), 0))
        tl.store(out + 4, tl.sum(tl.where(lane, best_i, 0), 0).to(tl.float32))

    @triton.jit
    def _sample_combine_kernel(part_ptr, tokens_ptr, logprobs_ptr, SPLITS: tl.constexpr):
        """Per row: log-sum-exp over the splits, and the split whose best score wins."""
        row = tl.program_id(0)
        k = tl.arange(0, SPLITS)
        part = part_ptr + (row * SPLITS + k) * 5
        part_max = tl.load(part)
        part_sum = tl.load(part + 1)
        best = tl.load(part + 2)
        row_max = tl.max(part_max, 0)
        lse = row_max + tl.log(tl.sum(part_sum * tl.exp(part_max - row_max), 0))
        winner = tl.argmax(best, 0)
        chosen_x = tl.sum(tl.where(k == winner, tl.load(part + 3), 0.0), 0)
        token = tl.sum(tl.where(k == winner, tl.load(part + 4), 0.0), 0)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, chosen_x - lse)


def sampling_inputs(temperatures: list[float]) -> tuple[list[float], list[bool]]:
    """The kernel's per-row inputs from the rows' temperatures: 1 / T (1 for greedy rows), and whether to add noise."""
    return [1.0 / t if t > 0 else 1.0 for t in temperatures], [t > 0 for t in temperatures]


SPLITS = 16
"""Vocabulary splits per row: at decode batch sizes one program per row, each walking a whole vocabulary, leaves
most of the GPU idle; 16 x B programs fill it."""


def sample(logits: torch.Tensor, inv_temp: torch.Tensor, noise: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B] (int64, what the next step's input ids are) and their logprobs under softmax(logits / T) [B] (float32), on the device.

    `logits` [B, V] (any float dtype); `inv_temp` [B] float32 holds 1 / T (1 for greedy rows) and `noise` [B] int8
    is 0 for greedy rows (T = 0: the argmax and its T = 1 logprob), both on the logits' device (`sampling_inputs`).
    """
    rows, vocab = logits.shape
    assert vocab < 2**24, "token ids travel between the kernels as float32"
    device = logits.device
    parts = torch.empty(rows, SPLITS, 5, dtype=torch.float32, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _sample_split_kernel[(rows, SPLITS)](logits, inv_temp, noise, parts, vocab, logits.stride(0), -(-vocab // SPLITS), seed,
                                         SPLITS=SPLITS, BLOCK=1024, num_warps=4)
    _sample_combine_kernel[(rows,)](parts, tokens, logprobs, SPLITS=SPLITS, num_warps=1)
    return tokens, logprobs
