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
up and down; a mixture of experts' shared experts) and its routed experts (`Fp8Experts`: each expert's
matrices in their own blocks, stacked as the model stacks them). Embeddings, norms, the LM head and routers
keep the model's dtype. A latent-attention block (GLM-5, DeepSeek-V3: `tandem.models.glm_moe_dsa`) holds in FP8
what their released FP8 checkpoints hold in FP8 and the engine multiplies as a plain projection: q_a, q_b (or a
full q), kv_a and o, its DSA indexer's wq_b and wk (not `weights_proj`, bf16 in the releases too), and the
feed-forward's as above. Two exceptions, kept in the model's dtype (an FP8 checkpoint's copy dequantized on load):
- `kv_b_proj`, FP8 on disk: decode never multiplies by it as a projection; its two halves are folded into the
  queries and the attention's output (the absorbed form, `tandem.models.mla`), products with per-head slices that
  a 128 x 128 block layout of the whole matrix does not fit, and prefill expands the cached latents with it;
- the multi-token prediction layers (`model.mtp_layers`): a draft runs them through the model's own forward.

A stacked weight may hold several matrices by rows, each in its own 128-row blocks as its checkpoint stores
it: the experts' `gate_up_proj` holds each expert's gate and up projections (`row_parts`), so that a gate of
64 rows keeps a block of its own, as `experts.N.gate_proj.weight_scale_inv` does on disk.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

import torch
from torch import nn

from tandem.kernels.fp8 import FP8, FP8_MAX, GROUP, INV_FP8_MAX, MIN_AMAX, BlockFp8Weight, expand_scales, fp8_linear
from tandem.models.decoder import DecoderLayer
from tandem.models.glm_moe_dsa import LatentAttentionBlock
from tandem.models.layers import MLP
from tandem.models.moe import MoE
from tandem.models.multi_token import MtpParts
from tandem.models.random_init import initial_value

SCALE_SUFFIX = "_scale_inv"
"""`<name>.weight` + this: the checkpoint's name of a weight's block scales (the experts': `gate_up_proj_scale_inv`)."""


def row_parts(name: str) -> int:
    """How many matrices the weight `name` stacks by rows, each quantized in blocks of its own: 2 for the experts'
    `gate_up_proj` (gate, then up), else 1."""
    return 2 if name.endswith("experts.gate_up_proj") else 1


def quantize_weight(weight: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (float8_e4m3fn [..., N, K], fp32 scale_inv [..., parts * ceil(N / parts / 128),
    ceil(K / 128)]): each block scaled so that its largest magnitude is 448, then rounded to nearest (ties to even);
    `parts`: N is that many matrices stacked by rows, each in blocks of its own. Leading dimensions (experts) are
    quantized one matrix at a time, so that a layer's experts need one expert's fp32 copy, not all of theirs."""
    if weight.dim() > 2:
        pairs = [quantize_weight(matrix, parts) for matrix in weight]
        return torch.stack([q for q, _ in pairs]), torch.stack([scale for _, scale in pairs])
    N, K = weight.shape
    n = N // parts
    rows, cols = -(-n // GROUP), -(-K // GROUP)
    padded = torch.zeros(parts, rows * GROUP, cols * GROUP, dtype=torch.float32, device=weight.device)
    padded[:, :n, :K] = weight.view(parts, n, K)
    blocks = padded.view(parts, rows, GROUP, cols, GROUP)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=MIN_AMAX) * INV_FP8_MAX
    q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(parts, rows * GROUP, cols * GROUP)[:, :n, :K].reshape(N, K)
    return q.contiguous(), scale.view(parts * rows, cols)


def block_rows(num_rows: int, parts: int = 1, device: torch.device | str | None = None) -> torch.Tensor:
    """int32 [num_rows]: the row of `scale_inv` that scales each row of a weight of `parts` matrices stacked by rows."""
    n = num_rows // parts
    rows = torch.arange(num_rows, device=device, dtype=torch.int32)
    return (rows // n) * -(-n // GROUP) + (rows % n) // GROUP


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                      parts: int = 1) -> torch.Tensor:
    """The values a block-FP8 weight [..., N, K] (`parts` matrices stacked by rows) stands for, in `dtype`."""
    if weight.dim() > 2:
        return torch.stack([dequantize_weight(w, s, dtype, parts) for w, s in zip(weight, scale_inv)])
    rows = block_rows(weight.shape[0], parts, weight.device)
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


class Fp8Experts(nn.Module):
    """A mixture of experts' routed experts in FP8 blocks, under `GroupedExperts`' names plus their scales:
    `gate_up_proj` [E, 2I, H] (each expert's gate and up in blocks of their own: `row_parts`) beside
    `gate_up_proj_scale_inv` [E, 2 ceil(I / 128), ceil(H / 128)], `down_proj` [E, H, I] beside `down_proj_scale_inv`
    [E, ceil(H / 128), ceil(I / 128)]. Its forward is `GroupedExperts`' in the scheme of `fp8_linear`, expert by
    expert (the reference; the engine's fused kernels serve on CUDA: `tandem.inference.engine.fused_moe`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.activation_dtype = dtype
        """The model's dtype: what the experts take and give."""
        hidden_blocks, intermediate_blocks = -(-hidden_size // GROUP), -(-intermediate_size // GROUP)
        self.register_buffer("gate_up_proj", torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=FP8))
        self.register_buffer("gate_up_proj_scale_inv", torch.empty(num_experts, 2 * intermediate_blocks, hidden_blocks))
        self.register_buffer("down_proj", torch.empty(num_experts, hidden_size, intermediate_size, dtype=FP8))
        self.register_buffer("down_proj_scale_inv", torch.empty(num_experts, hidden_blocks, intermediate_blocks))

    def expert_weights(self, expert: int) -> tuple[BlockFp8Weight, BlockFp8Weight]:
        """Expert `expert`'s (gate_up, down) as `fp8_linear` takes them."""
        device = self.gate_up_proj.device
        return (BlockFp8Weight(self.gate_up_proj[expert], self.gate_up_proj_scale_inv[expert],
                               block_rows(self.gate_up_proj.shape[1], 2, device)),
                BlockFp8Weight(self.down_proj[expert], self.down_proj_scale_inv[expert],
                               block_rows(self.down_proj.shape[1], 1, device)))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [M, H], rows grouped by expert (`num_tokens_per_expert[e]` rows of expert e, in order) -> [M, H]."""
        outputs = []
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            gate_up, down = self.expert_weights(e)
            gate, up = fp8_linear(rows, gate_up).chunk(2, dim=-1)
            outputs.append(fp8_linear(torch.nn.functional.silu(gate) * up, down))
        return torch.cat(outputs)


LATENT_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
"""A latent attention's projections held in FP8, those it has (`q_proj` without a query rank, else q_a and q_b)."""
INDEXER_PROJECTIONS = ("wq_b", "wk")
"""A DSA indexer's projections held in FP8."""


def quantized_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks whose layers are held in FP8: the `DecoderLayer`s and the latent families' blocks, but not the
    multi-token prediction layers (kept in the model's dtype). By `isinstance`: FSDP gives a trainer's sharded
    blocks classes of their own, subclasses of these."""
    return [m for m in model.modules() if isinstance(m, (DecoderLayer, LatentAttentionBlock)) and not isinstance(m, MtpParts)]


def quantized_linears(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of every linear layer held in FP8: each block's attention projections (a latent
    one's of `LATENT_PROJECTIONS` and its indexer's), and its feed-forward's where that is dense, or its shared
    experts' in a mixture of experts."""
    out = []
    for block in quantized_blocks(model):
        attention = block.self_attn
        if isinstance(block, DecoderLayer):
            out += [(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        else:
            out += [(attention, name) for name in LATENT_PROJECTIONS if hasattr(attention, name)]
            if attention.indexer is not None:
                out += [(attention.indexer, name) for name in INDEXER_PROJECTIONS]
        dense = block.mlp if isinstance(block.mlp, MLP) else getattr(block.mlp, "shared_experts", None)
        if dense is not None:
            out += [(dense, name) for name in ("gate_proj", "up_proj", "down_proj")]
    return out


def quantized_moes(model: nn.Module) -> list[MoE]:
    """The mixtures of experts whose routed experts are held in FP8: those of `quantized_blocks`."""
    return [block.mlp for block in quantized_blocks(model) if isinstance(block.mlp, MoE)]


def fp8_weight_names(model: nn.Module, experts: bool) -> set[str]:
    """The HF names of the weights `convert_to_fp8` holds in FP8 (those of `quantized_linears`, and with `experts` the
    routed experts of `quantized_moes`), read from any model of the family: the trainer's bf16 one names what the
    engine holds in FP8."""
    names = {module: name for name, module in model.named_modules()}
    linears = {f"{names[parent]}.{attr}.weight" for parent, attr in quantized_linears(model)}
    moes = quantized_moes(model) if experts else []
    return linears | {f"{names[moe]}.experts.{attr}" for moe in moes for attr in ("gate_up_proj", "down_proj")}


def quantize_named(tensors: Iterable[tuple[str, torch.Tensor]], names: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with each weight of `names` replaced by its FP8 blocks and, right after, its scales
    (`<name>_scale_inv`), as an FP8 checkpoint holds them and `match_quantization` takes them without quantizing
    again; the others pass as they are. Meta tensors give the quantized shapes and dtypes (an announcement)."""
    for name, tensor in tensors:
        if name in names:
            weight, scale_inv = quantize_weight(tensor, row_parts(name))
            yield name, weight
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor


def convert_to_fp8(model: nn.Module, experts: bool) -> None:
    """Replace the layers of `quantized_linears` by empty `Fp8Linear`s and, with `experts`, the routed experts of
    `quantized_moes` by empty `Fp8Experts` on their device (meant for a model on `meta`, before its weights load; its
    own forward cannot multiply by the linear layers: the engine installs one that can)."""
    for parent, name in quantized_linears(model):
        linear: nn.Linear = getattr(parent, name)
        with torch.device(linear.weight.device):
            setattr(parent, name, Fp8Linear(linear.in_features, linear.out_features, linear.bias))
    for moe in quantized_moes(model) if experts else []:
        held = moe.experts.down_proj
        with torch.device(held.device):
            moe.experts = Fp8Experts(moe.args.num_experts, moe.args.hidden_size, moe.args.intermediate_size, held.dtype)


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
            elif isinstance(module, Fp8Experts):
                for attr in ("gate_up_proj", "down_proj"):
                    held = getattr(module, attr)
                    value = initial_value(f"{name}.{attr}", held.shape, seed, held.device).to(dtype)
                    weight, scale_inv = quantize_weight(value, row_parts(f"{name}.{attr}"))
                    held.copy_(weight)
                    getattr(module, attr + SCALE_SUFFIX).copy_(scale_inv)


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
            out[name], out[scale_name] = ((tensor, state[scale_name]) if fp8
                                          else quantize_weight(tensor.to(target.device), row_parts(name)))
        elif tensor.dtype == FP8:
            out[name] = weight_values(state, name, target.dtype if target is not None else torch.float32, source)
        else:
            out[name] = tensor
    return out


def weight_values(state: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype = torch.float32,
                  source: str | None = None) -> torch.Tensor:
    """`state[name]` as the values it stands for: an FP8 weight dequantized by its `<name>_scale_inv` into `dtype`
    (a missing scale is an error naming `source`), any other tensor as it is. One tensor at a time, so that a
    reader of a released FP8 checkpoint (the trainer) never holds more than one weight dequantized at once."""
    tensor = state[name]
    if tensor.dtype != FP8:
        return tensor
    scale_name = name + SCALE_SUFFIX
    if scale_name not in state:
        raise ValueError(f"{source or 'the weights'}: {name} is FP8 but {scale_name} is missing")
    return dequantize_weight(tensor, state[scale_name], dtype, row_parts(name))
