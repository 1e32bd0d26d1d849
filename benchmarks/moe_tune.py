"""Tune the engine's MoE grouped-matmul tiles on this GPU: the table `tandem.kernels.moe_tiles` reads.

    python benchmarks/moe_tune.py --preset qwen3-30b-a3b --out $OUT          # about 2-3 minutes on one H200
    TRITON_INTERPRET=1 python benchmarks/moe_tune.py --preset tiny-moe --token-counts 1,40 --quick --out /tmp/t
    python benchmarks/moe_tune.py --preset qwen3-30b-a3b --fp8 --out $OUT     # the FP8 experts' tiles

`--fp8`: the experts as `engine.quantization = "fp8"` holds them (128 x 128 block FP8, each matmul's rows quantized
per 128 columns beforehand, out of the timings), with tiles whose BLOCK_K divides 128 (one scale group a step); the
table's key names `dtype=float8_e4m3fn`, so one table file can hold both.

For the preset's expert shapes (gate_up [E, 2I, H], SiLU * up in its epilogue; down [E, H, I], times the
routing weights) and the token counts the engine runs (decode batches of its CUDA graphs, prefill chunks),
with random routing (k distinct experts per token, uniform), each matmul is timed alone
(`triton.testing.do_bench`: CUDA events, L2 flushed before each run, median):
1. coarse pass: BLOCK_N x BLOCK_K x num_warps over the row blocks (BLOCK_M) that suit the rows per expert,
   3 stages (2 where 3 do not fit); tiles over the shared memory or the registers of a block are left out;
2. fine pass: around each (matmul, BLOCK_M)'s winner, other stage counts, GROUP_M, half the BLOCK_N and the
   other warp count;
3. per token count, the BLOCK_M whose gate_up + down time is least (the two share one row layout).
Every tile is a kernel of its own: before each pass a pool of processes compiles them into Triton's
on-disk cache (seconds instead of minutes). Past `--budget-s` only the rule's tiles are timed (the fine pass,
and the coarse one if the pool failed and compiling took the time): token counts left untuned keep the rule.

Writes, under `--out`:
- `moe_tiles.json`: the table. The engine uses it with `engine.moe_tile_table` (`benchmarks/inference.py
  --moe-tile-table`); to ship it, copy it to `tandem/kernels/moe_tile_tables/<GPU name>.json` (the path
  printed at the end);
- `moe_tune.json`: per token count, each chosen matmul's time, the bytes it must read and write (the weights
  of the experts hit + activations + output) and its GB/s as a fraction of the GPU's nominal bandwidth, its
  TFLOP/s as a fraction of the nominal bf16 peak (whichever fraction is higher is the bound that applies),
  the same matmuls with the untuned rule's tiles, and the whole `fused_experts` (layout + both matmuls + the
  sum of k copies) replayed from a CUDA graph with the table and with the rule; each chosen entry is checked
  against the rule's output (bf16 tolerance) and left out of the table if it differs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import time
from pathlib import Path

import torch

from provenance import environment
from roofline import nominal_bandwidth
from tandem.kernels import moe as moe_kernel
from tandem.inference.engine.fused_moe import fused_experts
from tandem.kernels.fp8 import FP8, GROUP, quantize_activations
from tandem.kernels.moe_tiles import TILE_KEYS, rule_tiles, shape_key, shipped_table_path
from tandem.models.fp8 import quantize_weight
from tandem.models.loading import NATIVE, build_native
from tandem.models.moe import MoE, MoEArgs
from tandem.models.presets import PRESETS, preset_config

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Decode batches (the engine's CUDA graphs: 1, 2, 4, 8, then multiples of 16; a batch takes the entry of the
smallest tuned count that holds it) and prefill chunks (`engine.max_num_batched_tokens`)."""

MATMULS = ("gate_up", "down")
"""gate_up: x [N, H] -> SiLU(gate) * up [N*k, I]; down: [N*k, I] -> [N*k, H], times the routing weights."""

COARSE = dict(BLOCK_N=(64, 128, 256), BLOCK_K=(64, 128, 256), num_warps=(4, 8))
FINE_STAGES, FINE_GROUP_M = (2, 4, 5), (1, 16)

SHARED_MEMORY = 227 * 1024
"""Bytes of shared memory one block may use on Hopper (H100, H200)."""

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
"""Dense bf16 FLOP/s by GPU name (data sheet, without sparsity)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=list(PRESETS), help="a mixture-of-experts preset")
    parser.add_argument("--out", required=True, help="folder for moe_tiles.json and moe_tune.json")
    parser.add_argument("--token-counts", default=",".join(map(str, TOKEN_COUNTS)))
    parser.add_argument("--budget-s", type=float, default=150.0, help="seconds of tuning; past them, the rule's tiles")
    parser.add_argument("--quick", action="store_true", help="a grid of two tiles (a check that the script runs)")
    parser.add_argument("--fp8", action="store_true", help="tune the FP8 experts (`engine.quantization = \"fp8\"`)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", help="the commit measured (see benchmarks/provenance.py)")
    return parser.parse_args()


def moe_args_of(preset: str) -> MoEArgs:
    config = preset_config(preset)
    model_args = NATIVE[config["model_type"]][0].from_hf(config)
    if not hasattr(model_args, "moe_args"):
        raise SystemExit(f"--preset {preset}: not a mixture of experts")
    return model_args.moe_args()


def num_moe_layers(preset: str) -> int:
    """MoE blocks of the preset's model (built on the meta device: no memory)."""
    return sum(isinstance(m, MoE) for m in build_native(preset_config(preset)).modules())


def expert_weights(args: MoEArgs, device: torch.device, dtype: torch.dtype, fp8: bool = False) -> dict[str, torch.Tensor]:
    """Random expert weights in the model's layout (`tandem.models.moe.GroupedExperts`); `fp8`: in block FP8
    (`tandem.models.fp8.Fp8Experts`), their scales under `<matmul>_scales`."""
    e, h, i = args.num_experts, args.hidden_size, args.intermediate_size
    weights = {"gate_up": (torch.randn(e, 2 * i, h, device=device) * 0.02).to(dtype),
               "down": (torch.randn(e, h, i, device=device) * 0.02).to(dtype)}
    if fp8:
        weights["gate_up"], weights["gate_up_scales"] = quantize_weight(weights["gate_up"], parts=2)
        weights["down"], weights["down_scales"] = quantize_weight(weights["down"])
    return weights


class Problem:
    """One token count's inputs: random routing of `num_tokens` tokens, its row layout per BLOCK_M."""

    def __init__(self, args: MoEArgs, weights: dict, num_tokens: int, device: torch.device, dtype: torch.dtype):
        self.args, self.weights, self.num_tokens = args, weights, num_tokens
        self.num_copies = num_tokens * args.top_k
        scores = torch.rand(num_tokens, args.num_experts, device=device)
        self.expert_ids = scores.topk(args.top_k, dim=-1).indices
        self.routing = torch.rand(num_tokens, args.top_k, device=device)
        self.routing /= self.routing.sum(-1, keepdim=True)
        self.x = torch.randn(num_tokens, args.hidden_size, device=device, dtype=dtype)
        self.hidden = torch.randn(self.num_copies, args.intermediate_size, device=device, dtype=dtype)
        self.experts_hit = self.expert_ids.unique().numel()
        self.layouts: dict[int, moe_kernel.ExpertBlocks] = {}
        self.fp8 = weights["gate_up"].dtype == FP8
        if self.fp8:  # each matmul's rows quantized once, as the engine does before it (not timed here)
            self.rows = {m: quantize_activations(a) for m, a in (("gate_up", self.x), ("down", self.hidden))}

    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts' block scales (gate_up, down) where they are FP8, as `fused_experts` takes them."""
        return (self.weights["gate_up_scales"], self.weights["down_scales"]) if self.fp8 else None

    def layout(self, block_m: int) -> moe_kernel.ExpertBlocks:
        if block_m not in self.layouts:
            self.layouts[block_m] = moe_kernel.align_to_blocks(self.expert_ids, self.args.num_experts, block_m)
        return self.layouts[block_m]

    def run(self, matmul: str, tiles: dict) -> torch.Tensor:
        blocks = self.layout(tiles["BLOCK_M"])
        a, fp8 = (self.x if matmul == "gate_up" else self.hidden), None
        if self.fp8:
            a, row_scales = self.rows[matmul]
            fp8 = moe_kernel.Fp8Operands(row_scales, self.weights[f"{matmul}_scales"], self.x.dtype)
        if matmul == "gate_up":
            return moe_kernel.grouped_matmul(a, self.weights["gate_up"], blocks, self.args.top_k, self.num_copies,
                                             tiles, gated=True, fp8=fp8)
        return moe_kernel.grouped_matmul(a, self.weights["down"], blocks, 1, self.num_copies, tiles,
                                         routing=self.routing.reshape(-1), fp8=fp8)

    def traffic(self, matmul: str) -> tuple[int, int]:
        """(bytes the matmul must read and write at least, its FLOPs)."""
        a = self.args
        n_out, k_dim = (2 * a.intermediate_size, a.hidden_size) if matmul == "gate_up" else (a.hidden_size, a.intermediate_size)
        rows_in = self.num_tokens if matmul == "gate_up" else self.num_copies
        out_cols = a.intermediate_size if matmul == "gate_up" else a.hidden_size
        size = self.weights[matmul].element_size()
        moved = (self.experts_hit * n_out * k_dim + rows_in * k_dim + self.num_copies * out_cols) * size
        return moved, 2 * self.num_copies * n_out * k_dim


def block_ms(num_tokens: int, args: MoEArgs) -> list[int]:
    """Row blocks worth trying: about the rows per expert, never far past them (padding is wasted work)."""
    rows = num_tokens * args.top_k / args.num_experts
    if rows < 4:
        return [16]
    if rows >= 128:
        return [64, 128]
    return [m for m in (16, 32, 64, 128) if m <= max(32, 1 << int(2 * rows - 1).bit_length())]


def fits(tiles: dict, gated: bool) -> bool:
    """Within a block's shared memory (the pipeline's stages of both tiles) and registers (the accumulators)."""
    weight_tiles = 2 if gated else 1
    shared = tiles["num_stages"] * (tiles["BLOCK_M"] + weight_tiles * tiles["BLOCK_N"]) * tiles["BLOCK_K"] * 2
    accumulators = weight_tiles * tiles["BLOCK_M"] * tiles["BLOCK_N"] / (32 * tiles["num_warps"])
    return shared <= SHARED_MEMORY and accumulators <= 128


def coarse_grid(block_m: int, matmul: str, quick: bool, fp8: bool = False) -> list[dict]:
    """`fp8`: only BLOCK_Ks that divide the scale group."""
    if quick:
        return [dict(BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2) for n in (32, 64)]
    grid = []
    for n, k, w in itertools.product(*COARSE.values()):  # 3 stages, or 2 where 3 do not fit
        if fp8 and GROUP % k:
            continue
        fitting = [t for t in (dict(BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, num_warps=w, num_stages=s)
                               for s in (3, 2)) if fits(t, matmul == "gate_up")]
        grid += fitting[:1]
    return grid


def fine_grid(best: dict, matmul: str) -> list[dict]:
    """Neighbours of a coarse winner, one setting changed at a time."""
    near = [dict(best, num_stages=s) for s in FINE_STAGES] + [dict(best, GROUP_M=g) for g in FINE_GROUP_M]
    near += [dict(best, BLOCK_N=best["BLOCK_N"] // 2), dict(best, num_warps=12 - best["num_warps"])]
    return [t for t in near if t != best and t["BLOCK_N"] >= 32 and fits(t, matmul == "gate_up")]


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds of `fn` (CUDA: `do_bench`, L2 flushed; CPU, the interpreter: one timed run)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=2, rep=10, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def time_graph_ms(fn, device: torch.device) -> float:
    """Milliseconds of `fn` replayed from a CUDA graph (as decode steps run; no L2 flush), else one timed run."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    return time_ms(fn, device)


def tile_id(tiles: dict) -> tuple:
    return tuple(tiles[k] for k in TILE_KEYS)


def compile_tiles(preset: str, dtype_name: str, device_name: str, jobs: list[tuple[str, dict]], fp8: bool) -> list[str]:
    """In a pool worker: compile each (matmul, tiles) into Triton's on-disk cache by running it once on one token
    of the real shapes (so the same specialization as the timed runs); top_k experts suffice. The failures."""
    args = moe_args_of(preset)
    args.num_experts = args.top_k
    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    problem = Problem(args, expert_weights(args, device, dtype, fp8), 1, device, dtype)
    failures = []
    for matmul, tiles in jobs:
        try:
            problem.run(matmul, tiles)
        except Exception as err:  # a tile that cannot run is left out of the timings
            failures.append(f"{matmul} {tiles}: {type(err).__name__}: {str(err)[:200]}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return failures


def precompile(preset: str, dtype: torch.dtype, jobs: list[tuple[str, dict]], device: torch.device, fp8: bool) -> dict:
    """Compile `jobs` in a pool of processes (CUDA only: the interpreter compiles nothing). Where the pool
    fails, the timed runs compile what it did not: slower, same figures."""
    unique = list({(m, tile_id(t)): (m, t) for m, t in jobs}.values())
    if device.type != "cuda" or not unique:
        return {"kernels": len(unique), "seconds": 0.0}
    workers = max(1, min(len(unique), (os.cpu_count() or 2) - 1, 16))
    start = time.perf_counter()
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            name = str(dtype).removeprefix("torch.")
            failures = sum(pool.map(compile_tiles, [preset] * workers, [name] * workers, [str(device)] * workers,
                                    [unique[w::workers] for w in range(workers)], [fp8] * workers), [])
    except Exception as err:  # see the docstring
        return {"kernels": len(unique), "seconds": time.perf_counter() - start, "error": f"{type(err).__name__}: {err}"}
    return {"kernels": len(unique), "workers": workers, "seconds": time.perf_counter() - start,
            "failures": len(failures), "first_failures": failures[:5]}


def time_all(problem: Problem, matmul: str, candidates: list[dict], device: torch.device, timings: dict,
             deadline: float) -> None:
    """Add each candidate's milliseconds to `timings` {tile id: (ms, tiles)}; inf where it cannot run. Past
    `deadline` (perf_counter seconds) only the first candidate (the rule's tiles) is timed."""
    for i, tiles in enumerate(candidates):
        if tile_id(tiles) in timings or (i > 0 and time.perf_counter() > deadline):
            continue
        try:
            ms = time_ms(lambda: problem.run(matmul, tiles), device)
        except Exception:  # out of resources and the like: not a candidate
            ms = float("inf")
        timings[tile_id(tiles)] = (ms, tiles)


def best_of(timings: dict, block_m: int) -> tuple[float, dict] | None:
    found = [v for v in timings.values() if v[1]["BLOCK_M"] == block_m and v[0] < float("inf")]
    return min(found, key=lambda v: v[0]) if found else None


def tune(problems: dict[int, Problem], cli: argparse.Namespace, dtype: torch.dtype, device: torch.device,
         start: float) -> tuple[dict, list[dict]]:
    """Coarse then fine pass over every token count: {(count, matmul): {tile id: (ms, tiles)}}, and the pool's figures."""
    args = next(iter(problems.values())).args
    timings = {(n, m): {} for n in problems for m in MATMULS}
    rule = {n: rule_tiles(n, args.top_k, args.num_experts, cli.fp8) for n in problems}
    coarse = {(n, m): [rule[n]] + [t for bm in block_ms(n, args) for t in coarse_grid(bm, m, cli.quick, cli.fp8)]
              for n in problems for m in MATMULS}
    pools = [precompile(cli.preset, dtype, [(m, t) for (_, m), ts in coarse.items() for t in ts], device, cli.fp8)]
    deadline = start + cli.budget_s
    for (n, m), candidates in coarse.items():
        time_all(problems[n], m, candidates, device, timings[(n, m)], deadline)
    print(f"coarse pass done at {time.perf_counter() - start:.0f} s", flush=True)
    fine = {}
    for (n, m), found in timings.items():
        winners = [best_of(found, bm) for bm in block_ms(n, args)]
        fine[(n, m)] = [t for w in winners if w for t in fine_grid(w[1], m)] if not cli.quick else []
    if time.perf_counter() < deadline:
        pools.append(precompile(cli.preset, dtype, [(m, t) for (_, m), ts in fine.items() for t in ts], device, cli.fp8))
    for (n, m), candidates in fine.items():
        time_all(problems[n], m, [rule[n]] + candidates, device, timings[(n, m)], deadline)
    print(f"fine pass done at {time.perf_counter() - start:.0f} s", flush=True)
    return timings, pools


def choose(problem: Problem, timings: dict) -> dict | None:
    """The BLOCK_M whose gate_up + down milliseconds are least, and each matmul's fastest tiles with it."""
    n, args, options = problem.num_tokens, problem.args, []
    for bm in {*block_ms(n, args), rule_tiles(n, args.top_k, args.num_experts)["BLOCK_M"]}:
        pair = [best_of(timings[(n, m)], bm) for m in MATMULS]
        if all(pair):
            options.append((pair[0][0] + pair[1][0], pair))
    if not options:
        return None
    (gate_up_ms, gate_up), (down_ms, down) = min(options, key=lambda o: o[0])[1]
    return {"num_tokens": n, "gate_up": gate_up, "down": down, "ms": {"gate_up": gate_up_ms, "down": down_ms}}


def matmul_figures(problem: Problem, matmul: str, ms: float, bandwidth: float | None, peak: float | None) -> dict:
    moved, flops = problem.traffic(matmul)
    figures = {"ms": ms, "bytes": moved, "gb_per_s": moved / ms / 1e6, "tflop_per_s": flops / ms / 1e9}
    if bandwidth:
        figures["bandwidth_fraction"] = moved / (ms / 1e3) / bandwidth
    if peak:
        figures["compute_fraction"] = flops / (ms / 1e3) / peak
    return figures


def measure(problem: Problem, entry: dict, timings: dict, device: torch.device, bandwidth: float | None,
            peak: float | None, num_layers: int) -> dict:
    """The chosen entry's figures, the rule's, and the whole fused experts with each, checked against each other;
    `all_moe_layers_ms`: the fused experts times the model's `num_layers` MoE blocks (a decode step's share)."""
    args, n = problem.args, problem.num_tokens
    rule = rule_tiles(n, args.top_k, args.num_experts, problem.fp8)
    figures = {"experts_hit": problem.experts_hit, "tiles": {m: entry[m] for m in MATMULS}}
    for m in MATMULS:
        figures[m] = matmul_figures(problem, m, entry["ms"][m], bandwidth, peak)
        figures[f"rule_{m}_ms"] = timings[(n, m)].get(tile_id(rule), (None,))[0]

    def fused(tiles: tuple[dict, dict]):
        return lambda: fused_experts(problem.x, problem.weights["gate_up"], problem.weights["down"], problem.routing,
                                     problem.expert_ids, tiles, problem.scales())

    tuned, untuned = (entry["gate_up"], entry["down"]), (rule, rule)
    with torch.no_grad():
        out, expected = fused(tuned)().float(), fused(untuned)().float()
        figures["max_abs_diff_vs_rule"] = (out - expected).abs().max().item()
        figures["agrees_with_rule"] = figures["max_abs_diff_vs_rule"] <= 2e-2 * max(expected.abs().max().item(), 1e-6)
        figures["layout_ms"] = time_graph_ms(lambda: moe_kernel.align_to_blocks(problem.expert_ids, args.num_experts,
                                                                                 entry["gate_up"]["BLOCK_M"]), device)
        figures["fused_experts_ms"] = time_graph_ms(fused(tuned), device)
        figures["fused_experts_rule_ms"] = time_graph_ms(fused(untuned), device)
    figures["fused_speedup_over_rule"] = figures["fused_experts_rule_ms"] / figures["fused_experts_ms"]
    figures["all_moe_layers_ms"] = figures["fused_experts_ms"] * num_layers
    return figures


def write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    tmp.replace(path)


def main() -> None:
    cli = parse_args()
    start = time.perf_counter()
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16 dot
    torch.manual_seed(cli.seed)
    args = moe_args_of(cli.preset)
    key = shape_key(args.num_experts, args.top_k, args.hidden_size, args.intermediate_size, FP8 if cli.fp8 else dtype)
    weights = expert_weights(args, device, dtype, cli.fp8)
    problems = {n: Problem(args, weights, n, device, dtype) for n in map(int, cli.token_counts.split(","))}
    timings, pools = tune(problems, cli, dtype, device, start)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = nominal_bandwidth(device)
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    entries, figures, num_layers = [], {}, num_moe_layers(cli.preset)
    for n, problem in problems.items():
        entry = choose(problem, timings)
        if entry is None:
            figures[n] = {"error": "no tile ran"}
            continue
        figures[n] = measure(problem, entry, timings, device, bandwidth, peak, num_layers)
        if figures[n]["agrees_with_rule"]:
            entries.append(entry)
        print(json.dumps({"num_tokens": n, **{k: v for k, v in figures[n].items() if k != "tiles"}}, default=str), flush=True)
    env = environment(device, cli.commit)
    import triton

    write_json(out / "moe_tiles.json", {"device": gpu, "triton": triton.__version__, "torch": torch.__version__,
                                        "commit": env["commit"], "shapes": {key: entries}})
    write_json(out / "moe_tune.json", {
        "environment": env, "preset": cli.preset, "shape": key, "num_moe_layers": num_layers, "pools": pools, "seconds": time.perf_counter() - start,
        "nominal_bandwidth": bandwidth, "nominal_bf16_flops": peak, "by_num_tokens": figures,
        "timed": {f"{n} {m}": len(t) for (n, m), t in timings.items()}})
    print(f"wrote {out / 'moe_tiles.json'} and moe_tune.json in {time.perf_counter() - start:.0f} s; "
          f"to ship the table: cp {out / 'moe_tiles.json'} {shipped_table_path(gpu)}")


if __name__ == "__main__":
    main()
