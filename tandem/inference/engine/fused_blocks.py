"""The engine's execution of decoder blocks around attention, installed on the model from outside.

Why: `DecoderLayer.forward` (`tandem.models.decoder`) is the reference, shared with the trainer; in
eager mode its norms, RoPE and the cache write are many small kernels per block (about forty by the ops
in the code; not counted by a profiler), more GPU time in a small model's decode step than its matmuls. The engine's version of a block:
    input norm (one kernel) -> q, k, v projections (one matmul: the three weights stacked)
    -> q/k norms, RoPE, k and v written to their cache slots (one kernel, `pointwise`)
    -> attention over the cache (`CachedAttention.attend_cached`: the engine's paged attention)
    -> o projection -> residual add and post norm (one kernel)
    -> the block's `mlp` (a dense one: gate and up as one matmul, then silu(gate) * up in one kernel)
    -> residual add.
It runs where the paged-attention kernel serves the step (CUDA, not `[run] exact`); anywhere else
(the CPU, another attention backend, exact mode) the block runs the model's own forward. The
kernels round where the model's torch chain rounds (`pointwise`), so outputs differ from the
reference only in the order of sums (the norms', and the stacked matmuls': cuBLAS picks its
algorithm by shape) and in the last bits of silu's exp.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import pointwise
from tandem.models.attention import AttentionBackend, CachedAttention
from tandem.models.decoder import DecoderLayer
from tandem.models.stacked_projections import SharedInputProjections, stack_projections


def apply_fused_blocks(model: nn.Module) -> int:
    """Give every `DecoderLayer` of `model` the engine's block forward, in place; returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    with torch.no_grad():
        for block in blocks:
            block.forward = functools.partial(fused_block_forward, block, stack_projections(block))
    return len(blocks)


def fused_block_forward(block: DecoderLayer, stacked: SharedInputProjections, x: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    """What `DecoderLayer.forward` computes (x [1, N, hidden]), with the kernels where they serve."""
    if not (isinstance(backend, CachedAttention) and backend.reads_only_the_cache(block.self_attn.head_dim, x.device)
            and pointwise.is_available(x)):
        return DecoderLayer.forward(block, x, cos, sin, backend)
    norm_weight, *_, q_norm_weight, k_norm_weight = block.before_attention_args()
    x_ND = x[0]
    _, h = pointwise.rms_norm(x_ND, norm_weight, block.eps)
    q, k, v = F.linear(h, stacked.qkv, stacked.qkv_bias).split(stacked.qkv_sizes, dim=-1)
    q_NHD = pointwise.qk_norm_rope_write(q, k, v, cos[0], sin[0], q_norm_weight, k_norm_weight, block.eps,
                                             *backend.cache_slots(block.layer_idx))
    attended = backend.attend_cached(block.layer_idx, q_NHD)
    wo, bo, post_norm_weight = block.residual_args()
    x_ND, h = pointwise.rms_norm(x_ND, post_norm_weight, block.eps, delta=F.linear(attended.flatten(1), wo, bo))
    if stacked.gate_up is None:
        return (x_ND + block.mlp(h[None])[0])[None]
    hidden = pointwise.silu_mul(F.linear(h, stacked.gate_up))  # `layers.swiglu`, its gate and up as one matmul
    return (x_ND + F.linear(hidden, block.mlp.down_proj.weight))[None]
