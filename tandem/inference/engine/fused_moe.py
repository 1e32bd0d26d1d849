"""The engine's execution of mixture-of-experts blocks, installed on the model from outside.

Why: the model's `MoE.forward` (`tandem.models.moe`) is the reference, shared with the trainer,
but on CUDA it gathers rows into sorted order and its CPU loop reads group sizes on the host.
The engine's version keeps every shape fixed by the token count and never syncs, so decode
steps run inside CUDA graphs:
    route  (the model's `route`, compiled once into a few fused kernels)
    -> align_to_blocks (sort copies by expert, padded to the kernel's row blocks: three small kernels)
    -> grouped matmul gate_up, writing SiLU(gate) * up -> grouped matmul down, times the routing weight
    -> sum of each token's k copies (+ shared experts).
Tiles by token count from a tuned table (`moe_tiles`).
Experts held in block FP8 (`engine.quantization = "fp8"`: `tandem.models.fp8.Fp8Experts`) run the same kernels
on FP8 rows: each matmul's input is quantized per token copy and 128-column group first
(`tandem.kernels.fp8.quantize_activations`, the dense layers' quantizer), and the products are scaled by block.
Model code stays as it is; where the kernel cannot run (CPU, no Triton) the model's eager path
serves.

`RoutingRecorder`: each block also writes its expert ids into a buffer of the recorder (fixed
addresses: graphs replay the writes; on the eager path a hook on each router), from which the
engine reads the experts that sampled each token.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
from torch import nn

from tandem.kernels import moe as moe_kernel
from tandem.kernels.fp8 import quantize_activations
from tandem.kernels.moe_tiles import TileTable, shape_key, shipped_table_path
from tandem.models.eager_rounding import compile_like_eager
from tandem.models.fp8 import Fp8Experts
from tandem.models.moe import MoE, MoEArgs, route
from tandem.models.multi_token import mtp_layers


class RoutingRecorder:
    """Expert ids [num_moe_layers, max_tokens, k] of the last forward's tokens, written by the MoE blocks."""

    def __init__(self, num_moe_layers: int, max_tokens: int, top_k: int, device: torch.device):
        self.expert_ids = torch.zeros(num_moe_layers, max_tokens, top_k, dtype=torch.int16, device=device)
        self._appended = [0] * num_moe_layers

    def record(self, moe_index: int, expert_ids: torch.Tensor) -> None:
        """A forward's routing of one layer, all its tokens at once (the engine's MoE kernels, in CUDA graphs too)."""
        self.expert_ids[moe_index, :expert_ids.shape[0]].copy_(expert_ids)

    def start_forward(self) -> None:
        """Before an eager forward whose routing `append` records."""
        self._appended = [0] * len(self._appended)

    def append(self, moe_index: int, expert_ids: torch.Tensor) -> None:
        """The model's own MoE path: one call per layer routes the forward's tokens, or in exact mode one call per
        token (`tandem.models.exact`), so each call's rows follow those of the calls since `start_forward`."""
        start = self._appended[moe_index]
        self.expert_ids[moe_index, start:start + expert_ids.shape[0]].copy_(expert_ids)
        self._appended[moe_index] = start + expert_ids.shape[0]

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The recorded expert ids of tokens `index` of the last forward: [len(index), num_moe_layers, k]."""
        return self.expert_ids[:, index].transpose(0, 1)


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of the model's blocks, in layer order; not those of layers its forward never runs
    (GLM-5's multi-token prediction layer), which would hold rows of routing no token took."""
    return [m for m in model.layers.modules() if isinstance(m, MoE)]


def draft_moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of the model's multi-token prediction layers (`model.mtp_layers`), which a speculative
    draft runs apart from the model's forward."""
    return [m for m in mtp_layers(model).modules() if isinstance(m, MoE)]


def apply_fused_moe(model: nn.Module, recorder: RoutingRecorder | None = None, kernels: bool = True,
                    tile_table: str | None = None, max_tokens: int | None = None) -> bool:
    """Serve every MoE block of `model` with the engine's kernels, in place, and record its routing into
    `recorder`; its multi-token prediction layers' too (`draft_moe_blocks`: each draft token goes through one),
    their routing not recorded (no sampled token took it). Where the kernels cannot run (CPU, no Triton) or must
    not (`kernels` false: `[run] exact`, whose MoE is the model's own path, as the trainer's) the model's eager
    path serves and a hook on each router records; returns whether the kernels serve. `tile_table`:
    `engine.moe_tile_table`; `max_tokens`: the most tokens of one forward, up to which every tile variant is
    compiled now (None: none)."""
    blocks = moe_blocks(model)
    if not blocks:
        return False
    if not kernels or not moe_kernel.is_available(blocks[0].gate.weight):
        if recorder is not None:
            for index, block in enumerate(blocks):
                block.gate.register_forward_hook(functools.partial(_record_hook, recorder, index))
        return False
    args, drafts = blocks[0].args, draft_moe_blocks(model)
    if any(block.args != args for block in blocks + drafts):
        raise ValueError("the engine's MoE path needs the same expert settings in every MoE layer")
    router = compile_like_eager(functools.partial(route, args=args), dynamic=True, fullgraph=True)
    tiles = load_tiles(blocks[0], tile_table)
    for index, block in enumerate(blocks):
        block.forward = functools.partial(fused_moe_forward, block, router, recorder, index, tiles)
    for block in drafts:
        block.forward = functools.partial(fused_moe_forward, block, router, None, -1, tiles)
    if max_tokens is not None:
        compile_tile_variants(blocks[0], tiles, max_tokens)
    return True


@torch.no_grad()
def compile_tile_variants(block: MoE, tiles: TileTable, max_tokens: int) -> None:
    """Run the expert kernels once with every tile variant a forward of up to `max_tokens` tokens can pick.

    Why: Triton compiles a kernel variant on its first launch. Decode batches are warmed by the CUDA-graph
    captures, but prefill steps run eagerly, and a tuned table gives each range of token counts its own
    tiles, so without this each first prefill in a new range would stall serving for a compile of seconds
    (`benchmarks/results/engine-moe-h200-2026-12-04-tuned.json`: its first prefill steps)."""
    weight = block.experts.gate_up_proj
    args = block.args
    generator = torch.Generator(device=weight.device).manual_seed(0)
    for count in tiles.variant_token_counts(max_tokens):
        x = torch.zeros(count, args.hidden_size, dtype=activation_dtype(block.experts), device=weight.device)
        expert_ids = torch.randint(0, args.num_experts, (count, args.top_k), device=weight.device, generator=generator)
        routing = torch.full((count, args.top_k), 1.0 / args.top_k, device=weight.device)
        fused_experts(x, weight, block.experts.down_proj, routing, expert_ids, tiles.tiles(count),
                      expert_scales(block.experts))


def activation_dtype(experts: nn.Module) -> torch.dtype:
    """The dtype the experts take and give: their weights' own, or the model's where they are FP8."""
    return experts.activation_dtype if isinstance(experts, Fp8Experts) else experts.gate_up_proj.dtype


def expert_scales(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The block scales (gate_up, down) of experts held in FP8; None for experts in the model's dtype."""
    if isinstance(experts, Fp8Experts):
        return experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv
    return None


def load_tiles(block: MoE, tile_table: str | None) -> TileTable:
    """The tiles of `block`'s expert shape: from `tile_table`, else the table shipped for this GPU, else the rule."""
    weight, args = block.experts.gate_up_proj, block.args
    key = shape_key(args.num_experts, args.top_k, args.hidden_size, args.intermediate_size, weight.dtype)
    fp8 = isinstance(block.experts, Fp8Experts)
    if tile_table is not None:
        return TileTable.load(Path(tile_table), key, args.top_k, args.num_experts, "`engine.moe_tile_table`", fp8)
    shipped = shipped_table_path(torch.cuda.get_device_name(weight.device))
    return TileTable.load(shipped if shipped.is_file() else None, key, args.top_k, args.num_experts,
                          "the shipped MoE tile table", fp8)


@contextlib.contextmanager
def eager_moe(model: nn.Module):
    """Within this block the MoE blocks run the model's own path: a reference sharing the engine's weights."""
    installed = {block: block.__dict__.pop("forward") for block in moe_blocks(model) + draft_moe_blocks(model)
                 if "forward" in block.__dict__}
    try:
        yield
    finally:
        for block, forward in installed.items():
            block.forward = forward


def _record_hook(recorder: RoutingRecorder, moe_index: int, router: nn.Module, inputs, output) -> None:
    recorder.append(moe_index, output[1])


def fused_moe_forward(block: MoE, router, recorder: RoutingRecorder | None, moe_index: int, tiles: TileTable,
                      x: torch.Tensor) -> torch.Tensor:
    """What `MoE.forward` computes, with fixed shapes and no host sync: x [B, T, H] -> [B, T, H]."""
    flat = x.reshape(-1, x.shape[-1])
    args: MoEArgs = block.args
    bias = None
    if args.score_bias == "router":
        bias = block.gate.e_score_correction_bias
    elif args.score_bias == "block":
        bias = block.e_score_correction_bias
    weights, expert_ids = router(flat, block.gate.weight, bias)
    if recorder is not None:
        recorder.record(moe_index, expert_ids)
    out = fused_experts(flat, block.experts.gate_up_proj, block.experts.down_proj, weights, expert_ids,
                        tiles.tiles(flat.shape[0]), expert_scales(block.experts))
    if block.shared_experts is not None:
        out = out + block.shared_experts(flat)
    return out.view(x.shape)


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, tiles: tuple[dict, dict],
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [N, H] through each token's k experts (gate_up [E, 2I, H], down [E, H, I]), weighted and summed: [N, H].
    `tiles`: the (gate_up, down) tiles (`TileTable.tiles`), one BLOCK_M; `scales`: the weights are FP8 with these
    block scales (`expert_scales`)."""
    (num_tokens, top_k), num_experts = expert_ids.shape, gate_up_proj.shape[0]
    gate_up_tiles, down_tiles = tiles
    gate_up_scales, down_scales = scales if scales is not None else (None, None)
    blocks = moe_kernel.align_to_blocks(expert_ids, num_experts, gate_up_tiles["BLOCK_M"])
    num_copies = num_tokens * top_k
    hidden = expert_matmul(x, gate_up_proj, gate_up_scales, blocks, top_k, num_copies, gate_up_tiles, gated=True)
    down = expert_matmul(hidden, down_proj, down_scales, blocks, 1, num_copies, down_tiles, routing=weights.reshape(-1))
    return down.view(num_tokens, top_k, -1).sum(1)


def expert_matmul(a: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor | None, blocks: moe_kernel.ExpertBlocks,
                  rows_per_copy: int, num_copies: int, tiles: dict, routing: torch.Tensor | None = None,
                  gated: bool = False) -> torch.Tensor:
    """`moe_kernel.grouped_matmul` of rows `a` in the model's dtype; with `weight_scales` (FP8 experts) the rows are
    quantized first, per row and 128-column group, and the result comes back in `a`'s dtype."""
    if weight_scales is None:
        return moe_kernel.grouped_matmul(a, weight, blocks, rows_per_copy, num_copies, tiles, routing, gated)
    a_fp8, a_scales = quantize_activations(a)
    fp8 = moe_kernel.Fp8Operands(a_scales, weight_scales, a.dtype)
    return moe_kernel.grouped_matmul(a_fp8, weight, blocks, rows_per_copy, num_copies, tiles, routing, gated, fp8)
