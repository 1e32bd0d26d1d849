"""A low-rank side path: `sign * scale * (x A^T) B^T` added to chosen token rows of adapted projections.

Two uses. Beside merged weights (`lora_merge`) every row the engine computes is the policy's; serving the base model
beside it (`server.base_model_name`) subtracts each projection's adapter product from the rows of base sequences
only (sign -1): `x W_merged^T - s (x A^T) B^T = x W_base^T` up to rounding, at the cost of two rank-r matmuls over
those rows, while the policy's rows keep their merged weights, kernels and bits. Over a base the engine does not own
(`lora.share_base`: the trainer's tensors, mapped), nothing may be merged into the weights, so the side path adds the
product (sign +1) to the rows of policy sequences, by default every row; base sequences' rows then need nothing.
The rows are the step's token rows (the flattened leading dimensions of a projection's input), set for one forward by
the runner (`rows`: a tensor of rows, `EVERY_ROW` or None) and otherwise `default_rows`: None with sign -1 (a forward
without rows is the model's own), `EVERY_ROW` with sign +1 (so a CUDA graph captured without rows computes the
policy). The adapters live in tensors allocated once (`load` copies into them, `B` pre-multiplied by sign * scale), so
a captured graph reads each update's.

It reaches the engine's forwards where they multiply: the reference block (`corrected_block_forward`, the model's own
`before_attention` / `after_attention` with `linear` = `LowRankSidePath.linear`), every dense feed-forward `MLP`
(the blocks' own and a mixture of experts' shared experts, `corrected_mlp_forward`), and the engine's fused blocks
(`fused_blocks`, their stacked q/k/v and gate/up corrected part by part: `add_to_parts`). A projection outside those
(latent attention, routed experts) cannot take it: `uncovered_projections` names them, and the server refuses to
serve the base there (and a shared base at all).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.decoder import DecoderLayer, after_attention, before_attention
from tandem.models.layers import MLP, swiglu


EVERY_ROW = slice(None)
"""`LowRankSidePath.rows` for a forward whose every token row takes the side path."""


class LowRankSidePath:
    def __init__(self, linears: dict[str, nn.Linear], scale: float, sign: float, rank: int, device: torch.device,
                 dtype: torch.dtype):
        """`linears`: the adapted projections by module name; `sign * scale` multiplies every adapter's product."""
        self.factor = sign * scale
        self.corrects_base = sign < 0
        """Whose rows take the side path: base sequences' (sign -1, beside merged weights) or the policy's (sign +1)."""
        self.default_rows = None if self.corrects_base else EVERY_ROW
        self._names = {id(module.weight): f"{name}.weight" for name, module in linears.items()}
        """A projection's weight (the very tensor the model's forward passes to `linear`) -> its HF weight name."""
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            f"{name}.weight": (torch.zeros(rank, module.in_features, device=device, dtype=dtype),
                               torch.zeros(module.out_features, rank, device=device, dtype=dtype))
            for name, module in linears.items()}
        """HF weight name -> (A [r, in], B [out, r] times `factor`) on the device, at fixed addresses; zero (nothing to
        add) before the first update."""
        self.rows: torch.Tensor | slice | None = self.default_rows
        """The token rows of the running forward that get the side path: a tensor of rows, `EVERY_ROW`, or None."""
        self._stacks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """The first weight of projections stacked into one matmul (`stack`) -> their adapters as one pair."""

    def stack(self, linears: list[nn.Linear]) -> None:
        """Hold the adapters of `linears`, projections the engine multiplies as one stacked matrix, as one `A`
        [k * r, in] and one block-diagonal `B` [sum of outs, k * r] (each projection's own pair a view of them, so
        `load` fills both), so that `add_to_parts` adds all k products in two matmuls instead of 2k: fewer kernels
        in every step of a policy over a shared base. The zero blocks add exact zeros. Nothing where not all of
        `linears` are adapted."""
        names = [self._names.get(id(linear.weight)) for linear in linears]
        if any(name not in self.adapters for name in names):
            return
        pairs = [self.adapters[name] for name in names]
        rank, first_a = pairs[0][0].shape[0], pairs[0][0]
        a = first_a.new_zeros(len(pairs) * rank, first_a.shape[1])
        b = first_a.new_zeros(sum(pair[1].shape[0] for pair in pairs), len(pairs) * rank)
        start = 0
        for i, (name, (_, part_b)) in enumerate(zip(names, pairs)):
            end = start + part_b.shape[0]
            self.adapters[name] = (a[i * rank:(i + 1) * rank], b[start:end, i * rank:(i + 1) * rank])
            start = end
        self._stacks[id(linears[0].weight)] = (a, b)

    def load(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy this update's adapters (by the weight they adapt) into the side path's tensors, in the model's dtype,
        as the merge multiplies them (`tandem.models.lora.adapted_weight`)."""
        for name, (lora_a, lora_b) in pairs.items():
            a, b = self.adapters[name]
            a.copy_(lora_a)
            b.copy_(lora_b.to(b.device, b.dtype) * self.factor)

    def add_to(self, linear: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += factor * (x[rows] A^T) B^T, in place, for `linear`'s adapter (y = the projection of x, or its
        columns of a stacked projection); nothing without rows or adapter."""
        self._add(self._names.get(id(linear.weight)), x, y)

    def add_to_parts(self, linears: list[nn.Linear], x: torch.Tensor, y: torch.Tensor) -> None:
        """`add_to` for projections stacked into one matmul (y's columns: each projection's outputs, in order)."""
        stacked = self._stacks.get(id(linears[0].weight))
        if stacked is not None:
            self._add_pair(stacked, x, y)
            return
        start = 0
        for linear in linears:
            end = start + linear.out_features
            self.add_to(linear, x, y[..., start:end])
            start = end

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear` plus the side path of the projection whose weight this is (the model's forward passes its
        projections' weights, not the modules)."""
        y = F.linear(x, weight, bias)
        self._add(self._names.get(id(weight)), x, y)
        return y

    def _add(self, name: str | None, x: torch.Tensor, y: torch.Tensor) -> None:
        pair = self.adapters.get(name) if name is not None else None
        if pair is not None:
            self._add_pair(pair, x, y)

    def _add_pair(self, pair: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> None:
        if self.rows is None:
            return
        lora_a, lora_b = pair
        if self.rows is EVERY_ROW:
            low = F.linear(x, lora_a)
            if y.dim() == 2:
                y.addmm_(low, lora_b.t())  # the product and the sum in one kernel
            else:
                y.add_(F.linear(low, lora_b))
            return
        x_rows = x.reshape(-1, x.shape[-1]).index_select(0, self.rows)
        delta = F.linear(F.linear(x_rows, lora_a), lora_b)
        y.view(-1, y.shape[-1]).index_add_(0, self.rows, delta.to(y.dtype))


def covered_projections(model: nn.Module) -> set[str]:
    """Names of the projections the side path reaches: a `DecoderLayer`'s q/k/v/o and every `MLP`'s gate/up/down."""
    covered = set()
    for name, module in model.named_modules():
        if isinstance(module, DecoderLayer):
            covered |= {f"{name}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        elif isinstance(module, MLP):
            covered |= {f"{name}.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    return covered


def uncovered_projections(model: nn.Module, adapted: dict[str, nn.Linear]) -> list[str]:
    """The adapted projections no forward of the side path reaches (where the base cannot be served)."""
    return sorted(set(adapted) - covered_projections(model))


def apply_side_path(model: nn.Module, side: LowRankSidePath, blocks: bool) -> None:
    """Give every `MLP` of `model` the side path, and with `blocks` every `DecoderLayer` (where no fused block forward
    is installed: the fused one takes the side path itself), in place."""
    for module in model.modules():
        if isinstance(module, MLP):
            module.forward = functools.partial(corrected_mlp_forward, module, side)
        elif blocks and isinstance(module, DecoderLayer):
            module.forward = functools.partial(corrected_block_forward, module, side)


def corrected_mlp_forward(mlp: MLP, side: LowRankSidePath, x: torch.Tensor) -> torch.Tensor:
    if side.rows is None:
        return MLP.forward(mlp, x)
    return swiglu(x, *mlp.tensor_args(), linear=side.linear)


def corrected_block_forward(block: DecoderLayer, side: LowRankSidePath, x: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, backend) -> torch.Tensor:
    """`DecoderLayer.forward`, its projections through `side.linear` while rows are set."""
    if side.rows is None:
        return DecoderLayer.forward(block, x, cos, sin, backend)
    q, k, v = before_attention(x, cos, sin, *block.before_attention_args(), block.eps, block.self_attn.head_dim,
                               linear=side.linear)
    attended = backend.attend(block.layer_idx, q, k, v)
    return after_attention(x, attended, *block.residual_args(), block.eps, block.mlp, linear=side.linear)
