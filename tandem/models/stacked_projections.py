"""A decoder block's projections that read the same input, as one matrix each: one matmul, not two or three.

The engine stacks them once (`stack_projections`: the layers' parameters become views of the stacked
tensors, so in-place weight updates reach them and the model's own forward still sees its `nn.Linear`s);
the trainer in exact mode concatenates them at each forward (`concatenated_projections`: its parameters stay
its own), so both multiply by the same matrix and get the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.models.decoder import DecoderLayer
from tandem.models.layers import MLP, projection_weight


@dataclass
class SharedInputProjections:
    qkv: torch.Tensor
    """[Hq * D + 2 * Hkv * D, hidden]: q_proj, k_proj, v_proj."""
    qkv_bias: torch.Tensor | None
    qkv_sizes: tuple[int, int, int]
    gate_up: torch.Tensor | None
    """[2 * intermediate, hidden]: a dense feed-forward's gate_proj and up_proj; None for other feed-forwards."""


def stack_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the rows of `linears`, whose parameters become views of it."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = _stacked_bias([linear.bias for linear in linears], detach=True)
    start = 0
    for linear in linears:
        end = start + linear.weight.shape[0]
        linear.weight.data = weight[start:end]
        if bias is not None:
            linear.bias.data = bias[start:end]
        start = end
    return weight, bias


def _stacked_bias(biases: list[torch.Tensor | None], detach: bool = False) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("projections stacked into one matmul must all have a bias or none")
    return torch.cat([b.detach() if detach else b for b in biases])


def _qkv_linears(block: DecoderLayer) -> list[nn.Linear]:
    attention = block.self_attn
    return [attention.q_proj, attention.k_proj, attention.v_proj]


def stack_projections(block: DecoderLayer) -> SharedInputProjections:
    """The engine's: stacked once, the block's parameters made views of the stacks."""
    linears = _qkv_linears(block)
    qkv, qkv_bias = stack_rows(linears)
    gate_up = stack_rows([block.mlp.gate_proj, block.mlp.up_proj])[0] if isinstance(block.mlp, MLP) else None
    sizes = tuple(linear.weight.shape[0] for linear in linears)
    return SharedInputProjections(qkv=qkv, qkv_bias=qkv_bias, qkv_sizes=sizes, gate_up=gate_up)


def concatenated_projections(block: DecoderLayer) -> SharedInputProjections:
    """The trainer's: the block's current parameters (FSDP swaps them per forward) concatenated, differentiably."""
    linears = _qkv_linears(block)
    qkv = torch.cat([projection_weight(linear) for linear in linears])
    gate_up = (torch.cat([projection_weight(block.mlp.gate_proj), projection_weight(block.mlp.up_proj)])
               if isinstance(block.mlp, MLP) else None)
    return SharedInputProjections(qkv=qkv, qkv_bias=_stacked_bias([linear.bias for linear in linears]),
                                  qkv_sizes=tuple(linear.weight.shape[0] for linear in linears), gate_up=gate_up)
