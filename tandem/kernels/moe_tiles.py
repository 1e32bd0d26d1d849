"""Tile sizes of the MoE grouped matmuls (`tandem.kernels.moe`), by token count: a tuned table, else a rule.

Why a table: the best tiles depend on the GPU, the expert shapes and the rows each expert gets, and
guessing them left the decode step's expert matmuls far below memory speed. `benchmarks/moe_tune.py`
times a grid of tiles on the GPU for the token counts the engine runs (decode batches, prefill chunks)
and writes the fastest as a table:

    {"device": "<GPU name>", "shapes": {"<shape key>": [
        {"num_tokens": 256, "gate_up": {BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages}, "down": {...}},
        ...]}}

one list per expert shape (`shape_key`), read as `tandem.kernels.tile_tables` reads every such table: a
forward of T tokens takes the entry of the smallest tuned count >= T (the largest past the end); both
matmuls share one row layout, so their BLOCK_M agree. The engine reads `engine.moe_tile_table`, else the
table shipped for its GPU (`moe_tile_tables/<GPU name>.json` beside this module) where there is one; shapes
a table lacks, and CPU runs, get the rule (`rule_tiles`).

Reference: none (it picks launch options; the kernels' tests run them under several tiles).
Tests: `tests/kernels/test_moe_kernels.py` (loading, lookup by token count, errors naming the key and file).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.kernels import tile_tables

log = logging.getLogger(__name__)

TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
"""What one matmul's tiles name: the kernel's block sizes and launch options."""

SHIPPED = Path(__file__).with_name("moe_tile_tables")
"""Tables shipped with tandem, one per GPU name (`shipped_table_path`)."""


def shape_key(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> str:
    """The table's key of one expert shape, e.g. `experts=128,top_k=8,hidden=2048,intermediate=768,dtype=bfloat16`."""
    return (f"experts={num_experts},top_k={top_k},hidden={hidden_size},intermediate={intermediate_size},"
            f"dtype={str(dtype).removeprefix('torch.')}")


def shipped_table_path(device_name: str) -> Path:
    """Where the table of a GPU named `device_name` ships (it may not exist)."""
    return tile_tables.shipped_table_path(SHIPPED, device_name)


def rule_tiles(num_tokens: int, top_k: int, num_experts: int, fp8: bool = False) -> dict:
    """Untuned tiles from the mean rows per expert: each expert's group is padded to a row block, so
    small blocks when few tokens reach each expert (decode), larger ones for prefill. FP8 experts (`fp8`) step
    through K by one scale group (128 columns: the bytes of bf16's 64), so that each step needs one pair of scales."""
    rows_per_expert = num_tokens * top_k / num_experts
    block_k = 128 if fp8 else 64
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=1, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=8, num_stages=3)


class TileTable:
    """The tiles of one expert shape by token count; empty: the rule for every count (`fp8`: FP8 experts')."""

    def __init__(self, entries: list[dict], top_k: int, num_experts: int, fp8: bool = False):
        self.entries = sorted(entries, key=lambda e: e["num_tokens"])
        self.counts = [e["num_tokens"] for e in self.entries]
        self.top_k, self.num_experts, self.fp8 = top_k, num_experts, fp8

    def tiles(self, num_tokens: int) -> tuple[dict, dict]:
        """(gate_up tiles, down tiles) for a forward of `num_tokens` tokens."""
        if not self.entries:
            rule = rule_tiles(num_tokens, self.top_k, self.num_experts, self.fp8)
            return rule, rule
        entry = tile_tables.entry_for(self.entries, num_tokens)
        return entry["gate_up"], entry["down"]

    def variant_token_counts(self, max_tokens: int) -> list[int]:
        """One token count (at most `max_tokens`) per tile variant that forwards of 1 to `max_tokens` tokens pick."""
        counts = (self.counts if self.entries  # else the rule's ranges (`rule_tiles`)
                  else [16 * self.num_experts // self.top_k, 64 * self.num_experts // self.top_k, max_tokens])
        return tile_tables.variant_token_counts(counts, max_tokens)

    @classmethod
    def load(cls, path: Path | None, key: str, top_k: int, num_experts: int, source: str,
             fp8: bool = False) -> "TileTable":
        """The entries of shape `key` in the table at `path` (None, or a shape it lacks: the rule); `source`
        names where the path came from in errors (a config key, or the shipped table); `fp8`: FP8 experts."""
        if path is None:
            return cls([], top_k, num_experts, fp8)
        entries = tile_tables.load_entries(path, key, checked_entry, source, "MoE tile table", "benchmarks/moe_tune.py")
        log.info("MoE tiles: %s from %s (%d token counts; other shapes: the rule)", key, path, len(entries))
        return cls(entries, top_k, num_experts, fp8)


def checked_entry(entry: dict) -> dict:
    """One table entry's token count and tiles, checked: every tile of both matmuls an integer, one BLOCK_M
    (they share the row layout). Other fields (the tuner's measurements) are left out."""
    tiles = {"num_tokens": int(entry["num_tokens"])}
    for matmul in ("gate_up", "down"):
        missing = [k for k in TILE_KEYS if not isinstance(entry[matmul].get(k), int)]
        if missing:
            raise ValueError(f"entry of {entry['num_tokens']} tokens: {matmul} lacks integer {missing}")
        tiles[matmul] = {k: entry[matmul][k] for k in TILE_KEYS}
    if tiles["gate_up"]["BLOCK_M"] != tiles["down"]["BLOCK_M"]:
        raise ValueError(f"entry of {entry['num_tokens']} tokens: gate_up and down differ in BLOCK_M")
    return tiles
