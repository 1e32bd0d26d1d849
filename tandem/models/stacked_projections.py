"""A decoder block's projections that read the same input, as one matrix each: one matmul, not two or three.

The engine stacks them once (`stack_projections`: the layers' parameters become views of the stacked
tensors, so in-place weight updates reach them and the model's own forward still sees its `nn.Linear`s; where they
already are consecutive rows of one tensor, as in a base shared by the trainer (`stacked_groups`), that tensor is the
stack and nothing is copied);
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
    weights = [linear.weight.detach() for linear in linears]
    biases = [linear.bias for linear in linears]
    if _consecutive_rows(weights) and (all(b is None for b in biases) or _consecutive_rows([b.detach() for b in biases])):
        bias = None if biases[0] is None else _spanning(biases[0].detach(), sum(b.shape[0] for b in biases))
        return _spanning(weights[0], sum(w.shape[0] for w in weights)), bias
    weight = torch.cat(weights)
    bias = _stacked_bias([linear.bias for linear in linears], detach=True)
    start = 0
    for linear in linears:
        end = start + linear.weight.shape[0]
        linear.weight.data = weight[start:end]
        if bias is not None:
            linear.bias.data = bias[start:end]
        start = end
    return weight, bias


def _consecutive_rows(tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` (contiguous, of one storage) follow each other in memory, rows after rows."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:] for t in tensors):
        return False
    if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in tensors):
        return False
    return all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(tensors, tensors[1:]))


def _spanning(first: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The view of `num_rows` rows from `first`'s first row on."""
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (num_rows, *first.shape[1:]))


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


def stacked_groups(model: nn.Module) -> list[list[str]]:
    """The HF names of the parameters `stack_projections` stacks, group by group (each block's q/k/v weights, their
    biases, a dense feed-forward's gate/up weights): a layout that places each group's members end to end
    (`tandem.transport.shared_base`) lets the engine stack them without a copy."""
    groups = []
    for name, block in model.named_modules():
        if not isinstance(block, DecoderLayer):
            continue
        qkv = [f"{name}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        groups.append([f"{p}.weight" for p in qkv])
        if block.self_attn.q_proj.bias is not None:
            groups.append([f"{p}.bias" for p in qkv])
        if isinstance(block.mlp, MLP):
            groups.append([f"{name}.mlp.gate_proj.weight", f"{name}.mlp.up_proj.weight"])
    return groups


def concatenated_projections(block: DecoderLayer) -> SharedInputProjections:
    """The trainer's: the block's current parameters (FSDP swaps them per forward) concatenated, differentiably."""
    linears = _qkv_linears(block)
    qkv = torch.cat([projection_weight(linear) for linear in linears])
    gate_up = (torch.cat([projection_weight(block.mlp.gate_proj), projection_weight(block.mlp.up_proj)])
               if isinstance(block.mlp, MLP) else None)
    return SharedInputProjections(qkv=qkv, qkv_bias=_stacked_bias([linear.bias for linear in linears]),
                                  qkv_sizes=tuple(linear.weight.shape[0] for linear in linears), gate_up=gate_up)
