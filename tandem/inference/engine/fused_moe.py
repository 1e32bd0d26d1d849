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
from tandem.kernels.moe_tiles import TileTable, shape_key, shipped_table_path
from tandem.models.eager_rounding import compile_like_eager
from tandem.models.moe import MoE, MoEArgs, route


class RoutingRecorder:
    """Expert ids [num_moe_layers, max_tokens, k] of the last forward's tokens, written by the MoE blocks."""

    def __init__(self, num_moe_layers: int, max_tokens: int, top_k: int, device: torch.device):
        self.expert_ids = torch.zeros(num_moe_layers, max_tokens, top_k, dtype=torch.int16, device=device)

    def record(self, moe_index: int, expert_ids: torch.Tensor) -> None:
        self.expert_ids[moe_index, :expert_ids.shape[0]].copy_(expert_ids)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The recorded expert ids of tokens `index` of the last forward: [len(index), num_moe_layers, k]."""
        return self.expert_ids[:, index].transpose(0, 1)


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of the model's blocks, in layer order; not those of layers its forward never runs
    (GLM-5's multi-token prediction layer), which would hold rows of routing no token took."""
    return [m for m in model.layers.modules() if isinstance(m, MoE)]


def apply_fused_moe(model: nn.Module, recorder: RoutingRecorder | None = None, kernels: bool = True,
                    tile_table: str | None = None, max_tokens: int | None = None) -> bool:
    """Serve every MoE block of `model` with the engine's kernels, in place, and record its routing into
    `recorder`. Where the kernels cannot run (CPU, no Triton) or must not (`kernels` false: `[run] exact`,
    whose MoE is the model's own path, as the trainer's) the model's eager path serves and a hook on each
    router records; returns whether the kernels serve. `tile_table`: `engine.moe_tile_table`; `max_tokens`:
    the most tokens of one forward, up to which every tile variant is compiled now (None: none)."""
    blocks = moe_blocks(model)
    if not blocks:
        return False
    if not kernels or not moe_kernel.is_available(blocks[0].gate.weight):
        if recorder is not None:
            for index, block in enumerate(blocks):
                block.gate.register_forward_hook(functools.partial(_record_hook, recorder, index))
        return False
    args = blocks[0].args
    if any(block.args != args for block in blocks):
        raise ValueError("the engine's MoE path needs the same expert settings in every MoE layer")
    router = compile_like_eager(functools.partial(route, args=args), dynamic=True, fullgraph=True)
    tiles = load_tiles(blocks[0], tile_table)
    for index, block in enumerate(blocks):
        block.forward = functools.partial(fused_moe_forward, block, router, recorder, index, tiles)
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
        x = torch.zeros(count, args.hidden_size, dtype=weight.dtype, device=weight.device)
        expert_ids = torch.randint(0, args.num_experts, (count, args.top_k), device=weight.device, generator=generator)
        routing = torch.full((count, args.top_k), 1.0 / args.top_k, device=weight.device)
        fused_experts(x, weight, block.experts.down_proj, routing, expert_ids, tiles.tiles(count))


def load_tiles(block: MoE, tile_table: str | None) -> TileTable:
    """The tiles of `block`'s expert shape: from `tile_table`, else the table shipped for this GPU, else the rule."""
    weight, args = block.experts.gate_up_proj, block.args
    key = shape_key(args.num_experts, args.top_k, args.hidden_size, args.intermediate_size, weight.dtype)
    if tile_table is not None:
        return TileTable.load(Path(tile_table), key, args.top_k, args.num_experts, "`engine.moe_tile_table`")
    shipped = shipped_table_path(torch.cuda.get_device_name(weight.device))
    return TileTable.load(shipped if shipped.is_file() else None, key, args.top_k, args.num_experts,
                          "the shipped MoE tile table")


@contextlib.contextmanager
def eager_moe(model: nn.Module):
    """Within this block the MoE blocks run the model's own path: a reference sharing the engine's weights."""
    installed = {block: block.__dict__.pop("forward") for block in moe_blocks(model) if "forward" in block.__dict__}
    try:
        yield
    finally:
        for block, forward in installed.items():
            block.forward = forward


def _record_hook(recorder: RoutingRecorder, moe_index: int, router: nn.Module, inputs, output) -> None:
    recorder.record(moe_index, output[1])


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
                        tiles.tiles(flat.shape[0]))
    if block.shared_experts is not None:
        out = out + block.shared_experts(flat)
    return out.view(x.shape)


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, tiles: tuple[dict, dict]) -> torch.Tensor:
    """x [N, H] through each token's k experts (gate_up [E, 2I, H], down [E, H, I]), weighted and summed: [N, H].
    `tiles`: the (gate_up, down) tiles (`TileTable.tiles`), one BLOCK_M."""
    (num_tokens, top_k), num_experts = expert_ids.shape, gate_up_proj.shape[0]
    gate_up_tiles, down_tiles = tiles
    blocks = moe_kernel.align_to_blocks(expert_ids, num_experts, gate_up_tiles["BLOCK_M"])
    num_copies = num_tokens * top_k
    hidden = moe_kernel.grouped_matmul(x, gate_up_proj, blocks, top_k, num_copies, gate_up_tiles, gated=True)
    down = moe_kernel.grouped_matmul(hidden, down_proj, blocks, 1, num_copies, down_tiles, routing=weights.reshape(-1))
    return down.view(num_tokens, top_k, -1).sum(1)
