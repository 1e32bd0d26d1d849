"""Batch-invariant computation, for `[run] exact = true`: a token's numbers never depend on its neighbours.

The engine computes a token inside whatever batch the scheduler formed (prefill chunks beside decodes,
other sequences); the trainer computes it inside a packed row. Their kernels pick reduction orders, and
vector or scalar code paths for transcendental functions, from the shapes they are given, so the same
token gets different roundings. Here every part runs on tensors whose shapes depend only on the token:

- blocks: `before_attention` and `after_attention` (norms, projections, RoPE, feed-forward) one token at a
  time, on [1, 1, hidden] tensors (`exact_block_forward`), and the final norm likewise;
- attention: `exact_attention`, one query token against exactly its context keys, [context, heads, dim],
  the same routine for the engine's paged cache and the trainer's packed rows;
- the head: `exact_logprobs`, one row of logits at a time, log_softmax(logits / T) in fp32.

Both processes install it with `apply_exact` and pass `exact=True` to their attention backend and head
(the engine's sampler computes its logprobs with `exact_logprobs` too). Tested bitwise on the CPU in fp32,
dense and mixture-of-experts models (`tests/trainer/test_exact_parity.py`). On CUDA the same torch ops run
(without CUDA graphs, compiled norms or the fused sampling kernel); that case of the test skips without a
GPU and has not run yet. Cost: one kernel call per token and operation, so this is for checking and small
runs; a fast GPU path would replace the per-token calls by fixed-tile Triton kernels (a matmul whose K loop
does not depend on M, attention with a fixed KV split) that keep each token's reduction order.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.attention import AttentionBackend
from tandem.models.decoder import DecoderLayer, after_attention, before_attention
from tandem.models.layers import RMSNorm, rms_norm


def exact_block_forward(block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        backend: AttentionBackend) -> torch.Tensor:
    """`block.forward` with every token computed alone (x [1, N, hidden])."""
    eps, head_dim = block.eps, block.self_attn.head_dim
    args = block.before_attention_args()
    parts = [before_attention(x[:, t:t + 1], cos[:, t:t + 1], sin[:, t:t + 1], *args, eps, head_dim) for t in range(x.shape[1])]
    q, k, v = (torch.cat(p, dim=1) for p in zip(*parts))
    attended = backend.attend(block.layer_idx, q, k, v)
    residual = block.residual_args()
    return torch.cat([after_attention(x[:, t:t + 1], attended[:, t:t + 1], *residual, eps, block.mlp)
                      for t in range(x.shape[1])], dim=1)


def exact_norm_forward(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The final norm, one token at a time (x [1, N, hidden])."""
    return torch.cat([rms_norm(x[:, t:t + 1], norm.weight, norm.eps) for t in range(x.shape[1])], dim=1)


def apply_exact(lm: nn.Module) -> None:
    """Give a native causal LM (`tandem.models.decoder.DecoderLM`) the batch-invariant forward, in place."""
    for block in lm.layers:
        if not isinstance(block, DecoderLayer):
            raise TypeError(f"exact mode needs tandem's decoder blocks, got {type(block).__name__}")
        block.forward = functools.partial(exact_block_forward, block)
    lm.model.norm.forward = functools.partial(exact_norm_forward, lm.model.norm)


def exact_attention(q_HD: torch.Tensor, k_CKD: torch.Tensor, v_CKD: torch.Tensor) -> torch.Tensor:
    """One query token q [H, D] against its whole context k, v [C, Hkv, D] (C = its position + 1): [H, D].

    Shapes and layouts depend only on the token's position, so its reduction orders and code paths do too."""
    group = q_HD.shape[0] // k_CKD.shape[1]
    k_HCD = k_CKD.repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
    v_HCD = v_CKD.repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
    scores = (k_HCD.float() * q_HD.float()[:, None]).sum(-1) * (1.0 / math.sqrt(q_HD.shape[-1]))  # [H, C]
    p = scores.softmax(-1)
    return (p[:, :, None] * v_HCD.float()).sum(1).to(q_HD.dtype)


def exact_causal_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, num_cached: int = 0,
                           k_cached: torch.Tensor | None = None, v_cached: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T consecutive tokens of one sequence, after `num_cached` earlier ones whose keys and
    values are `k_cached`, `v_cached` [num_cached, Hkv, D]: [T, H, D], each token by `exact_attention`."""
    if num_cached:
        k_THD, v_THD = torch.cat([k_cached, k_THD]), torch.cat([v_cached, v_THD])
    return torch.stack([exact_attention(q_THD[t], k_THD[:num_cached + t + 1], v_THD[:num_cached + t + 1])
                        for t in range(q_THD.shape[0])])


def exact_logits(hidden_ND: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head one row at a time: [N, V] in the weight's dtype."""
    rows = [F.linear(hidden_ND[i:i + 1], weight, bias) for i in range(hidden_ND.shape[0])]
    return torch.cat(rows) if rows else hidden_ND.new_empty(0, weight.shape[0], dtype=weight.dtype)


def exact_logprobs(logits_V: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) of one row in fp32 (T: a 0-d fp32 tensor), as both sides compute it."""
    return (logits_V.float()[None] / temperature).log_softmax(-1)[0]


class ExactDocumentAttention:
    """The trainer's attention backend in exact mode: each document of each packed row by
    `exact_causal_attention` (row_lengths[b]: the document lengths of row b)."""

    def __init__(self, row_lengths: list[list[int]]):
        self.row_lengths = row_lengths

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows = []
        for b, lengths in enumerate(self.row_lengths):
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            rows.append(torch.cat([exact_causal_attention(q[b, s:s + n], k[b, s:s + n], v[b, s:s + n])
                                   for s, n in zip(starts, lengths)]))
        return torch.stack(rows)


def check_exact(hf_config: dict, source: str) -> None:
    """Refuse what exact mode cannot honour, saying why (the config's resolve step says it first, by key)."""
    from tandem.models.loading import is_native

    if not is_native(hf_config):
        raise ValueError(f"`run.exact` needs a model native to tandem; {source} says model_type "
                         f"{hf_config.get('model_type')!r}, which falls back to transformers, whose kernels are not batch-invariant")


def exact_token_logprobs(hidden_ND: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                         temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's head in exact mode: (logprob of each target, entropy) [N] fp32, row by row as the engine
    computes the sampled token's logprob (differentiable; holds [N, V] fp32, fine at exact mode's sizes)."""
    logits = exact_logits(hidden_ND, weight, bias)
    logp = torch.stack([exact_logprobs(logits[i], temperatures[i]) for i in range(logits.shape[0])])
    entropy = -(logp.exp() * logp).sum(-1).detach()
    return logp.gather(-1, targets[:, None])[:, 0], entropy
