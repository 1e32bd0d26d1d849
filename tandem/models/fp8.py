"""FP8 weights in 128 x 128 blocks: quantizing, dequantizing, the checkpoint format, the layers that hold them.

The format is the one released FP8 checkpoints use (DeepSeek-V3, Qwen3-*-FP8): `config.json` says
`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`, and each quantized linear layer stores `<name>.weight` in float8_e4m3fn
beside `<name>.weight_scale_inv`, fp32 [ceil(out / 128), ceil(in / 128)], a block's value being its FP8
values times its scale. `Fp8Linear` holds a layer under those same names, so such a checkpoint loads by
name like any other; `match_quantization` makes any state fit the precision a model holds each weight
in, which is how bf16 weights (a bf16 checkpoint, the trainer's updates through a folder) reach an FP8 layer
and FP8 ones reach a bf16 layer. A broadcast update arrives quantized already: the trainer runs the same
`quantize_weight` on the same bf16 values before sending (`quantize_named`), so the engine holds what it would
have made itself, for half the bytes on the wire.

Which layers: the dense projections of each decoder block (q, k, v, o; a dense feed-forward's gate,
up and down). Embeddings, norms, the LM head, routers and experts keep the model's dtype.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

import torch
from torch import nn

from tandem.kernels.fp8 import FP8, FP8_MAX, GROUP, INV_FP8_MAX, MIN_AMAX, BlockFp8Weight, expand_scales
from tandem.models.decoder import DecoderLayer
from tandem.models.layers import MLP
from tandem.models.random_init import initial_value

SCALE_SUFFIX = "_scale_inv"
"""`<name>.weight` + this: the checkpoint's name of a weight's block scales."""

def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N / 128), ceil(K / 128)]): each block scaled so
    that its largest magnitude is 448, then rounded to nearest (ties to even)."""
    N, K = weight.shape
    rows, cols = -(-N // GROUP), -(-K // GROUP)
    padded = torch.zeros(rows * GROUP, cols * GROUP, dtype=torch.float32, device=weight.device)
    padded[:N, :K] = weight
    blocks = padded.view(rows, GROUP, cols, GROUP)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) * INV_FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * GROUP, cols * GROUP)[:N, :K].contiguous(), scale


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a block-FP8 weight stands for, in `dtype`."""
    rows = torch.arange(weight.shape[0], device=weight.device) // GROUP
    return (weight.float() * expand_scales(scale_inv, rows, weight.shape[1])).to(dtype)


class Fp8Linear(nn.Module):
    """A linear layer's weight in FP8 blocks, under `nn.Linear`'s names plus `weight_scale_inv`. It only holds them:
    the engine's block forward multiplies with them (`tandem.inference.engine.fp8_blocks`)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("weight_scale_inv", torch.empty(-(-out_features // GROUP), -(-in_features // GROUP)))
        self.bias = bias
        """The layer's bias, kept in the model's dtype."""


def quantized_linears(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of every layer held in FP8: each block's attention projections, and its
    feed-forward's where that is dense."""
    out = []
    for block in (m for m in model.modules() if isinstance(m, DecoderLayer)):
        out += [(block.self_attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if isinstance(block.mlp, MLP):
            out += [(block.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]
    return out


def fp8_weight_names(model: nn.Module) -> set[str]:
    """The HF names of the weights `convert_to_fp8` holds in FP8 (those of `quantized_linears`), read from any model
    of the family: the trainer's bf16 one names what the engine holds in FP8."""
    names = {module: name for name, module in model.named_modules()}
    return {f"{names[parent]}.{attr}.weight" for parent, attr in quantized_linears(model)}


def quantize_named(tensors: Iterable[tuple[str, torch.Tensor]], names: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with each weight of `names` replaced by its FP8 blocks and, right after, its scales
    (`<name>_scale_inv`), as an FP8 checkpoint holds them and `match_quantization` takes them without quantizing
    again; the others pass as they are. Meta tensors give the quantized shapes and dtypes (an announcement)."""
    for name, tensor in tensors:
        if name in names:
            weight, scale_inv = quantize_weight(tensor)
            yield name, weight
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor


def convert_to_fp8(model: nn.Module) -> None:
    """Replace the layers of `quantized_linears` by empty `Fp8Linear`s on their device (meant for a model on
    `meta`, before its weights load; its own forward cannot multiply by them: the engine installs one that can)."""
    for parent, name in quantized_linears(model):
        linear: nn.Linear = getattr(parent, name)
        with torch.device(linear.weight.device):
            setattr(parent, name, Fp8Linear(linear.in_features, linear.out_features, linear.bias))


def init_fp8_weights(model: nn.Module, seed: int, dtype: torch.dtype) -> None:
    """Random FP8 layers (`load_format = "dummy"`): the values a `dtype` layer would get (`random_init`), quantized,
    as the trainer's first update of the same weights would arrive."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Fp8Linear):
                value = initial_value(f"{name}.weight", module.weight.shape, seed, module.weight.device).to(dtype)
                weight, scale_inv = quantize_weight(value)
                module.weight.copy_(weight)
                module.weight_scale_inv.copy_(scale_inv)


def stack_fp8_rows(linears: list[Fp8Linear]) -> tuple[BlockFp8Weight, torch.Tensor | None]:
    """One block-FP8 weight (and bias) holding the rows of `linears`, whose tensors become views of it (weight
    updates copied into them reach it). Each layer keeps its own 128-row blocks; `scale_rows` maps to them."""
    weight = torch.cat([linear.weight for linear in linears])
    scale_inv = torch.cat([linear.weight_scale_inv for linear in linears])
    biases = [linear.bias for linear in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("projections stacked into one matmul must all have a bias or none")
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    scale_rows, row, block = [], 0, 0
    for linear in linears:
        n, blocks = linear.weight.shape[0], linear.weight_scale_inv.shape[0]
        scale_rows.append(block + torch.arange(n, device=weight.device, dtype=torch.int32) // GROUP)
        linear.weight = weight[row:row + n]
        linear.weight_scale_inv = scale_inv[block:block + blocks]
        if bias is not None:
            linear.bias.data = bias[row:row + n]
        row, block = row + n, block + blocks
    return BlockFp8Weight(weight, scale_inv, torch.cat(scale_rows)), bias


def match_quantization(held: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                       source: str | None = None) -> dict[str, torch.Tensor]:
    """`state` (HF names) in the precision `held` (the model's state dict) keeps each weight: a weight the model
    holds in FP8 arrives quantized (with its scales) or is quantized here; an FP8 weight of a layer the model
    holds in its own dtype is dequantized to it. An FP8 weight without its scales is an error naming `source`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        scale_name = name + SCALE_SUFFIX
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in state:
            continue  # taken with its weight
        target = held.get(name)
        if tensor.dtype == FP8 and scale_name not in state:
            raise ValueError(f"{source or 'the weights'}: {name} is FP8 but {scale_name} is missing")
        if target is not None and target.dtype == FP8:  # quantized where the model is (a folder is read on the CPU)
            fp8 = tensor.dtype == FP8
            out[name], out[scale_name] = (tensor, state[scale_name]) if fp8 else quantize_weight(tensor.to(target.device))
        elif tensor.dtype == FP8:
            out[name] = dequantize_weight(tensor, state[scale_name], target.dtype if target is not None else torch.float32)
        else:
            out[name] = tensor
    return out
