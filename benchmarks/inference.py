"""Output tokens/s of tandem's server against transformers `generate`, same model, same run.

    python benchmarks/inference.py --preset tiny --concurrency 32 --prompt-len 128 --output-len 128
    python benchmarks/inference.py --model DIR --device cuda --concurrency 64

The server runs in this process (its own thread, real HTTP on loopback); N requests of
`prompt-len` random token ids each ask for exactly `output-len` tokens (EOS ignored), all sent at
once. transformers gets the same N prompts as one batch (equal lengths: no padding, its best
case) and `min_new_tokens = max_new_tokens = output-len`. Both sample at temperature 1. Each
side runs once untimed first (warmup), then `--repeats` timed runs; the best one counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tandem.config.inference import InferenceConfig
from tandem.inference.engine.setup import resolve_device
from tandem.inference.server import BackgroundServer
from tandem.models.loading import resolve_dtype
from tandem.models.presets import PRESETS, init_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=list(PRESETS), default="tiny", help="build this preset in a temp folder")
    source.add_argument("--model", help="a model folder (instead of a preset)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (N)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def prompts_for(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(min(vocab, 256)) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]


async def send_all(url: str, prompts: list[list[int]], output_len: int) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=len(prompts))) as http:
        responses = await asyncio.gather(*(
            http.post("/v1/generate", json={"prompt_token_ids": p, "max_tokens": output_len, "ignore_eos": True})
            for p in prompts))
    for r in responses:
        r.raise_for_status()
    return sum(len(r.json()["choices"][0]["token_ids"]) for r in responses)


def bench_server(folder: Path, args: argparse.Namespace, prompts: list[list[int]]) -> float:
    max_len = args.prompt_len + args.output_len
    config = InferenceConfig.model_validate({
        "model": {"name": str(folder), "dtype": args.dtype},
        "engine": {"device": args.device, "max_num_seqs": args.concurrency, "max_model_len": max_len,
                   "max_num_batched_tokens": max(4096, max_len),
                   "num_blocks": args.concurrency * -(-max_len // 16) + 16},
    })
    server = BackgroundServer(config)
    try:
        asyncio.run(send_all(server.url, prompts[:2], 4))
        best = 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = asyncio.run(send_all(server.url, prompts, args.output_len))
            best = max(best, tokens / (time.perf_counter() - start))
        return best
    finally:
        server.stop()


def bench_transformers(folder: Path, args: argparse.Namespace, prompts: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    device = resolve_device(args.device)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=resolve_dtype(args.dtype, device)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> int:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    run(4)
    best = 0.0
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = run(args.output_len)
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else init_model(args.preset, Path(tmp) / args.preset, seed=args.seed)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompts = prompts_for(args, vocab)
        name = args.model or f"preset {args.preset}"
        print(f"{name}: {args.concurrency} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, "
              f"device {resolve_device(args.device)}, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
        server = bench_server(folder, args, prompts)
        print(f"tandem server        : {server:10.1f} output tok/s")
        hf = bench_transformers(folder, args, prompts)
        print(f"transformers generate: {hf:10.1f} output tok/s")
        print(f"ratio (tandem / transformers): {server / hf:.2f}x")


if __name__ == "__main__":
    main()
