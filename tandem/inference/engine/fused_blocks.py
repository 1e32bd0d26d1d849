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
(the CPU, another attention backend, exact mode) the block runs the model's own forward. With a side path
(`lora_side_path`: the base model served beside a LoRA policy) each projection's output, or each part of a stacked
one, gets its low-rank term on the rows the step names; without rows the block is the one above. The
kernels round where the model's torch chain rounds (`pointwise`), so outputs differ from the
reference only in the order of sums (the norms', and the stacked matmuls': cuBLAS picks its
algorithm by shape) and in the last bits of silu's exp.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.inference.engine.lora_side_path import LowRankSidePath, corrected_block_forward
from tandem.kernels import pointwise
from tandem.models.attention import AttentionBackend, CachedAttention
from tandem.models.decoder import DecoderLayer
from tandem.models.layers import MLP
from tandem.models.stacked_projections import SharedInputProjections, stack_projections


def apply_fused_blocks(model: nn.Module, side: LowRankSidePath | None = None) -> int:
    """Give every `DecoderLayer` of `model` the engine's block forward, in place; returns how many. `side`: the
    low-rank side path its projections take on the rows a step names."""
    blocks = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    with torch.no_grad():
        for block in blocks:
            block.forward = functools.partial(fused_block_forward, block, stack_projections(block), side)
            if side is not None and not side.corrects_base:  # over a shared base, every step: stacked adapters too
                side.stack([block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj])
                if isinstance(block.mlp, MLP):
                    side.stack([block.mlp.gate_proj, block.mlp.up_proj])
    return len(blocks)


def fused_block_forward(block: DecoderLayer, stacked: SharedInputProjections, side: LowRankSidePath | None,
                        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    """What `DecoderLayer.forward` computes (x [1, N, hidden]), with the kernels where they serve."""
    if not (isinstance(backend, CachedAttention) and backend.reads_only_the_cache(block.self_attn.head_dim, x.device)
            and pointwise.is_available(x)):
        if side is not None:
            return corrected_block_forward(block, side, x, cos, sin, backend)
        return DecoderLayer.forward(block, x, cos, sin, backend)
    side = side if side is not None and side.rows is not None else None
    attention = block.self_attn
    norm_weight, *_, q_norm_weight, k_norm_weight = block.before_attention_args()
    x_ND = x[0]
    _, h = pointwise.rms_norm(x_ND, norm_weight, block.eps)
    qkv = F.linear(h, stacked.qkv, stacked.qkv_bias)
    if side is not None:
        side.add_to_parts([attention.q_proj, attention.k_proj, attention.v_proj], h, qkv)
    q, k, v = qkv.split(stacked.qkv_sizes, dim=-1)
    q_NHD = pointwise.qk_norm_rope_write(q, k, v, cos[0], sin[0], q_norm_weight, k_norm_weight, block.eps,
                                             *backend.cache_slots(block.layer_idx))
    attended = backend.attend_cached(block.layer_idx, q_NHD)
    wo, bo, post_norm_weight = block.residual_args()
    attended = attended.flatten(1)
    o = F.linear(attended, wo, bo)
    if side is not None:
        side.add_to(attention.o_proj, attended, o)
    x_ND, h = pointwise.rms_norm(x_ND, post_norm_weight, block.eps, delta=o)
    if stacked.gate_up is None:
        return (x_ND + block.mlp(h[None])[0])[None]  # a mixture of experts: its shared `MLP` takes the side path itself
    gate_up = F.linear(h, stacked.gate_up)
    if side is not None:
        side.add_to_parts([block.mlp.gate_proj, block.mlp.up_proj], h, gate_up)
    hidden = pointwise.silu_mul(gate_up)  # `layers.swiglu`, its gate and up as one matmul
    down = F.linear(hidden, block.mlp.down_proj.weight)
    if side is not None:
        side.add_to(block.mlp.down_proj, hidden, down)
    return (x_ND + down)[None]
