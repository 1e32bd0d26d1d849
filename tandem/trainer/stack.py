"""Every block of a dense model at one rank as one compiled graph: the host launches a pass, not 28 x 4 pieces.

Why: compiled per block (`tandem.trainer.block`), each block costs the host, per pass, two compiled calls (guards,
AOTAutograd's wrappers), two checkpointed regions (Python hooks that recompute in backward) and an eager attention
call. On a small model's short steps that host time, not the GPU's work, sets the step's length
(`benchmarks/results/trainer-h200-2026-12-04-one-rank-profile-4096.json` per block,
`benchmarks/results/trainer-h200-2026-12-04-stack-profile-4096.json` as one graph). One graph over every block is
one call in forward and one in backward; the selective recompute becomes the partitioner's (the checkpointed halves
are traced as such), attention an op in it.

Where it applies (`stack_applies`): native blocks whose feed-forward is a function of tensors (dense: a mixture of
experts routes tokens eagerly), one rank without FSDP (whose hooks gather and free each block's weights around its
call), no context parallelism, `selective` or no activation checkpointing (`full` wraps each block module), not
exact. The weights enter the graph as inputs, never as a module's attributes, so one graph serves every model of
these shapes in the process; the row length is dynamic, and so, after their first change, are the number and the
longest length of packed documents (a second compile, then none). A batch whose attention would loop over document
lengths known on the host (packed rows on a CPU or in fp32: `DocumentCausalAttention.traceable`) runs the blocks one
by one, each compiled alone, rather than compile a graph per packing; so does a forward without gradients (the
preflight's probe, an evaluation), rare enough that a second whole-stack compile (no backward: another graph)
would cost more than it saves.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.attention import AttentionBackend, DocumentCausalAttention
from tandem.models.decoder import DecoderLayer, DecoderLM, Linear
from tandem.trainer.block import feed_forward_with, halves_forward
from tandem.trainer.dynamic_compile import compiled, mark_dynamic

BlockWeights = tuple[tuple, tuple, tuple]
"""One block's tensors: `before_attention`'s, `attention_residual`'s and its feed-forward's (`tensor_args`)."""


def stack_applies(blocks: nn.ModuleList) -> bool:
    """Whether every block is a native block with a feed-forward of tensors (see the module's docstring for the
    other conditions, which the caller knows)."""
    return (all(isinstance(b, DecoderLayer) and b.mlp.tensor_function is not None for b in blocks)
            and len({b.mlp.tensor_function for b in blocks}) == 1)


def run_stack(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend, weights: list[BlockWeights],
              layers: list[tuple[int, float, int]], feed_forward: Callable[..., torch.Tensor], recompute: bool,
              linear: Linear = F.linear) -> torch.Tensor:
    """x through every block; `layers[i]`: block i's (layer_idx, eps, head_dim); `recompute`: selective checkpointing;
    `linear`: the blocks' projections."""
    for (before, residual, ffn), (layer_idx, eps, head_dim) in zip(weights, layers):
        x = halves_forward(x, cos, sin, backend, layer_idx, eps, head_dim, lambda w=before: w, lambda w=residual: w,
                           feed_forward, lambda w=ffn: w, None, compile=False, recompute=recompute, linear=linear)
    return x


def apply_compiled_stack(lm: DecoderLM, recompute: bool, linear: Linear = F.linear) -> None:
    """Run `lm`'s blocks as one compiled graph (`run_stack`) where the batch allows, in place; the blocks keep their
    own training forward for the batches that do not (and for names: parameters do not move); `linear`: the blocks'
    projections, as their own training forward has them."""
    blocks = lm.layers
    if not stack_applies(blocks):
        raise ValueError("the compiled stack needs native blocks with a dense feed-forward")
    layers = [(b.layer_idx, b.eps, b.self_attn.head_dim) for b in blocks]
    feed_forward = feed_forward_with(blocks[0].mlp.tensor_function, linear)
    one_by_one = functools.partial(DecoderLM.run_layers, lm)

    def run_layers(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        if not (torch.is_grad_enabled() and isinstance(backend, DocumentCausalAttention) and backend.traceable(h.dtype)):
            return one_by_one(h, cos, sin, backend)
        mark_dynamic(1, h, cos, sin)
        mark_dynamic(0, backend.cu_seqlens)
        # Read now, as the blocks' own forward reads them: the one-rank path swaps compute copies in and out.
        weights = [(b.before_attention_args(), b.residual_args(), b.mlp.tensor_args()) for b in blocks]
        return compiled(run_stack)(h, cos, sin, backend, weights, layers, feed_forward, recompute, linear)

    lm.run_layers = run_layers
