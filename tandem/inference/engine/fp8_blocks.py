"""The engine's decoder blocks with FP8 projections (`engine.quantization = "fp8"`), installed from outside.

Why a block forward of its own: the model's `DecoderLayer.forward` multiplies by its layers' `.weight`
with `F.linear`, and an FP8 layer (`tandem.models.fp8.Fp8Linear`) needs its block scales and activations
quantized per token (`tandem.kernels.fp8.fp8_linear`). The block here computes what the model's does
with every dense projection in block FP8: q, k and v as one stacked matmul, o, and a dense feed-forward's
gate and up as one matmul, then down. A mixture of experts' feed-forward runs as the model's (the
engine's `fused_moe` kernels, on FP8 experts: `tandem.models.fp8.Fp8Experts`), its shared experts given the
dense feed-forward's FP8 forward (`fp8_feed_forward`).

A latent-attention block (GLM-5, DeepSeek-V3: `tandem.models.glm_moe_dsa.LatentAttentionBlock`) keeps its
attention's own code, which calls its projections as modules: q_a and kv_a, which both read the block's normed
input, become one stacked FP8 product (the attention's `input_projections`), each other FP8 projection (q_b, the
indexer's wq_b and wk) is given a forward multiplying in block FP8, and the block's forward
(`fp8_latent_block_forward`) takes over from o_proj on, with the feed-forward's FP8 forward as above. `kv_b_proj` stays in the model's dtype
(`tandem.models.fp8` says why), as do the multi-token prediction layers.

On CUDA with the engine's paged cache (and `kernels`), the pointwise work around the matmuls runs as
`fused_blocks` runs it (`tandem.kernels.pointwise`); anywhere else (the CPU) the model's own functions
compute it and the FP8 products run as torch's dequantized reference of the scheme: slow, but the
same numbers up to the order of the sums. On CUDA each stacked weight's product takes the implementation and
tiles of `engine.fp8_tile_table` (else the table shipped for the GPU, else a rule: `tandem.kernels.fp8_tiles`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import pointwise
from tandem.kernels import fp8_tiles
from tandem.kernels.fp8 import (MIN_CAPABILITY, SCALED_MM_ROWS, BlockFp8Weight, fp8_linear, fp8_product, kernel_serves,
                                scaled_mm_serves)
from tandem.models.attention import AttentionBackend, CachedAttention
from tandem.models.decoder import DecoderLayer, after_attention, attention_residual, normed_rotated
from tandem.models.dsa import SparseContext
from tandem.models.fp8 import Fp8Linear, quantized_blocks, stack_fp8_rows
from tandem.models.glm_moe_dsa import LatentAttentionBlock
from tandem.models.layers import MLP, rms_norm
from tandem.models.moe import MoE


@dataclass
class Fp8Projections:
    """A block's FP8 projections, stacked where they read the same input; the layers' tensors are views of these."""

    qkv: BlockFp8Weight
    qkv_bias: torch.Tensor | None
    qkv_sizes: tuple[int, int, int]
    o: BlockFp8Weight
    o_bias: torch.Tensor | None
    gate_up: BlockFp8Weight | None
    """A dense feed-forward's gate and up projections; None for a mixture of experts."""
    down: BlockFp8Weight | None


def check_fp8_device(device: torch.device, key: str = "engine.quantization", off: str = "none") -> None:
    """Refuse, at engine start, a GPU whose FP8 kernels cannot run (no FP8 tensor cores and conversions, or no
    Triton) for the setting `key` = 'fp8' (FP8 weights, or the FP8 KV cache; `off`: the key's other value)."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise ValueError(f"`{key}` = 'fp8' needs a GPU of compute capability {MIN_CAPABILITY[0]}."
                         f"{MIN_CAPABILITY[1]} or newer (FP8 tensor cores); {torch.cuda.get_device_name(device)} has "
                         f"{major}.{minor}: set `{key}` = {off!r}")
    if not kernel_serves(device):
        raise ValueError(f"`{key}` = 'fp8' on CUDA needs Triton, which is not installed")


def fp8_projections(block: DecoderLayer) -> Fp8Projections:
    attention = block.self_attn
    parts = [attention.q_proj, attention.k_proj, attention.v_proj]
    sizes = tuple(linear.out_features for linear in parts)
    qkv, qkv_bias = stack_fp8_rows(parts)
    o, o_bias = stack_fp8_rows([attention.o_proj])
    gate_up = down = None
    if isinstance(getattr(block.mlp, "down_proj", None), Fp8Linear):
        gate_up = stack_fp8_rows([block.mlp.gate_proj, block.mlp.up_proj])[0]
        down = stack_fp8_rows([block.mlp.down_proj])[0]
    return Fp8Projections(qkv, qkv_bias, sizes, o, o_bias, gate_up, down)


Product = tuple[BlockFp8Weight, torch.Tensor | None]
"""An FP8 weight and its bias (None: none), as `choose_products` warms them."""


def apply_fp8_blocks(model: nn.Module, kernels: bool, tile_table: str | None = None, max_tokens: int | None = None) -> int:
    """Give every block of `model` whose layers `tandem.models.fp8.convert_to_fp8` converted (`quantized_blocks`) the
    FP8 block forward, in place; `kernels`: the pointwise kernels where they serve. Where the FP8 kernels serve, each
    product's choices come from `tile_table` (`engine.fp8_tile_table`; `choose_products`), compiled for products of up
    to `max_tokens` rows (None: none now). Returns how many blocks."""
    blocks = quantized_blocks(model)
    products: list[Product] = []
    with torch.no_grad():
        for block in blocks:
            if isinstance(block, LatentAttentionBlock):
                products += apply_fp8_latent_block(block, kernels)
            else:
                proj = fp8_projections(block)
                block.forward = functools.partial(fp8_block_forward, block, proj, kernels)
                products += [(proj.qkv, proj.qkv_bias), (proj.o, proj.o_bias)]
                products += [(proj.gate_up, None), (proj.down, None)] if proj.gate_up is not None else []
            shared = block.mlp.shared_experts if isinstance(block.mlp, MoE) else None
            if shared is not None:
                products += give_fp8_feed_forward(shared, kernels)
        if products and kernel_serves(products[0][0].weight.device):
            choose_products(products, blocks[0].post_attention_layernorm.weight.dtype, tile_table, max_tokens)
    return len(blocks)


def give_fp8_feed_forward(mlp: MLP, kernels: bool) -> list[Product]:
    """`mlp` (FP8 layers) computes `fp8_feed_forward` of its gate and up stacked, then down; returns both products."""
    gate_up, down = stack_fp8_rows([mlp.gate_proj, mlp.up_proj])[0], stack_fp8_rows([mlp.down_proj])[0]
    mlp.forward = functools.partial(fp8_feed_forward, gate_up, down, kernels)
    return [(gate_up, None), (down, None)]


def apply_fp8_latent_block(block: LatentAttentionBlock, kernels: bool) -> list[Product]:
    """A latent block's FP8 layers computed by `fp8_linear` over their blocks (which updates reach: the layers'
    tensors are views of them): q_a (or q) and kv_a stacked as the attention's `input_projections`, the others as
    their own forwards; and the block's forward `fp8_latent_block_forward`. Returns the block's products."""
    attention = block.self_attn
    inputs = [attention.q_proj if attention.q_lora_rank is None else attention.q_a_proj, attention.kv_a_proj_with_mqa]
    weight, bias = stack_fp8_rows(inputs)
    sizes = [linear.out_features for linear in inputs]
    attention.input_projections = functools.partial(fp8_split_product, weight, bias, sizes)
    products: list[Product] = [(weight, bias)]
    for linear in attention.modules():
        if isinstance(linear, Fp8Linear) and not any(linear is held for held in (*inputs, attention.o_proj)):
            weight, bias = stack_fp8_rows([linear])
            linear.forward = functools.partial(fp8_linear, weight=weight, bias=bias)
            products.append((weight, bias))
    if isinstance(block.mlp, MLP):
        products += give_fp8_feed_forward(block.mlp, kernels)
    o, o_bias = stack_fp8_rows([block.self_attn.o_proj])
    block.forward = functools.partial(fp8_latent_block_forward, block, o, o_bias)
    return products + [(o, o_bias)]


def choose_products(products: list[Product], dtype: torch.dtype,
                    tile_table: str | None, max_tokens: int | None) -> None:
    """Set each weight's `tiles` (its product's implementation and tiles by token count) from `tile_table`, else the
    table shipped for this GPU, else the rule; then run each choice once for products of up to `max_tokens` rows of
    `dtype` (with the weight's bias, if any).

    Why run them now: Triton compiles a kernel variant on its first launch. Decode batches are warmed by the CUDA-graph
    captures, but prefill steps run eagerly, and a table gives each range of token counts its own tiles: without this,
    the first prefill in each range would stall serving for a compile."""
    device = products[0][0].weight.device
    if tile_table is not None:
        path, source = Path(tile_table), "`engine.fp8_tile_table`"
    else:  # CPU runs (Triton's interpreter) have no GPU's table
        shipped = fp8_tiles.shipped_table_path(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        path, source = (shipped if shipped is not None and shipped.is_file() else None), "the shipped FP8 tile table"
    chosen: dict[tuple[int, int, bool], fp8_tiles.ProductTiles] = {}
    warmed: set[tuple[int, int, bool, bool]] = set()
    for weight, bias in products:
        (num_rows, num_columns), served = weight.weight.shape, scaled_mm_serves(weight)
        key = (num_rows, num_columns, served)
        if key not in chosen:
            chosen[key] = fp8_tiles.ProductTiles.load(path, num_rows, num_columns, source, served)
        weight.tiles = chosen[key]
        if max_tokens is not None and (*key, bias is not None) not in warmed:
            warmed.add((*key, bias is not None))
            for count in weight.tiles.variant_token_counts(max_tokens):
                fp8_linear(torch.zeros(count, num_columns, dtype=dtype, device=device), weight, bias)


def fp8_split_product(weight: BlockFp8Weight, bias: torch.Tensor | None, sizes: list[int],
                      x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One block-FP8 product of x by projections stacked by rows, split back into each one's output."""
    return fp8_linear(x, weight, bias).split(sizes, dim=-1)


def fp8_latent_block_forward(block: LatentAttentionBlock, o: BlockFp8Weight, o_bias: torch.Tensor | None,
                             x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                             sparse: SparseContext | None = None, selection: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `LatentAttentionBlock.forward` computes, o_proj in block FP8 (the attention's projections and the
    feed-forward multiply in FP8 through their own forwards)."""
    attended, selection = block.attention_output(x, cos, sin, backend, sparse, selection)
    x = after_attention(x, attended, o, o_bias, block.post_attention_layernorm.weight, block.eps, block.mlp,
                        linear=fp8_linear)
    return x, selection


def fp8_feed_forward(gate_up: BlockFp8Weight, down: BlockFp8Weight, kernels: bool, h: torch.Tensor) -> torch.Tensor:
    """A SwiGLU feed-forward of block-FP8 projections (a dense block's, or a mixture of experts' shared experts):
    h [..., H] -> [..., H]; `kernels`: SiLU(gate) * up by the pointwise kernel where it serves (rows of h 2-D)."""
    gate_up_out = fp8_linear(h, gate_up)
    if kernels and h.dim() == 2 and pointwise.is_available(h):
        return fp8_linear(pointwise.silu_mul(gate_up_out), down)
    gate, up = gate_up_out.chunk(2, dim=-1)
    return fp8_linear(F.silu(gate) * up, down)


def fp8_block_forward(block: DecoderLayer, proj: Fp8Projections, kernels: bool, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    """What `DecoderLayer.forward` computes (x [1, N, hidden]), its projections in block FP8."""
    eps, head_dim, layer = block.eps, block.self_attn.head_dim, block.layer_idx
    norm_weight, *_, q_norm_weight, k_norm_weight = block.before_attention_args()
    post_norm_weight = block.post_attention_layernorm.weight
    if (kernels and isinstance(backend, CachedAttention) and backend.reads_only_the_cache(head_dim, x.device)
            and pointwise.is_available(x)):
        x_ND, num_tokens = x[0], x.shape[1]
        # The norms (and a dense SiLU * up) quantize what they write for the products they feed (`rms_norm_fp8`,
        # `silu_mul_fp8`): no kernel of its own reads them back to quantize them.
        _, _, h_fp8 = pointwise.rms_norm_fp8(x_ND, norm_weight, eps, row_multiple=SCALED_MM_ROWS)
        q, k, v = fp8_product(h_fp8, num_tokens, proj.qkv, proj.qkv_bias, x.dtype).split(proj.qkv_sizes, dim=-1)
        q_NHD = pointwise.qk_norm_rope_write(q, k, v, cos[0], sin[0], q_norm_weight, k_norm_weight, eps,
                                             *backend.cache_slots(layer))
        attended = backend.attend_cached(layer, q_NHD)
        o = fp8_linear(attended.flatten(1), proj.o, proj.o_bias)
        if proj.gate_up is None:  # the experts (and their router) take the norm in the activations' dtype
            x_ND, h = pointwise.rms_norm(x_ND, post_norm_weight, eps, delta=o)
            return (x_ND + block.mlp(h[None])[0])[None]
        x_ND, _, h_fp8 = pointwise.rms_norm_fp8(x_ND, post_norm_weight, eps, delta=o, row_multiple=SCALED_MM_ROWS)
        gate_up_out = fp8_product(h_fp8, num_tokens, proj.gate_up, None, x.dtype)
        hidden_fp8 = pointwise.silu_mul_fp8(gate_up_out, SCALED_MM_ROWS)
        return (x_ND + fp8_product(hidden_fp8, num_tokens, proj.down, None, x.dtype))[None]
    h = rms_norm(x, norm_weight, eps)
    q, k, v = fp8_linear(h, proj.qkv, proj.qkv_bias).split(proj.qkv_sizes, dim=-1)
    attended = backend.attend(layer, *normed_rotated(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim))
    x, h = attention_residual(x, attended, proj.o, proj.o_bias, post_norm_weight, eps, linear=fp8_linear)
    if proj.gate_up is None:
        return x + block.mlp(h)
    return x + fp8_feed_forward(proj.gate_up, proj.down, False, h)
