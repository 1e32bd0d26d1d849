"""Cascade decode attention alone on the GPU (`tandem/kernels/cascade_attention.py`) against the plain split decode
(`tandem/kernels/attention.py`) on the same step: groups of sequences over a shared prompt, each with tokens of its
own after it. Where the cascade stops paying (short prefixes, small groups) is what `engine.cascade_min_saved_tokens`
should sit at.

    python benchmarks/cascade_attention.py --out $OUT/cascade-attention.json     # CUDA, under a minute

Figures per shape (groups x members, prefix tokens, own tokens; Qwen3-0.6B heads by default, bf16, blocks of 16
scattered at random): microseconds per call (one layer) of each path, the cascade's speedup, the tokens of keys
and values per layer it spares ((members - 1) x prefix x groups), and the largest difference between the two
outputs (they must agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from decode_attention import attention_bench_args, time_call
from provenance import environment
from tandem.inference.engine.cascade import find_shared_prefixes
from tandem.kernels.attention import paged_attention
from tandem.kernels.cascade_attention import cascade_decode, members_per_group

SHAPES = {"G_start": (16, 8, 4096, 1), "G_mid": (16, 8, 4096, 2048), "G_end": (16, 8, 4096, 4096),
          "D_start": (16, 4, 1024, 1), "D_mid": (16, 4, 1024, 4096), "B": (64, 8, 256, 512),
          "small_64": (16, 8, 64, 256), "small_256": (16, 8, 256, 256), "pairs_1k": (64, 2, 1024, 256)}
"""Name: (groups, members per group, shared prefix tokens, own tokens of each sequence): G and D at the start, the
middle and the end of their decode; B; short prefixes and pairs, around where the cascade stops paying."""


def grouped_case(groups: int, members: int, prefix: int, own: int, args: argparse.Namespace,
                 device: torch.device) -> tuple:
    """(q, k_cache, v_cache, block tables as lists and as a tensor, contexts) of one decode step."""
    bs = args.block_size
    prefix_blocks, own_blocks = prefix // bs, -(-own // bs)
    num_blocks = groups * prefix_blocks + groups * members * own_blocks
    k_cache = torch.randn(num_blocks, bs, args.kv_heads, args.head_dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for _ in range(groups):
        shared = [free.pop() for _ in range(prefix_blocks)]
        tables += [shared + [free.pop() for _ in range(own_blocks)] for _ in range(members)]
    contexts = [prefix_blocks * bs + own] * len(tables)
    q = torch.randn(len(tables), args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
    return q, k_cache, v_cache, tables, torch.tensor(tables, device=device), contexts


def bench_shape(groups: int, members: int, prefix: int, own: int, args: argparse.Namespace, device: torch.device) -> dict:
    q, k_cache, v_cache, tables, block_tables, contexts = grouped_case(groups, members, prefix, own, args, device)
    seq_lens = torch.tensor(contexts, device=device)
    query_start = torch.arange(len(tables) + 1, device=device)
    tiles = torch.tensor([list(range(len(tables))), [0] * len(tables)], device=device)
    width = members_per_group(args.heads, args.kv_heads)
    plan = find_shared_prefixes(tables, contexts, args.block_size, width)
    row_prefix, group_prefix, group_table = (torch.tensor(part, device=device)
                                             for part in plan.transfer_parts(len(tables), len(plan.groups), width))
    max_context = max(contexts)
    out = {}

    def plain():
        out["plain"] = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, tiles, 1, max_context)

    def cascade():
        out["cascade"] = cascade_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start, row_prefix,
                                        group_prefix, group_table.view(-1, width), max_context)

    plain_s, cascade_s = time_call(plain, args.repeats), time_call(cascade, args.repeats)
    return {"groups": groups, "members": members, "prefix": prefix, "own": own, "plain_us": plain_s * 1e6,
            "cascade_us": cascade_s * 1e6, "speedup": plain_s / cascade_s, "saved_tokens": plan.saved_tokens,
            "max_abs_diff": (out["plain"].float() - out["cascade"].float()).abs().max().item()}


def main() -> None:
    args, device = attention_bench_args(__doc__, SHAPES)
    results: dict = {"environment": environment(device)}
    for name in args.shapes.split(","):
        results[name] = bench_shape(*SHAPES[name], args, device)
        print(name, json.dumps(results[name], default=lambda v: round(v, 3)), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
