"""The trainer's forward of a native block: `tandem.models.decoder`'s halves, compiled and checkpointed.

    x -> before_attention -> q, k, v -> the attention backend (never recomputed) -> after_attention -> x

The halves are the model's own functions of tensors (`DecoderLayer.forward` calls the same ones),
so that
- `torch.compile` fuses their pointwise work (fp32 norms, RoPE, SiLU) once for every layer
  (`tandem.trainer.dynamic_compile`), instead of eager's one kernel and one fp32 copy per op;
- `selective` activation checkpointing recomputes the halves in backward and keeps only each
  block's input, q, k, v and the attention output. The recompute costs the forward matmuls of
  the blocks (a third of their dense FLOPs), never attention, whose cost grows with the square
  of the document length. For Qwen3-0.6B in bf16 that keeps 14 KiB per token and block (by
  count: x 2, q 4, k 2, v 2, output 4) instead of about 38 KiB without checkpointing.

The feed-forward is the block's `mlp`: one whose `tensor_function` is set (dense SwiGLU) is
compiled into the second half; one without (a mixture of experts: shapes depend on routing) runs
eagerly after the compiled `attention_residual`. Compiled, the halves keep eager mode's bf16 roundings
(`tandem.models.eager_rounding`), as the engine's kernels do.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem.models.attention import AttentionBackend
from tandem.models.decoder import DecoderLayer, Linear, after_attention, attention_residual, before_attention
from tandem.trainer.dynamic_compile import compiled, mark_dynamic


def training_forward(block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                     *, compile: bool, recompute: bool, linear: Linear = F.linear) -> torch.Tensor:
    """`block.forward(x, cos, sin, backend)` for training; `recompute`: selective checkpointing; `linear`: how the
    projections of the halves (a dense feed-forward's included) are computed (`tandem.trainer.float8`)."""
    mlp = block.mlp
    dense = mlp.tensor_function is not None
    # The weights are read from the block at call time, also in the recompute: FSDP swaps the
    # block's parameters between their sharded and gathered forms around forward and backward.
    return halves_forward(x, cos, sin, backend, block.layer_idx, block.eps, block.self_attn.head_dim,
                          block.before_attention_args, block.residual_args,
                          feed_forward_with(mlp.tensor_function, linear) if dense else None,
                          mlp.tensor_args if dense else lambda: (), None if dense else mlp, compile=compile, recompute=recompute,
                          linear=linear)


def halves_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend, layer_idx: int,
                   eps: float, head_dim: int, before_args: Callable[[], tuple], residual_args: Callable[[], tuple],
                   feed_forward: Callable[..., torch.Tensor] | None, ffn_args: Callable[[], tuple],
                   eager_mlp: Callable[[torch.Tensor], torch.Tensor] | None, *, compile: bool, recompute: bool,
                   linear: Linear = F.linear) -> torch.Tensor:
    """A block's two halves around attention, its weights read by `before_args()`, `residual_args()` and
    `ffn_args()` when each half runs. The feed-forward is `feed_forward(h, *ffn_args())` inside the second half,
    or (None) `eager_mlp(h)` after it; `compile`: each half a compiled graph of its own; `linear`: the halves'
    own projections (`feed_forward` brings its own: `feed_forward_with`)."""
    before = compiled(before_attention) if compile else before_attention
    after = compiled(after_attention) if compile and feed_forward is not None else after_attention
    residual = compiled(attention_residual) if compile else attention_residual

    def run_before(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if compile:
            mark_dynamic(1, x, cos, sin)
        return before(x, cos, sin, *before_args(), eps, head_dim, linear)

    def run_after(x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        if compile:
            mark_dynamic(1, x, attended)
        if feed_forward is not None:
            return after(x, attended, *residual_args(), eps, feed_forward, *ffn_args(), linear=linear)
        x, h = residual(x, attended, *residual_args(), eps, linear)
        return x + eager_mlp(h)

    if recompute:  # no randomness in a block: no RNG state to stash
        q, k, v = checkpoint(run_before, x, cos, sin, use_reentrant=False, preserve_rng_state=False)
    else:
        q, k, v = run_before(x, cos, sin)
    attended = backend.attend(layer_idx, q, k, v)
    if recompute:
        return checkpoint(run_after, x, attended, use_reentrant=False, preserve_rng_state=False)
    return run_after(x, attended)


@functools.cache
def feed_forward_with(feed_forward: Callable[..., torch.Tensor], linear: Linear) -> Callable[..., torch.Tensor]:
    """`feed_forward` computing its projections by `linear`: one object per pair, so a compiled half guards on one."""
    return feed_forward if linear is F.linear else functools.partial(feed_forward, linear=linear)


def apply_training_blocks(blocks: nn.ModuleList, compile: bool, recompute: bool, linear: Linear = F.linear) -> None:
    """Give each native block the training forward, in place (parameter names do not change)."""
    for block in blocks:
        if not isinstance(block, DecoderLayer):
            raise TypeError(f"the training block forward needs tandem's decoder blocks, got {type(block).__name__}")
        block.forward = functools.partial(training_forward, block, compile=compile, recompute=recompute, linear=linear)
