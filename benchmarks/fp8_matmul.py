"""The FP8 products alone on the GPU: which implementation and which tiles each token count should get.

    python benchmarks/fp8_matmul.py --out $OUT/fp8-matmul.json          # CUDA (compute capability 8.9 on), ~1 minute

Dense projections (`--shapes`, default the block projections of Qwen3-0.6B and of Qwen3-30B-A3B's attention), at
token counts from one decode token to a prefill chunk, each replayed from a CUDA graph as decode steps run it
(`triton.testing.do_bench_cudagraph`, median: the host's launch cost left out, which timing eager calls would add
to these few-microsecond products), all in the same run:
- `bf16`: `F.linear` on bf16 weights (the baseline);
- `triton`: the engine's path (`tandem.kernels.fp8`: the activations' quantization, then the product with
  `launch_config`'s tiles), and `triton_best`: the fastest of a grid of tiles and reduction splits (`SPLIT_K`)
  for the product (named), so that `launch_config` can be set from it;
- `scaled_mm`: the same quantization, then cuBLAS's block-scaled `torch._scaled_mm` (1 x 128 activation scales,
  128 x 128 weight scales), where it accepts the shape; its output is checked against the reference first (the
  layout of the weight scales it took: `scaled_mm_scale_b`), and a refusal is recorded with its error.
Routed experts (`--moe-preset`, default qwen3-30b-a3b's shape, random routing): the whole `fused_experts` replayed
from a CUDA graph (as decode steps run it) in bf16 (the shipped tile table for the GPU, else the rule) and in FP8
(the rule's FP8 tiles, and the fastest of a small grid of FP8 tiles per matmul: `fp8_best_tiles`).

Every figure is microseconds per call, with the speedup over bf16; the summary printed at the end (and written to
`--out`) names, per shape and token count, the fastest FP8 implementation.
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
from tandem.kernels import moe as moe_kernel
from tandem.kernels.fp8 import GROUP, BlockFp8Weight, launch_config, matmul, quantize_activations, reference_matmul
from tandem.kernels.moe_tiles import TileTable, rule_tiles, shape_key, shipped_table_path
from tandem.models.fp8 import block_rows, quantize_weight
from tandem.models.loading import NATIVE
from tandem.models.presets import PRESETS, preset_config

SHAPES = {"0.6b_qkv": (4096, 1024), "0.6b_o": (1024, 2048), "0.6b_gate_up": (6144, 1024), "0.6b_down": (1024, 3072),
          "30b_qkv": (5120, 2048), "30b_o": (2048, 4096)}
"""Name: (N, K) of a projection (rows of the weight, columns)."""

TOKEN_COUNTS = (1, 16, 64, 256, 2048)
"""Decode batches (a few to 512 sequences) and prefill chunks."""

DENSE_GRID = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, SPLIT_K=k)
              for m, n, w, s, k in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (3,), (1, 2, 4, 8))]
"""Tiles of the dense product tried per token count (BLOCK_K is the scale group), and splits of its reduction; each
only where BLOCK_M <= 2 M, and splits only where each share keeps 2 groups. Each tile is a kernel of its own to
compile: the grid is small so that the whole run stays near a minute."""

MOE_COUNTS = (1, 16, 64, 512)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.6b_down,30b_qkv", help=f"dense shapes among {list(SHAPES)}")
    parser.add_argument("--token-counts", default=",".join(map(str, TOKEN_COUNTS)))
    parser.add_argument("--moe-preset", default="qwen3-30b-a3b", choices=[*PRESETS, ""], help="'' to skip the experts")
    parser.add_argument("--moe-token-counts", default=",".join(map(str, MOE_COUNTS)))
    parser.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                        help="time the grids of tiles too (--no-grid: the engine's choices only, a run of seconds)")
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--commit", help="the commit measured (see benchmarks/provenance.py)")
    return parser.parse_args()


def graph_us(fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def scaled_mm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scaled product: scales multiply as `weight_scale_inv` and the activations' do; the activations'
    scales token-minor (outer-dimension-major), as `quantize_activations` gives them."""
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale_b, out_dtype=torch.bfloat16)


SCALE_B_LAYOUTS = {"blocks_k_by_n": lambda s: s.t(), "blocks_k_by_n_contiguous": lambda s: s.t().contiguous(),
                   "blocks_n_by_k": lambda s: s}
"""The weight scales as `torch._scaled_mm` may want them: our [N / 128, K / 128] transposed (as a view, or
copied), or as they are. The first whose product agrees with the reference is timed."""


def bench_dense(name: str, n: int, k: int, counts: list[int], device: torch.device, grid: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16) * 0.02
    q, scale_inv = quantize_weight(w)
    weight = BlockFp8Weight(q, scale_inv, block_rows(n, 1, device))
    out = {}
    for m in counts:
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        x_fp8, x_scale = quantize_activations(x)
        row = {"bf16": graph_us(lambda: F.linear(x, w))}
        row["triton"] = graph_us(lambda: matmul(*quantize_activations(x), weight, None, torch.bfloat16))
        row["triton_product_only"] = graph_us(lambda: matmul(x_fp8, x_scale, weight, None, torch.bfloat16))
        row["triton_tiles"] = launch_config(m)
        best = None
        for config in (c for c in DENSE_GRID if grid and c["BLOCK_M"] <= max(16, 2 * m) and c["SPLIT_K"] * 2 * GROUP <= k):
            try:
                t = graph_us(lambda: matmul(x_fp8, x_scale, weight, None, torch.bfloat16, config))
            except Exception:  # a tile over the shared memory or registers: not a candidate
                continue
            if best is None or t < best[0]:
                best = (t, config)
        if best is not None:
            row["triton_best_product_only"], row["triton_best_tiles"] = best
        reference = reference_matmul(x_fp8, x_scale, weight, None, torch.float32)
        errors = {}
        for layout, arrange in SCALE_B_LAYOUTS.items():
            scale_b = arrange(weight.scale_inv)
            try:
                got = scaled_mm(x_fp8, x_scale, weight.weight, scale_b)
            except Exception as err:  # refused shapes are the finding
                errors[layout] = f"{type(err).__name__}: {str(err)[:200]}"
                continue
            error = ((got.float() - reference).norm() / reference.norm()).item()
            if error < 2 ** -7:
                row["scaled_mm_scale_b"], row["scaled_mm_relative_error"] = layout, error
                row["scaled_mm"] = graph_us(lambda: scaled_mm(*quantize_activations(x), weight.weight, scale_b))
                break
            errors[layout] = f"disagrees with the reference: relative error {error:.3g}"
        if "scaled_mm" not in row:
            row["scaled_mm_errors"] = errors
        fp8 = {key: row[key] for key in ("triton", "scaled_mm") if key in row}
        row["fastest_fp8"] = min(fp8, key=fp8.get)
        row["speedup_over_bf16"] = {key: row["bf16"] / t for key, t in fp8.items()}
        out[m] = row
        print(name, m, json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return out


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


def main() -> None:
    args = parse_args()
    device = torch.device("cuda")
    results: dict = {"environment": environment(device, args.commit), "scale_group": GROUP, "dense": {}}
    counts = [int(c) for c in args.token_counts.split(",")]
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        results["dense"][name] = bench_dense(name, n, k, counts, device, args.grid)
    if args.moe_preset:
        results["moe"] = bench_moe(args.moe_preset, [int(c) for c in args.moe_token_counts.split(",")], device, args.grid)
    summary = {f"{name} M={m}": (row["fastest_fp8"], {k: round(v, 2) for k, v in row["speedup_over_bf16"].items()})
               for name, rows in results["dense"].items() for m, row in rows.items()}
    summary.update({f"moe T={c}": {k: round(v, 2) for k, v in row["speedup_over_bf16"].items()}
                    for c, row in results.get("moe", {}).items()})
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
