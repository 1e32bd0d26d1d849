"""The dense FP8 product's table of choices (`tandem.kernels.fp8_tiles`): lookup by token count, the rule where a
table is missing or lacks a shape, the weights `scaled_mm` cannot take, every choice warmed, errors naming the key
and the file. The products each choice runs: `tests/kernels/test_fp8.py`."""

import json

import pytest
import torch

from tandem.kernels.fp8 import GROUP, BlockFp8Weight, scaled_mm_serves
from tandem.kernels.fp8_tiles import ProductTiles, shape_key, shipped_table_path

SPLIT = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, SPLIT_K=4)
WIDE = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, SPLIT_K=1)


def write_table(path, key: str, entries: list[dict]) -> str:
    path.write_text(json.dumps({"device": "test", "shapes": {key: entries}}))
    return str(path)


ENTRIES = [{"num_tokens": 256, "product": "triton", "tiles": WIDE, "us": {"triton": 9.0}},
           {"num_tokens": 16, "product": "triton", "tiles": SPLIT},
           {"num_tokens": 4096, "product": "scaled_mm"}]


def test_a_product_takes_the_entry_of_the_smallest_tuned_count_that_holds_its_tokens(tmp_path):
    key = shape_key(5120, 2048)
    assert key == "n=5120,k=2048"
    path = write_table(tmp_path / "t.json", key, ENTRIES)
    tiles = ProductTiles.load(path, 5120, 2048, "`engine.fp8_tile_table`")
    assert tiles.choose(1) == tiles.choose(16) == ("triton", SPLIT)
    assert tiles.choose(17) == tiles.choose(256) == ("triton", WIDE)
    assert tiles.choose(257) == tiles.choose(100_000) == ("scaled_mm", None)  # past the end: the last
    # A shape the table lacks, and no table: the Triton kernel with `launch_config`'s tiles.
    assert ProductTiles.load(path, 1024, 2048, "x").choose(300) == ("triton", None)
    assert ProductTiles.load(None, 5120, 2048, "x").choose(300) == ("triton", None)
    # A weight that is not whole 128 x 128 blocks takes the rule where the table says cuBLAS.
    parts = ProductTiles.load(path, 5120, 2048, "x", scaled_mm_serves=False)
    assert parts.choose(4096) == ("triton", None) and parts.choose(16) == ("triton", SPLIT)


@pytest.mark.parametrize("table", ["tuned", "rule"])
def test_every_choice_a_product_can_take_is_warmed(table, tmp_path):
    """The engine runs one product per token count of `variant_token_counts` at start: those counts must reach every
    choice that products of 1..max_tokens rows take (a missed one is a compile stall while serving), and no more."""
    from tandem.kernels.fp8 import launch_config

    path = write_table(tmp_path / "t.json", shape_key(4096, 1024), ENTRIES) if table == "tuned" else None
    tiles = ProductTiles.load(path, 4096, 1024, "x")

    def taken(n: int) -> str:
        product, chosen = tiles.choose(n)
        return json.dumps([product, chosen or launch_config(n)], sort_keys=True)

    for max_tokens in (1, 200, 4096, 20_000):
        counts = tiles.variant_token_counts(max_tokens)
        assert all(1 <= c <= max_tokens for c in counts)
        picked = {taken(n) for n in range(1, max_tokens + 1)}
        assert {taken(c) for c in counts} == picked and len(counts) == len(picked), (max_tokens, counts)


@pytest.mark.parametrize("entry, problem", [
    ({"num_tokens": 1, "product": "cutlass"}, "is not one of"),
    ({"num_tokens": 1, "product": "triton", "tiles": {"BLOCK_M": 16}}, "lack integer"),
    ({"num_tokens": 1, "product": "triton", "tiles": dict(SPLIT, SPLIT_K="4")}, "lack integer"),
    ({"num_tokens": 1}, "KeyError"),
])
def test_a_bad_table_is_an_error_naming_the_key_and_the_file(tmp_path, entry, problem):
    path = write_table(tmp_path / "bad.json", "n=256,k=128", [entry])
    with pytest.raises(ValueError, match=f"`engine.fp8_tile_table` = '{path}'.*{problem}.*fp8_matmul.py --table-out"):
        ProductTiles.load(path, 256, 128, "`engine.fp8_tile_table`")
    (tmp_path / "notjson.json").write_text("not json")
    with pytest.raises(ValueError, match="JSONDecodeError"):
        ProductTiles.load(tmp_path / "notjson.json", 256, 128, "`engine.fp8_tile_table`")
    with pytest.raises(ValueError, match="no such file|No such file"):
        ProductTiles.load(tmp_path / "missing.json", 256, 128, "`engine.fp8_tile_table`")


def test_the_shipped_table_of_a_gpu_is_named_after_it_beside_the_moe_tables():
    path = shipped_table_path("NVIDIA H100 80GB HBM3")
    assert path.name == "NVIDIA_H100_80GB_HBM3.json" and path.parent.name == "fp8_tile_tables"


def test_cublas_serves_stacks_of_whole_128_row_blocks_whose_scales_it_reads_as_held():
    def stack(parts: list[int], columns: int = 512) -> BlockFp8Weight:
        """Matrices of `parts` rows stacked, each keeping its own 128-row blocks (as `stack_fp8_rows` stacks them)."""
        scale_rows, blocks = [], 0
        for rows in parts:
            scale_rows.append(torch.arange(rows) // GROUP + blocks)
            blocks += -(-rows // GROUP)
        return BlockFp8Weight(torch.zeros(sum(parts), columns), torch.ones(blocks, -(-columns // GROUP)),
                              torch.cat(scale_rows).int())

    assert scaled_mm_serves(stack([256])) and scaled_mm_serves(stack([2048, 512, 512]))  # Qwen3-0.6B's q, k, v
    assert not scaled_mm_serves(stack([128, 64, 64]))  # parts of 64 rows: blocks of their own
    # cuBLAS reads K / 128 scales a block of rows 16-byte aligned: 2 or 6 of them misread beyond one block of rows.
    assert not scaled_mm_serves(stack([256], columns=256)) and not scaled_mm_serves(stack([768], columns=768))
    assert scaled_mm_serves(stack([128], columns=768)) and scaled_mm_serves(stack([384], columns=1536))
    assert scaled_mm_serves(stack([300]))  # one matrix: its last block is short, as cuBLAS's would be
