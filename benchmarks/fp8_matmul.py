"""The FP8 products alone on the GPU: which implementation and which tiles each token count should get.

    python benchmarks/fp8_matmul.py --out $OUT/fp8-matmul.json          # CUDA (compute capability 8.9 on), ~1 minute
    python benchmarks/fp8_matmul.py --shapes all --token-counts 1,16,64,256,512,2048,8192 --moe-preset '' \
        --table-out $OUT/fp8_tiles.json                                  # the dense product's table for this GPU

Dense projections (`--shapes`, default the block projections of Qwen3-0.6B and of Qwen3-30B-A3B's attention;
`all`: every one of `SHAPES`), at token counts from one decode token to a prefill chunk, each replayed from a CUDA
graph as decode steps run it (`triton.testing.do_bench_cudagraph`, median: the host's launch cost left out, which
timing eager calls would add to these few-microsecond products), all in the same run:
- `bf16`: `F.linear` on bf16 weights (the baseline);
- `rule`: the engine's path without a table (`tandem.kernels.fp8.fp8_linear`: the activations' quantization, then
  the Triton product with `launch_config`'s tiles);
- `triton_best_product_only`: the fastest Triton product (quantized inputs given) of a grid of tiles and
  reduction splits for that many rows (`dense_grid`, named in `triton_best_tiles`); `triton_best`: the
  engine's path with those tiles;
- `scaled_mm`: the engine's path with cuBLAS's block-scaled product (`tandem.kernels.fp8.scaled_mm`: 1 x 128
  activation scales, 128 x 128 weight scales), its output checked against the reference first; a refusal is
  recorded with its error.
The faster of `triton_best` and `scaled_mm` is the shape's entry for that token count in the table
`--table-out` writes (`tandem.kernels.fp8_tiles`: `engine.fp8_tile_table`; copied to
`tandem/kernels/fp8_tile_tables/<GPU name>.json` it ships as the GPU's default).
Routed experts (`--moe-preset`, default qwen3-30b-a3b's shape, random routing): the whole `fused_experts` replayed
from a CUDA graph (as decode steps run it) in bf16 (the shipped tile table for the GPU, else the rule) and in FP8
(the rule's FP8 tiles, and the fastest of a small grid of FP8 tiles per matmul: `fp8_best_tiles`).

Every figure is microseconds per call, with the speedup over bf16; the summary printed at the end (and written to
`--out`) names, per shape and token count, the fastest FP8 path and its speedup over bf16 (and the rule's).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from provenance import environment
from tandem.inference.engine.fused_moe import fused_experts
from tandem.kernels import fp8_tiles
from tandem.kernels import moe as moe_kernel
from tandem.kernels.fp8 import (GROUP, SCALED_MM_ROWS, BlockFp8Weight, fp8_linear, launch_config, matmul,
                                quantize_activations, reference_matmul, scaled_mm)
from tandem.kernels.moe_tiles import TileTable, rule_tiles, shape_key, shipped_table_path
from tandem.models.fp8 import block_rows, quantize_weight
from tandem.models.loading import NATIVE
from tandem.models.presets import PRESETS, preset_config
from tandem.transport.files import atomic_write_text

SHAPES = {"30b_qkv": (5120, 2048), "30b_o": (2048, 4096), "0.6b_qkv": (4096, 1024), "0.6b_o": (1024, 2048),
          "0.6b_gate_up": (6144, 1024), "0.6b_down": (1024, 3072)}
"""Name: (N, K) of a projection (rows of the weight, columns): Qwen3-30B-A3B's attention (its feed-forwards are all
experts) first, then Qwen3-0.6B's block."""

TOKEN_COUNTS = (1, 16, 64, 256, 2048)
"""Decode batches (a few to 512 sequences) and prefill chunks."""


def dense_grid(m: int) -> list[dict]:
    """Tiles of the Triton product tried for `m` rows (BLOCK_K is the scale group). Few rows (decode): a row block of
    16 (or one that holds them), column tiles of 32, 64 or 128 and splits of the reduction (`SPLIT_K`), so that enough
    programs share the weight's reads (a column tile of 64 gives 80 programs for 5,120 columns, fewer than an H100's
    132 SMs); a few hundred: blocks of 64 or 128 rows; many (prefill): large tiles, 8 warps, 3 or 4 stages. Each tile
    is a kernel of its own to compile (about a second): the grid stays near 30 tiles, so that a sweep of every shape
    stays near a minute."""
    if m <= 64:
        return [dict(BLOCK_M=bm, BLOCK_N=n, num_warps=4, num_stages=4, SPLIT_K=k)
                for bm, n, k in itertools.product(sorted({16, min(64, max(16, 1 << (m - 1).bit_length()))}), (32, 64, 128), (1, 2, 4))]
    if m <= 256:
        return [dict(BLOCK_M=bm, BLOCK_N=n, num_warps=4 if bm < 128 else 8, num_stages=3, SPLIT_K=k)
                for bm, n, k in ((64, 64, 1), (64, 128, 1), (128, 64, 1), (128, 128, 1), (64, 64, 2), (64, 128, 2))]
    return [dict(BLOCK_M=bm, BLOCK_N=n, num_warps=w, num_stages=s, SPLIT_K=1)
            for bm, n, w, s in ((64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3),
                                (64, 256, 8, 3), (128, 64, 4, 4))]


MOE_COUNTS = (1, 16, 64, 512)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.6b_down,30b_qkv", help=f"dense shapes among {list(SHAPES)}, or all")
    parser.add_argument("--token-counts", default=",".join(map(str, TOKEN_COUNTS)))
    parser.add_argument("--moe-preset", default="qwen3-30b-a3b", choices=[*PRESETS, ""], help="'' to skip the experts")
    parser.add_argument("--moe-token-counts", default=",".join(map(str, MOE_COUNTS)))
    parser.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                        help="time the grids of tiles too (--no-grid: the engine's choices only, a run of seconds)")
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--table-out", help="write the dense product's table (engine.fp8_tile_table) to this JSON file")
    parser.add_argument("--commit", help="the commit measured (see benchmarks/provenance.py)")
    return parser.parse_args()


def graph_us(fn, rep: int = 20) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


SWEEP_REP_MS = 3
"""Milliseconds of calls per replay when timing the dense grid (each timing replays 10 times): short, so that every
shape's grid fits one run."""


def engine_path_us(x: torch.Tensor, weight: BlockFp8Weight, product: str, tiles: dict | None) -> float:
    """The engine's FP8 path (`fp8_linear`: quantization, then the product) with one choice of product and tiles."""
    weight.tiles = fp8_tiles.ProductTiles([{"num_tokens": 1, "product": product, "tiles": tiles}])
    try:
        return graph_us(lambda: fp8_linear(x, weight), SWEEP_REP_MS)
    finally:
        weight.tiles = None


def scaled_mm_check(x: torch.Tensor, weight: BlockFp8Weight) -> tuple[float | None, str | None]:
    """(relative error against the reference, None), or (None, the error) where cuBLAS refuses the shape or disagrees."""
    m = x.shape[0]
    try:
        x_fp8, x_scale = quantize_activations(x, SCALED_MM_ROWS)
        got = scaled_mm(x_fp8, x_scale, weight, None, torch.bfloat16)[:m]
    except Exception as err:  # a refusal is the finding
        return None, f"{type(err).__name__}: {str(err)[:300]}"
    reference = reference_matmul(x_fp8[:m], x_scale[:m], weight, None, torch.float32)
    error = ((got.float() - reference).norm() / reference.norm()).item()
    return (error, None) if error < 2 ** -7 else (None, f"disagrees with the reference: relative error {error:.3g}")


def bench_dense(name: str, n: int, k: int, counts: list[int], device: torch.device, grid: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16) * 0.02
    q, scale_inv = quantize_weight(w)
    weight = BlockFp8Weight(q, scale_inv, block_rows(n, 1, device))
    out = {}
    for m in counts:
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        x_fp8, x_scale = quantize_activations(x)
        row = {"bf16": graph_us(lambda: F.linear(x, w), SWEEP_REP_MS), "rule": engine_path_us(x, weight, "triton", None)}
        paths = {"rule": row["rule"]}
        best = None
        for config in (c for c in dense_grid(m) if grid and c["SPLIT_K"] * 2 * GROUP <= k):
            try:
                t = graph_us(lambda: matmul(x_fp8, x_scale, weight, None, torch.bfloat16, config), SWEEP_REP_MS)
            except Exception:  # a tile over the shared memory or registers: not a candidate
                continue
            if best is None or t < best[0]:
                best = (t, config)
        if best is not None:
            row["triton_best_product_only"], row["triton_best_tiles"] = best
            row["triton_best"] = paths["triton_best"] = engine_path_us(x, weight, "triton", best[1])
        row["scaled_mm_relative_error"], refusal = scaled_mm_check(x, weight)
        if refusal is None:
            row["scaled_mm"] = paths["scaled_mm"] = engine_path_us(x, weight, "scaled_mm", None)
        else:
            row["scaled_mm_error"] = refusal
        row["fastest_fp8"] = min(paths, key=paths.get)
        row["speedup_over_bf16"] = {key: row["bf16"] / t for key, t in paths.items()}
        out[m] = row
        print(name, m, json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return out


def table_entries(rows: dict) -> list[dict]:
    """The table's entries of one shape: per token count, the faster of the best Triton tiles and cuBLAS (the rule's
    tiles where no grid ran), with the timings that chose it."""
    entries = []
    for m, row in rows.items():
        timed = {key: row[key] for key in ("triton_best", "scaled_mm") if key in row}
        product = min(timed, key=timed.get) if timed else "rule"
        entry = {"num_tokens": int(m), "product": "scaled_mm" if product == "scaled_mm" else "triton",
                 "us": {key: round(row[key], 2) for key in ("bf16", "rule", *timed)}}
        if product == "triton_best":
            entry["tiles"] = row["triton_best_tiles"]
        elif product == "rule":
            entry["tiles"] = launch_config(int(m))
        entries.append(entry)
    return entries


def moe_grid(rule: dict) -> list[dict]:
    """FP8 expert tiles tried around the rule's row block (a small grid: each is a kernel to compile)."""
    return [dict(rule, BLOCK_N=n, BLOCK_K=128, num_warps=w, num_stages=3) for n, w in itertools.product((64, 128), (4, 8))]


def bench_moe(preset: str, counts: list[int], device: torch.device, grid: bool) -> dict:
    config = preset_config(preset)
    args = NATIVE[config["model_type"]][0].from_hf(config).moe_args()
    e, h, i, k = args.num_experts, args.hidden_size, args.intermediate_size, args.top_k
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up = (torch.randn(e, 2 * i, h, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    down = (torch.randn(e, h, i, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    fp8_weights = (*quantize_weight(gate_up, 2), *quantize_weight(down))
    gate_up_fp8, gate_up_scale, down_fp8, down_scale = fp8_weights
    key = shape_key(e, k, h, i, torch.bfloat16)
    shipped = shipped_table_path(torch.cuda.get_device_name(device))
    bf16_table = TileTable.load(shipped if shipped.is_file() else None, key, k, e, "the shipped MoE tile table")
    out = {}
    for count in counts:
        x = torch.randn(count, h, device=device, generator=gen).to(torch.bfloat16)
        expert_ids = torch.rand(count, e, device=device, generator=gen).topk(k, dim=-1).indices
        routing = torch.full((count, k), 1.0 / k, device=device)
        rule = rule_tiles(count, k, e, fp8=True)
        row = {"bf16": graph_us(lambda: fused_experts(x, gate_up, down, routing, expert_ids, bf16_table.tiles(count))),
               "fp8_rule": graph_us(lambda: fused_experts(x, gate_up_fp8, down_fp8, routing, expert_ids, (rule, rule),
                                                          (gate_up_scale, down_scale)))}
        row["speedup_over_bf16"] = {"fp8_rule": row["bf16"] / row["fp8_rule"]}
        if grid:
            row.update(best_moe_tiles(x, expert_ids, routing, rule, fp8_weights))
            row["speedup_over_bf16"]["fp8_best"] = row["bf16"] / row["fp8_best"]
        out[count] = row
        print("moe", count, json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return out


def best_moe_tiles(x: torch.Tensor, expert_ids: torch.Tensor, routing: torch.Tensor, rule: dict,
                   fp8_weights: tuple[torch.Tensor, ...]) -> dict:
    """Each FP8 matmul's fastest tiles of `moe_grid` (timed alone), and the whole fused experts with them."""
    gate_up_fp8, gate_up_scale, down_fp8, down_scale = fp8_weights
    (count, k), num_experts, intermediate = expert_ids.shape, gate_up_fp8.shape[0], down_fp8.shape[2]
    blocks = moe_kernel.align_to_blocks(expert_ids, num_experts, rule["BLOCK_M"])
    x_fp8, x_scale = quantize_activations(x)
    h_fp8, h_scale = quantize_activations(torch.randn(count * k, intermediate, device=x.device).to(torch.bfloat16))
    runs = {"gate_up": lambda t: moe_kernel.grouped_matmul(
                x_fp8, gate_up_fp8, blocks, k, count * k, t, gated=True,
                fp8=moe_kernel.Fp8Operands(x_scale, gate_up_scale, torch.bfloat16)),
            "down": lambda t: moe_kernel.grouped_matmul(
                h_fp8, down_fp8, blocks, 1, count * k, t, routing.reshape(-1),
                fp8=moe_kernel.Fp8Operands(h_scale, down_scale, torch.bfloat16))}
    best = {}
    for matmul_name, run in runs.items():
        timed = []
        for tiles in moe_grid(rule):
            try:
                timed.append((graph_us(lambda: run(tiles)), tiles))
            except Exception:  # over the shared memory: not a candidate
                continue
        best[matmul_name] = min(timed, key=lambda pair: pair[0])[1]
    tiles = (best["gate_up"], best["down"])
    return {"fp8_best_tiles": best, "fp8_best": graph_us(lambda: fused_experts(
        x, gate_up_fp8, down_fp8, routing, expert_ids, tiles, (gate_up_scale, down_scale)))}


def write_table(path: Path, results: dict, device: torch.device) -> None:
    """The dense product's table of the shapes measured so far (`tandem.kernels.fp8_tiles`), replaced atomically."""
    import triton

    shapes = {fp8_tiles.shape_key(*SHAPES[name]): table_entries(rows) for name, rows in results["dense"].items()}
    table = {"device": torch.cuda.get_device_name(device), "triton": triton.__version__, "torch": torch.__version__,
             "commit": results["environment"]["commit"], "shapes": shapes}
    atomic_write_text(path, json.dumps(table, indent=1) + "\n")


def main() -> None:
    args = parse_args()
    device = torch.device("cuda")
    results: dict = {"environment": environment(device, args.commit), "scale_group": GROUP, "dense": {}}
    counts = [int(c) for c in args.token_counts.split(",")]
    for name in (SHAPES if args.shapes == "all" else args.shapes.split(",")):
        n, k = SHAPES[name]
        results["dense"][name] = bench_dense(name, n, k, counts, device, args.grid)
        if args.table_out:  # after each shape: a run cut short keeps the shapes it measured
            write_table(Path(args.table_out), results, device)
    if args.moe_preset:
        results["moe"] = bench_moe(args.moe_preset, [int(c) for c in args.moe_token_counts.split(",")], device, args.grid)
    summary = {f"{name} M={m}": (row["fastest_fp8"], {k: round(v, 2) for k, v in row["speedup_over_bf16"].items()})
               for name, rows in results["dense"].items() for m, row in rows.items()}
    summary.update({f"moe T={c}": {k: round(v, 2) for k, v in row["speedup_over_bf16"].items()}
                    for c, row in results.get("moe", {}).items()})
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.table_out:
        print(f"wrote {args.table_out}; to ship it: cp {args.table_out} "
              f"{fp8_tiles.shipped_table_path(torch.cuda.get_device_name(device))}")


if __name__ == "__main__":
    main()
