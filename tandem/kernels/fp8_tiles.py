"""Which implementation and tiles the dense block-FP8 product (`tandem.kernels.fp8`) takes, by token count: a
tuned table, else a rule.

Why a table: the Triton kernel's best tiles depend on the GPU, the weight's shape and the rows multiplied (few
rows: small tiles and a split reduction, so that enough programs read the weight; many: large tiles), and for
prefill-sized products cuBLAS's block-scaled `torch._scaled_mm` may beat any of them. `benchmarks/fp8_matmul.py
--table-out` times both on the GPU and writes, per weight shape (`shape_key`) and token count, the faster:

    {"device": "<GPU name>", "shapes": {"n=5120,k=2048": [
        {"num_tokens": 16, "product": "triton", "tiles": {BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_K}},
        {"num_tokens": 4096, "product": "scaled_mm"}, ...]}}

read as `tandem.kernels.tile_tables` reads every such table. The engine reads `engine.fp8_tile_table`, else the
table shipped for its GPU (`fp8_tile_tables/<GPU name>.json` beside this module) where there is one; shapes a table
lacks get the rule: the Triton kernel with `launch_config`'s tiles. `scaled_mm` needs a weight of whole 128 x 128
blocks (a stack whose parts are multiples of 128 rows); another weight takes the rule where the table says it.

Reference: none (it picks launch options; `tests/kernels/test_fp8.py` runs each implementation and tiles).
Tests: `tests/kernels/test_fp8_tiles.py` (loading, lookup by token count, errors naming the key and file).
"""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.kernels import tile_tables

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).with_name("fp8_tile_tables")
"""Tables shipped with tandem, one per GPU name."""

PRODUCTS = ("triton", "scaled_mm")
"""The implementations an entry may name: the Triton kernel with its tiles, or cuBLAS's block-scaled product."""
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
"""What a Triton entry's tiles name (BLOCK_K is the scale group; `SPLIT_K` is optional, 1 by default)."""
RULE_TOKEN_COUNTS = (16, 64)
"""Where `tandem.kernels.fp8.launch_config` changes tiles: its ranges end here (and at the most tokens)."""


def shape_key(num_rows: int, num_columns: int) -> str:
    """The table's key of a weight [N, K], e.g. `n=5120,k=2048`."""
    return f"n={num_rows},k={num_columns}"


def checked_entry(entry: dict) -> dict:
    """One entry's token count, product and (Triton's) tiles, checked; other fields (timings) are left out."""
    product = entry["product"]
    if product not in PRODUCTS:
        raise ValueError(f"entry of {entry['num_tokens']} tokens: product {product!r} is not one of {list(PRODUCTS)}")
    checked = {"num_tokens": int(entry["num_tokens"]), "product": product, "tiles": None}
    if product == "triton":
        tiles = entry["tiles"]
        missing = [k for k in TILE_KEYS if not isinstance(tiles.get(k), int)]
        missing += [] if isinstance(tiles.get("SPLIT_K", 1), int) else ["SPLIT_K"]
        if missing:
            raise ValueError(f"entry of {entry['num_tokens']} tokens: tiles lack integer {missing}")
        checked["tiles"] = {k: tiles[k] for k in TILE_KEYS} | {"SPLIT_K": tiles.get("SPLIT_K", 1)}
    return checked


class ProductTiles:
    """The dense product's choices for one weight shape by token count; empty: the rule for every count."""

    def __init__(self, entries: list[dict]):
        self.entries = sorted(entries, key=lambda e: e["num_tokens"])

    def choose(self, num_tokens: int) -> tuple[str, dict | None]:
        """(product, tiles) for a product of `num_tokens` rows; tiles None: `launch_config`'s."""
        if not self.entries:
            return "triton", None
        entry = tile_tables.entry_for(self.entries, num_tokens)
        return entry["product"], entry["tiles"]

    def variant_token_counts(self, max_tokens: int) -> list[int]:
        """One token count (at most `max_tokens`) per choice that products of 1 to `max_tokens` rows take."""
        counts = [e["num_tokens"] for e in self.entries] if self.entries else [*RULE_TOKEN_COUNTS, max_tokens]
        return tile_tables.variant_token_counts(counts, max_tokens)

    @classmethod
    def load(cls, path: Path | None, num_rows: int, num_columns: int, source: str,
             scaled_mm_serves: bool = True) -> "ProductTiles":
        """The entries of a weight [`num_rows`, `num_columns`] in the table at `path` (None, or a shape it lacks:
        the rule); `source` names where the path came from in errors; `scaled_mm_serves`: cuBLAS's product
        serves the weight (`tandem.kernels.fp8.scaled_mm_serves`; else its `scaled_mm` entries take the rule)."""
        if path is None:
            return cls([])
        key = shape_key(num_rows, num_columns)
        entries = tile_tables.load_entries(path, key, checked_entry, source, "dense FP8 tile table",
                                           "benchmarks/fp8_matmul.py --table-out")
        if not scaled_mm_serves:
            entries = [e if e["product"] == "triton" else dict(e, product="triton") for e in entries]
        log.info("FP8 product: %s from %s (%s)", key, path, ", ".join(f"{e['num_tokens']}: {e['product']}" for e in entries))
        return cls(entries)


def shipped_table_path(device_name: str) -> Path:
    """Where the table of a GPU named `device_name` ships (it may not exist)."""
    return tile_tables.shipped_table_path(SHIPPED, device_name)
