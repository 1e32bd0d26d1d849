"""The MoE kernels (`tandem.kernels.moe`, `tandem.kernels.moe_tiles`) against the model's MoE
(`tandem.models.moe.MoE` and its `GroupedExperts`): the row layout, specified here in torch ops, computes
what the model's MoE computes; the kernels under Triton's interpreter build that layout and compute that
MoE; tile tables load and choose by token count. On CUDA: `tests/inference/test_gpu_moe.py`."""

import json
import os

import pytest
import torch

from tandem.kernels.moe import ExpertBlocks
from tandem.kernels.moe_tiles import TileTable, rule_tiles, shape_key, shipped_table_path
from tandem.models.moe import MoE, MoEArgs, permute
from triton_interpreter import needs_triton_interpreter, run_interpreted


def align_to_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The row layout `tandem.kernels.moe.align_to_blocks` builds, in torch ops: its specification."""
    num_copies = expert_ids.numel()
    order, counts = permute(expert_ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # where each expert's copies start in `order`
    experts_sorted = expert_ids.reshape(-1)[order]
    rank = torch.arange(num_copies) - first[experts_sorted]
    max_padded = -(-(num_copies + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_copies = torch.full((max_padded,), num_copies, dtype=torch.int64)
    sorted_copies[padded_end[experts_sorted] - padded[experts_sorted] + rank] = order
    block_starts = torch.arange(0, max_padded, block_m)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(sorted_copies, block_experts, padded_end[-1:], block_m)


def grouped_matmul_reference(a, weight, blocks: ExpertBlocks, rows_per_copy, num_copies, routing=None):
    """What one program per row block of `tandem.kernels.moe._grouped_matmul_kernel` computes, block by block."""
    out = torch.full((num_copies, weight.shape[1]), float("nan"))
    for b, expert in enumerate(blocks.block_experts.tolist()):
        if b * blocks.block_m >= blocks.num_padded.item():
            break
        copies = blocks.sorted_copies[b * blocks.block_m:(b + 1) * blocks.block_m]
        copies = copies[copies < num_copies]
        rows = a[copies // rows_per_copy] @ weight[expert].T
        out[copies] = rows if routing is None else rows * routing[copies, None]
    return out


def moe_through_blocks(moe: MoE, x: torch.Tensor, block_m: int) -> torch.Tensor:
    """`fused_moe.fused_experts`'s steps, with the kernel replaced by its reference."""
    flat = x.reshape(-1, x.shape[-1])
    weights, expert_ids = moe.gate(flat)
    n, k = expert_ids.shape
    blocks = align_to_blocks(expert_ids, moe.args.num_experts, block_m)
    gate, up = grouped_matmul_reference(flat, moe.experts.gate_up_proj, blocks, k, n * k).chunk(2, dim=-1)
    down = grouped_matmul_reference(torch.nn.functional.silu(gate) * up, moe.experts.down_proj, blocks, 1, n * k,
                                    weights.reshape(-1))
    return down.view(n, k, -1).sum(1).view(x.shape)


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_the_kernel_layout_computes_the_models_moe(num_tokens, block_m):
    torch.manual_seed(num_tokens)
    moe = MoE(MoEArgs(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24, norm_topk_prob=True))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, num_tokens, 32)
    with torch.no_grad():
        torch.testing.assert_close(moe_through_blocks(moe, x, block_m), moe(x), atol=1e-5, rtol=1e-5)


def test_the_layout_holds_each_copy_once_in_padded_groups_of_its_expert():
    expert_ids = torch.tensor([[3, 0], [3, 1], [0, 3], [7, 3], [1, 0]])
    blocks = align_to_blocks(expert_ids, num_experts=8, block_m=4)
    num_copies = expert_ids.numel()
    assert blocks.sorted_copies.numel() == 12 + 8 * 3  # fixed by N, k, E and block_m only
    assert blocks.num_padded.item() == 4 * 4  # experts 0, 1, 3, 7: one block each
    real = blocks.sorted_copies[blocks.sorted_copies < num_copies]
    assert sorted(real.tolist()) == list(range(num_copies))
    for b in range(4):
        copies = blocks.sorted_copies[4 * b:4 * b + 4]
        copies = copies[copies < num_copies]
        assert (expert_ids.reshape(-1)[copies] == blocks.block_experts[b]).all()
    assert blocks.block_experts[:4].tolist() == [0, 1, 3, 7]


INTERPRETED_KERNEL = """
import functools
import json
import os
import tempfile

import torch
from test_moe_kernels import align_to_blocks as reference_layout
from tandem.inference.engine.fused_moe import compile_tile_variants, fused_experts, fused_moe_forward, load_tiles
from tandem.kernels.moe import align_to_blocks
from tandem.kernels.moe_tiles import rule_tiles, shape_key
from tandem.models.moe import MoE, MoEArgs, route

torch.manual_seed(0)
# The layout: rows up to num_padded as the torch specification's; several chunks of copies, 8..128 experts.
for num_tokens, top_k, num_experts, block_m in ((1, 2, 8, 4), (37, 4, 16, 16), (300, 8, 128, 16), (90, 2, 8, 32)):
    expert_ids = torch.rand(num_tokens, num_experts).topk(top_k, dim=-1).indices
    got, want = align_to_blocks(expert_ids, num_experts, block_m), reference_layout(expert_ids, num_experts, block_m)
    assert torch.equal(got.num_padded, want.num_padded), (got.num_padded, want.num_padded)
    assert torch.equal(got.block_experts, want.block_experts)
    assert torch.equal(got.sorted_copies[:want.num_padded.item()], want.sorted_copies[:want.num_padded.item()])

moe = MoE(MoEArgs(num_experts=16, top_k=4, hidden_size=96, intermediate_size=80, norm_topk_prob=True))
for p in moe.parameters():
    torch.nn.init.normal_(p, std=0.1)
# Rule tiles (row blocks of 16, 16, 32, 64; K not a multiple of BLOCK_K: masked), then tiles with even K
# and a BLOCK_M of 16 on more rows per expert than it holds.
even = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=2)
for num_tokens, tiles in ((1, None), (40, None), (150, None), (300, None), (150, (dict(even, BLOCK_K=32), even))):
    x = torch.randn(num_tokens, 96)
    with torch.no_grad():
        weights, expert_ids = moe.gate(x)
        rule = rule_tiles(num_tokens, 4, 16)
        out = fused_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, expert_ids, tiles or (rule, rule))
        torch.testing.assert_close(out, moe(x[None])[0], atol=1e-5, rtol=1e-5)

# The block's forward as the engine installs it, its tiles from a table file (`engine.moe_tile_table`).
with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "tiles.json")
    with open(path, "w") as f:
        json.dump({"shapes": {shape_key(16, 4, 96, 80, torch.float32): [
            {"num_tokens": 64, "gate_up": dict(even, BLOCK_M=32), "down": dict(even, BLOCK_M=32, BLOCK_K=32)}]}}, f)
    tiles = load_tiles(moe, path)
assert tiles.tiles(50)[1] == dict(even, BLOCK_M=32, BLOCK_K=32)
x = torch.randn(1, 50, 96)
with torch.no_grad():
    out = fused_moe_forward(moe, functools.partial(route, args=moe.args), None, 0, tiles, x)
    torch.testing.assert_close(out, moe(x), atol=1e-5, rtol=1e-5)
    compile_tile_variants(moe, tiles, 50)  # the engine's start-up launch of each variant runs through
print("ok")
"""


@needs_triton_interpreter
def test_the_kernel_under_tritons_interpreter_computes_the_models_moe():
    """The real kernels on CPU tensors (fp32, exact dot products), run by Triton's interpreter: the layout
    kernels against their torch specification, the fused experts (SiLU * up in the gate_up kernel) against
    the model's MoE, and the block's engine forward with its tiles from a table file."""
    run_interpreted(INTERPRETED_KERNEL, timeout=300, folder=os.path.dirname(__file__))


def write_table(path, key: str, entries: list[dict]) -> str:
    path.write_text(json.dumps({"device": "test", "shapes": {key: entries}}))
    return str(path)


def tiles(block_m: int, block_n: int) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)


def test_a_tile_table_serves_the_smallest_tuned_count_that_holds_the_tokens(tmp_path):
    key = shape_key(128, 8, 2048, 768, torch.bfloat16)
    assert key == "experts=128,top_k=8,hidden=2048,intermediate=768,dtype=bfloat16"
    entries = [{"num_tokens": n, "gate_up": tiles(m, 128), "down": tiles(m, 64), "seconds": 1e-4}
               for n, m in ((256, 16), (1, 16), (4096, 64))]
    path = write_table(tmp_path / "t.json", key, entries)
    table = TileTable.load(path, key, 8, 128, "`engine.moe_tile_table`")
    assert table.tiles(1) == (tiles(16, 128), tiles(16, 64))
    assert table.tiles(2)[0] == tiles(16, 128) and table.tiles(256)[1] == tiles(16, 64)  # up to 256: the 256 entry
    assert table.tiles(257)[0] == tiles(64, 128) and table.tiles(100_000)[0] == tiles(64, 128)  # past the end: the last
    other = TileTable.load(path, shape_key(8, 2, 64, 64, torch.bfloat16), 2, 8, "`engine.moe_tile_table`")
    assert other.tiles(300) == (rule_tiles(300, 2, 8),) * 2  # a shape the table lacks: the rule
    assert TileTable.load(None, key, 8, 128, "x").tiles(3) == (rule_tiles(3, 8, 128),) * 2


@pytest.mark.parametrize("table", ["tuned", "rule"])
def test_the_engine_compiles_every_tile_variant_a_forward_can_pick(table, tmp_path):
    """`compile_tile_variants` runs one forward per variant: its token counts must reach every variant that
    forwards of 1..max_tokens tokens pick (a missed one is a compile stall while serving), and no more."""
    key = shape_key(128, 8, 2048, 768, torch.bfloat16)
    entries = [{"num_tokens": n, "gate_up": tiles(m, b), "down": tiles(m, 64)}
               for n, m, b in ((1, 16, 64), (64, 16, 128), (256, 32, 64), (2048, 64, 128), (8192, 128, 128))]
    path = write_table(tmp_path / "t.json", key, entries) if table == "tuned" else None
    lookup = TileTable.load(path, key, 8, 128, "`engine.moe_tile_table`")
    for max_tokens in (1, 200, 4096, 20_000):
        picked = {json.dumps(lookup.tiles(n), sort_keys=True) for n in range(1, max_tokens + 1)}
        counts = lookup.variant_token_counts(max_tokens)
        assert all(1 <= c <= max_tokens for c in counts)
        warmed = {json.dumps(lookup.tiles(c), sort_keys=True) for c in counts}
        assert warmed == picked and len(counts) == len(picked), (max_tokens, counts)


@pytest.mark.parametrize("content, problem", [
    ("not json", "JSONDecodeError"),
    ({"shapes": {"K": [{"num_tokens": 1, "gate_up": tiles(16, 64), "down": tiles(32, 64)}]}}, "differ in BLOCK_M"),
    ({"shapes": {"K": [{"num_tokens": 1, "gate_up": {"BLOCK_M": 16}, "down": tiles(16, 64)}]}}, "lacks integer"),
])
def test_a_bad_tile_table_is_an_error_naming_the_key_and_file(tmp_path, content, problem):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=f"`engine.moe_tile_table` = '{path}'.*{problem}"):
        TileTable.load(path, "K", 8, 128, "`engine.moe_tile_table`")
    with pytest.raises(ValueError, match="no such file|No such file"):
        TileTable.load(tmp_path / "missing.json", "K", 8, 128, "`engine.moe_tile_table`")


def test_the_shipped_table_of_a_gpu_is_named_after_it():
    assert shipped_table_path("NVIDIA H200").name == "NVIDIA_H200.json"
    assert shipped_table_path("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"
