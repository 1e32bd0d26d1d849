"""The trainer's forward of a native Qwen3 block: `DecoderLayer.forward`'s math, split at attention.

    x -> before_attention (input norm, q/k/v projections, q/k norms, RoPE) -> q, k, v
      -> the attention backend (cuDNN or varlen FlashAttention; never recomputed)
      -> after_attention (o projection, residual, post norm, SwiGLU MLP, residual) -> x

The halves are plain functions of tensors, so that
- `torch.compile` fuses their pointwise work (fp32 norms, RoPE, SiLU) once for every layer
  (`tandem.trainer.compiled`), instead of eager's one kernel and one fp32 copy per op;
- `selective` activation checkpointing recomputes the halves in backward and keeps only each
  block's input, q, k, v and the attention output. The recompute costs the forward matmuls of
  the blocks (a third of their dense FLOPs), never attention, whose cost grows with the square
  of the document length. For Qwen3-0.6B in bf16 that keeps 14 KiB per token and block (by
  count: x 2, q 4, k 2, v 2, output 4) instead of about 38 KiB without checkpointing.

The ops are those of `tandem.models.qwen3`, in the same order (tested equal in eager mode);
compiled, they round differently only where inductor keeps fused intermediates in fp32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem.models.attention import AttentionBackend
from tandem.models.qwen3 import DecoderLayer, apply_rope
from tandem.trainer.compiled import compiled, mark_dynamic


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`tandem.models.qwen3.RMSNorm.forward` as a function: fp32 statistics, cast back, then the weight."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def before_attention(x: torch.Tensor, norm_weight: torch.Tensor, wq: torch.Tensor, bq: torch.Tensor | None,
                     wk: torch.Tensor, bk: torch.Tensor | None, wv: torch.Tensor, bv: torch.Tensor | None,
                     q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, hidden] -> q [B, T, Hq, D], k and v [B, T, Hkv, D] (head counts from the weight shapes)."""
    B, T, _ = x.shape
    D = q_norm_weight.shape[0]
    h = rms_norm(x, norm_weight, eps)
    q = rms_norm(F.linear(h, wq, bq).view(B, T, -1, D), q_norm_weight, eps)
    k = rms_norm(F.linear(h, wk, bk).view(B, T, -1, D), k_norm_weight, eps)
    v = F.linear(h, wv, bv).view(B, T, -1, D)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def after_attention(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None,
                    norm_weight: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """x [B, T, hidden] and the attention output [B, T, Hq, D] -> the block's output [B, T, hidden]."""
    B, T, _ = x.shape
    x = x + F.linear(attended.reshape(B, T, -1), wo, bo)
    h = rms_norm(x, norm_weight, eps)
    return x + F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)


def training_forward(block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                     *, compile: bool, recompute: bool) -> torch.Tensor:
    """`block.forward(x, cos, sin, backend)` for training; `recompute`: selective checkpointing."""
    attn, mlp = block.self_attn, block.mlp
    before = compiled(before_attention) if compile else before_attention
    after = compiled(after_attention) if compile else after_attention

    # The weights are read from the block at call time, also in the recompute: FSDP swaps the
    # block's parameters between their sharded and gathered forms around forward and backward.
    def run_before(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if compile:
            mark_dynamic(1, x, cos, sin)
        return before(x, block.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
                      attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias, attn.q_norm.weight, attn.k_norm.weight,
                      cos, sin, block.input_layernorm.eps)

    def run_after(x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        if compile:
            mark_dynamic(1, x, attended)
        return after(x, attended, attn.o_proj.weight, attn.o_proj.bias, block.post_attention_layernorm.weight,
                     mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, block.post_attention_layernorm.eps)

    if recompute:  # no randomness in a block: no RNG state to stash
        q, k, v = checkpoint(run_before, x, cos, sin, use_reentrant=False, preserve_rng_state=False)
    else:
        q, k, v = run_before(x, cos, sin)
    attended = backend.attend(attn.layer_idx, q, k, v)
    if recompute:
        return checkpoint(run_after, x, attended, use_reentrant=False, preserve_rng_state=False)
    return run_after(x, attended)


def apply_training_blocks(blocks: nn.ModuleList, compile: bool, recompute: bool) -> None:
    """Give each native block the training forward, in place (parameter names do not change)."""
    for block in blocks:
        if not isinstance(block, DecoderLayer):
            raise TypeError(f"the training block forward needs tandem's Qwen3 blocks, got {type(block).__name__}")
        block.forward = functools.partial(training_forward, block, compile=compile, recompute=recompute)
