"""The incremental detokenizer's host cost: what a streaming server's engine thread pays per sequence and token.

    python benchmarks/detokenizer.py --out benchmarks/results/detokenizer-cpu-<date>.json

`--num-sequences` completions of `--length` random token ids, pushed one token at a time as the engine does for
incremental requests (`IncrementalDetokenizer.push`), with the byte tokenizer of the presets. Per vocabulary size of
`--vocab-sizes`: the byte tokenizer's own (260: every id has text) and a real model shape's (qwen3-0.6b's 151,936:
the presets pair it with the byte tokenizer, so almost no id has text, the window grows over the whole completion,
as it does on a GPU benchmark of that preset). Figures: microseconds of this thread's CPU per push (best of
`--repeats`), and per engine step of `--num-sequences`.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from disaggregated import save
from provenance import environment

from tandem.inference.engine.detokenizer import IncrementalDetokenizer
from tandem.models.byte_tokenizer import build_byte_tokenizer


def seconds_per_push(tokenizer, completions: list[list[int]], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        detokenizers = [IncrementalDetokenizer(tokenizer, skip_special_tokens=True) for _ in completions]
        start = time.thread_time()
        for n in range(1, len(completions[0]) + 1):
            for detokenizer, ids in zip(detokenizers, completions):
                detokenizer.push(ids[:n])
        best = min(best, time.thread_time() - start)
    return best / (len(completions) * len(completions[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-sequences", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab-sizes", default="260,151936")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tokenizer = build_byte_tokenizer()
    results: dict = {"workload": {k: v for k, v in vars(args).items() if k != "out"},
                     "environment": environment(torch.device("cpu"))}
    for vocab in map(int, args.vocab_sizes.split(",")):
        rng = random.Random(0)
        completions = [[rng.randrange(vocab) for _ in range(args.length)] for _ in range(args.num_sequences)]
        per_push = seconds_per_push(tokenizer, completions, args.repeats)
        results[f"vocab_{vocab}"] = {"us_per_push": 1e6 * per_push, "ms_per_step": 1e3 * per_push * args.num_sequences}
    save(results, args.out)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
