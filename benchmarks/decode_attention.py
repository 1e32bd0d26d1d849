"""Decode attention alone on the GPU: the split-KV kernels (`tandem/kernels/attention.py`) at the decode shapes of
the engine benchmark's workloads, against the unsplit walk (one program per sequence and KV head over its
whole context: the kernel before the split), with a few other chunk sizes and launch settings.

    python benchmarks/decode_attention.py --out $OUT/decode-attention.json     # CUDA, under a minute

Figures per shape (sequences x context, Qwen3-0.6B heads by default, bf16, blocks of 16 scattered at random):
microseconds per call (one layer), the KV bytes it reads per second, its fraction of a device copy's
bandwidth measured in the same run (`benchmarks/roofline.py`), the speedup of the engine's setting over
the unsplit walk, and each other setting's time and largest difference from the engine's output (a
setting worth adopting must be faster and agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from provenance import environment
from roofline import measured_copy_bandwidth
from tandem.kernels import attention as attention_kernel
from tandem.kernels.attention import SPLIT_KEYS, _DECODE_LAUNCH, _split_decode

SHAPES = {"A": (256, 640), "C": (128, 4352), "D_mid": (64, 5120), "D": (64, 9216), "E": (4, 32896), "F": (4, 131072)}
"""Name: (sequences, context); the longest context of each workload (D_mid: half-way through D)."""

SETTINGS = {
    "engine": (SPLIT_KEYS, _DECODE_LAUNCH),
    "split256": (256, _DECODE_LAUNCH),
    "split1024": (1024, _DECODE_LAUNCH),
    "block64_warps1": (SPLIT_KEYS, dict(BLOCK_N=64, num_warps=1, num_stages=2)),
    "block64_warps2": (SPLIT_KEYS, dict(BLOCK_N=64, num_warps=2, num_stages=2)),
    "block32_stages3": (SPLIT_KEYS, dict(BLOCK_N=32, num_warps=1, num_stages=3)),
    "block64_warps2_stages3": (SPLIT_KEYS, dict(BLOCK_N=64, num_warps=2, num_stages=3)),
    "block64_warps4_stages3": (SPLIT_KEYS, dict(BLOCK_N=64, num_warps=4, num_stages=3)),
    "block128_warps4_stages2": (SPLIT_KEYS, dict(BLOCK_N=128, num_warps=4, num_stages=2)),
}
"""Name: (keys per chunk, launch settings); "unsplit" (one chunk of the whole context) is added per shape."""


def decode_case(num_seqs: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                device: torch.device) -> tuple:
    """(q, k_cache, v_cache, block_tables, seq_lens, query_start) of one decode step over random blocks."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, device=device)
    q = torch.randn(num_seqs, heads, head_dim, device=device, dtype=torch.bfloat16)
    return q, k_cache, v_cache, tables, seq_lens, torch.arange(num_seqs + 1, device=device)


def time_call(fn, repeats: int) -> float:
    """Seconds per call: the mean of `repeats` calls between CUDA events, after a warmup call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def bench_shape(num_seqs: int, context: int, args: argparse.Namespace, bandwidth: float, device: torch.device) -> dict:
    q, k_cache, v_cache, tables, seq_lens, query_start = decode_case(num_seqs, context, args.heads, args.kv_heads,
                                                                     args.head_dim, args.block_size, device)
    kv_bytes = 2 * num_seqs * context * args.kv_heads * args.head_dim * k_cache.element_size()
    settings = dict(SETTINGS, unsplit=(context, _DECODE_LAUNCH))
    outputs: dict[str, torch.Tensor] = {}
    figures: dict = {"sequences": num_seqs, "context": context, "kv_bytes": kv_bytes}
    for name, (split_keys, launch) in settings.items():
        out = torch.empty_like(q)

        def call():
            _split_decode(q, k_cache, v_cache, out, tables, seq_lens, query_start, -(-context // split_keys), split_keys, launch)

        try:
            seconds = time_call(call, args.repeats)
        except Exception as err:  # a setting the GPU cannot run (shared memory, registers): record it, go on
            figures[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        outputs[name] = out.clone()
        reference = outputs.get("engine", out)
        figures[name] = {"us": seconds * 1e6, "kv_bytes_per_s": kv_bytes / seconds,
                         "fraction_of_copy_bandwidth": kv_bytes / seconds / bandwidth,
                         "max_abs_diff_from_engine": (out.float() - reference.float()).abs().max().item()}
    if "us" in figures.get("unsplit", {}) and "us" in figures.get("engine", {}):
        figures["speedup_engine_over_unsplit"] = figures["unsplit"]["us"] / figures["engine"]["us"]
    return figures


def attention_bench_args(doc: str, shapes: dict) -> tuple[argparse.Namespace, torch.device]:
    """The attention kernel benchmarks' shared options (heads, block size, repeats, shape names, --out) and their
    CUDA device; exits where the kernels cannot run."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", default=",".join(shapes), help="comma-separated names of SHAPES")
    parser.add_argument("--out", help="write the figures to this JSON file")
    args = parser.parse_args()
    device = torch.device("cuda")
    if not attention_kernel.is_available(torch.empty(1, args.head_dim, device=device)):
        raise SystemExit("needs CUDA and Triton")
    return args, device


def main() -> None:
    args, device = attention_bench_args(__doc__, SHAPES)
    bandwidth = measured_copy_bandwidth(device)
    results: dict = {"environment": environment(device), "copy_bandwidth_bytes_per_s": bandwidth,
                     "settings": {k: {"split_keys": s, **launch} for k, (s, launch) in SETTINGS.items()}}
    for name in args.shapes.split(","):
        results[name] = bench_shape(*SHAPES[name], args, bandwidth, device)
        shown = {k: (v.get("us"), v.get("fraction_of_copy_bandwidth")) if isinstance(v, dict) else v
                 for k, v in results[name].items()}
        print(name, json.dumps(shown, default=lambda v: round(v, 3)), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
