"""The engine's execution of decoder blocks around attention, installed on the model from outside.

Why: `DecoderLayer.forward` (`tandem.models.decoder`) is the reference, shared with the trainer; in
eager mode its norms, RoPE and the cache write are some forty small kernels per block, more GPU
time in a small model's decode step than its matmuls. The engine's version of a block:
    input norm (one kernel) -> q, k, v projections (the model's matmuls)
    -> q/k norms, RoPE, k and v written to their cache slots (one kernel, `block_kernels`)
    -> paged attention over the cache (`PagedAttention.attend_cached`)
    -> o projection -> residual add and post norm (one kernel) -> the block's `mlp` -> residual add.
It runs where the paged-attention kernel serves the step (CUDA, not `[run] exact`); anywhere else
(the CPU, another attention backend, exact mode) the block runs the model's own forward. The
kernels round where the model's torch chain rounds (`block_kernels`), so outputs differ from the
reference only in the order of the norms' sums.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.inference.engine import block_kernels
from tandem.inference.engine.paged_attention import PagedAttention
from tandem.models.attention import AttentionBackend
from tandem.models.decoder import DecoderLayer


def apply_fused_blocks(model: nn.Module) -> int:
    """Give every `DecoderLayer` of `model` the engine's block forward, in place; returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for block in blocks:
        block.forward = functools.partial(fused_block_forward, block)
    return len(blocks)


def fused_block_forward(block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        backend: AttentionBackend) -> torch.Tensor:
    """What `DecoderLayer.forward` computes (x [1, N, hidden]), with the kernels where they serve."""
    if not (isinstance(backend, PagedAttention) and backend.reads_only_the_cache(block.self_attn.head_dim, x.device)
            and block_kernels.is_available(x)):
        return DecoderLayer.forward(block, x, cos, sin, backend)
    norm_weight, wq, bq, wk, bk, wv, bv, q_norm_weight, k_norm_weight = block.before_attention_args()
    x_ND = x[0]
    _, h = block_kernels.rms_norm(x_ND, norm_weight, block.eps)
    q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
    k_cache, v_cache = backend.cache.layer(block.layer_idx)
    q_NHD = block_kernels.qk_norm_rope_write(q, k, v, cos[0], sin[0], q_norm_weight, k_norm_weight, block.eps,
                                             k_cache, v_cache, backend.meta.slot_mapping)
    attended = backend.attend_cached(block.layer_idx, q_NHD)
    wo, bo, post_norm_weight = block.residual_args()
    x_ND, h = block_kernels.rms_norm(x_ND, post_norm_weight, block.eps, delta=F.linear(attended.flatten(1), wo, bo))
    return (x_ND + block.mlp(h[None])[0])[None]
