"""Decode step time of the latent-attention engine (GLM-5's MLA + DSA) at long contexts, against the bytes a step
must read, with DSA on and off (dense MLA), over a latent cache in bf16 and in FP8 (`engine.kv_cache_dtype`).

    python benchmarks/latent_decode.py --out benchmarks/results/latent-decode-DATE.json
    python benchmarks/latent_decode.py --num-layers 3 --contexts 4096 --batch 8     # dense blocks only, a quick look
    python benchmarks/latent_decode.py --kv-cache-dtypes auto fp8                    # the FP8 cache beside bf16

The `glm-5` preset cut to `--num-layers` blocks (default 4: its 3 dense blocks and 1 of experts), random weights
made on the GPU (`model.load_format = "dummy"`), one engine per mode and cache dtype with CUDA graphs. The cache is
not prefilled: each sequence's blocks are written with random latent entries and indexer keys (a prefill of 128k
tokens per
sequence would take most of the run, and attention reads the same bytes either way: what DSA chooses among random
keys is as good a choice as any for the time it takes). A step is one decode token per sequence, all at the same
context, replayed from the engine's graph for that batch and bound (`PagedModelRunner.graphs`): the forward and the
LM head, without sampling or the host's scheduling.

Modes: `dsa` (the preset's `index_topk`, 2,048) and `dense` (`index_topk` past every context: each decode attends
to its whole context and the indexer is never scored). The read bound of a step (`roofline.py`'s way, over the
bandwidth of a device-to-device copy measured in the same run) counts:
- the weights, the routed experts only those the step's tokens chose (read from the engine's routing recorder);
- per layer and sequence, the latent entries it attends to (min(context, index_topk) with DSA, else the context),
  kv_lora_rank + qk_rope_head_dim numbers each (FP8: kv_lora_rank bytes, a 4-byte scale and the RoPE part in bf16);
- with DSA past `index_topk`, every cached indexer key of each layer with an indexer (`index_head_dim` numbers; FP8:
  as many bytes and a 4-byte scale).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from provenance import environment
from roofline import measured_copy_bandwidth, nominal_bandwidth, weight_bytes
from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.fused_moe import moe_blocks
from tandem.inference.engine.kv_cache import LatentCache
from tandem.inference.engine.setup import build_engine
from tandem.models.presets import preset_config, write_model

MODES = ("dsa", "dense")
CACHE_DTYPES = ("auto", "fp8")
"""`engine.kv_cache_dtype`: `auto` holds the latent cache in the model's bf16."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="glm-5")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=EngineConfig.model_fields["block_size"].default)
    parser.add_argument("--repeats", type=int, default=20, help="replays timed per context")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=CACHE_DTYPES, default=["auto"])
    parser.add_argument("--out", help="write the figures to this JSON file")
    return parser.parse_args()


def serve(folder: Path, args: argparse.Namespace, max_model_len: int, kv_cache_dtype: str):
    """An engine of `args.batch` sequences up to `max_model_len` tokens, its cache exactly their blocks."""
    num_blocks = args.batch * -(-max_model_len // args.block_size)
    config = EngineConfig(device="cuda", max_num_seqs=args.batch, max_model_len=max_model_len, block_size=args.block_size,
                          num_blocks=num_blocks, max_num_batched_tokens=max(args.batch, 256), kv_cache_dtype=kv_cache_dtype)
    return build_engine(ModelConfig(name=str(folder), load_format="dummy", dtype="bfloat16"), config, seed=0)


def fill_cache(engine, args: argparse.Namespace, max_model_len: int) -> None:
    """Random entries and indexer keys in every block, written as the engine writes them (an FP8 cache quantizes);
    sequence i owns blocks i x W .. (i + 1) x W - 1."""
    cache = engine.runner.cache
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = torch.arange(cache.entries.shape[1] * cache.block_size, device="cuda")
    for layer in range(cache.entries.shape[0]):  # one layer at a time: randn's float32 temporaries stay small
        cache.write(layer, slots, torch.randn(len(slots), cache.entry_dim, generator=gen, device="cuda").to(cache.dtype))
    for layer in cache.indexed_layers:
        keys = torch.randn(len(slots), cache.index_keys.shape[-1], generator=gen, device="cuda").to(cache.dtype)
        cache.write_index_keys(layer, slots, keys)
    width = -(-max_model_len // args.block_size)
    tables = engine.runner.inputs.block_tables
    tables[:args.batch, :width] = torch.arange(args.batch * width, device="cuda").view(args.batch, width)


def step_at(engine, args: argparse.Namespace, context: int) -> torch.Tensor:
    """Fill the graphs' static inputs for a decode at `context` (its token at position context - 1) and replay
    once: the logits [batch, vocabulary]."""
    runner, b, S = engine.runner, args.batch, args.block_size
    static = runner._static  # the graph's inputs: token ids, positions, slots, contexts
    static[0, :b] = torch.arange(b, device="cuda") + 1
    static[1, :b] = context - 1
    static[2, :b] = runner.inputs.block_tables[:b, (context - 1) // S] * S + (context - 1) % S
    static[3, :b] = context
    return runner.graphs.replay(b, context)


def routed_expert_bytes_unread(engine, args: argparse.Namespace) -> int:
    """Bytes of the routed experts no token of the last step chose (a step reads only the chosen ones)."""
    runner = engine.runner
    if runner.recorder is None:
        return 0
    chosen = runner.recorder.rows(torch.arange(args.batch, device=runner.device))  # [b, moe layers, k]
    unread = 0
    for i, block in enumerate(moe_blocks(runner.model)):
        per_expert = sum(p.nbytes for p in block.experts.parameters()) // block.args.num_experts
        unread += (block.args.num_experts - chosen[:, i].unique().numel()) * per_expert
    return unread


def time_steps(engine, args: argparse.Namespace, context: int) -> float:
    """Seconds per replayed step: the mean of `args.repeats` between CUDA events, after a warmup."""
    step_at(engine, args, context)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.repeats):
        engine.runner.graphs.replay(args.batch, context)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / args.repeats


def step_bytes(engine, args: argparse.Namespace, context: int, index_topk: int) -> dict:
    """The bytes a step at `context` must read (the module docstring), by part."""
    model, cache = engine.runner.model, engine.runner.cache
    a = model.args
    sparse = context > index_topk
    layers, indexed = cache.entries.shape[0], cache.index_keys.shape[0]
    sizes = dict(num_layers=1, block_size=1, entry_dim=a.kv_lora_rank + a.qk_rope_head_dim, index_dim=a.index_head_dim,
                 dtype=cache.dtype, fp8=cache.fp8, rope_dim=a.qk_rope_head_dim if cache.fp8 else 0)
    entry = LatentCache.bytes_per_block(indexed_layers=[], **sizes)  # one token's entry of one layer, scale included
    key = LatentCache.bytes_per_block(indexed_layers=[0], **sizes) - entry  # its indexer key, scale included
    entries = layers * args.batch * min(context, index_topk) * entry
    keys = indexed * args.batch * context * key if sparse else 0
    weights = weight_bytes(model) - routed_expert_bytes_unread(engine, args)
    return {"weights": weights, "latent_entries": entries, "indexer_keys": keys, "total": weights + entries + keys}


def bench_mode(mode: str, kv_cache_dtype: str, args: argparse.Namespace, bandwidth: float, tmp: Path) -> dict:
    max_model_len = max(args.contexts) + args.block_size
    config = preset_config(args.preset, args.num_layers)
    if mode == "dense":
        config["index_topk"] = 2 * max_model_len  # past every context: the indexer is never scored
    index_topk = config["index_topk"]
    engine = serve(write_model(config, tmp / f"{mode}-{kv_cache_dtype}", weights=False), args, max_model_len,
                   kv_cache_dtype)
    assert engine.runner.graphs is not None, "the latent kernels did not serve this shape: no CUDA graphs"
    fill_cache(engine, args, max_model_len)
    figures: dict = {"index_topk": index_topk, "context_bounds": engine.runner.graphs.context_bounds}
    for context in args.contexts:
        seconds = time_steps(engine, args, context)
        read = step_bytes(engine, args, context, index_topk)
        bound = read["total"] / bandwidth
        figures[str(context)] = {"step_s": seconds, "bytes": read, "read_bound_s": bound,
                                 "fraction_of_bound": bound / seconds,
                                 "finite_logits": bool(torch.isfinite(step_at(engine, args, context)).all())}
        print(mode, kv_cache_dtype, context, json.dumps(figures[str(context)], default=lambda v: round(v, 6)), flush=True)
    del engine
    gc.collect()  # the engine's graphs, cache and weights, before the next mode's
    torch.cuda.empty_cache()
    return figures


def main() -> None:
    args = parse_args()
    device = torch.device("cuda")
    bandwidth = measured_copy_bandwidth(device)
    results: dict = {"environment": environment(device), "preset": args.preset, "num_layers": args.num_layers,
                     "batch": args.batch, "block_size": args.block_size, "copy_bandwidth_bytes_per_s": bandwidth,
                     "nominal_bandwidth_bytes_per_s": nominal_bandwidth(device)}
    with tempfile.TemporaryDirectory() as tmp:
        for kv_cache_dtype in args.kv_cache_dtypes:
            for mode in args.modes:  # results["dsa"], results["dsa_fp8"], ...
                key = mode if kv_cache_dtype == "auto" else f"{mode}_{kv_cache_dtype}"
                results[key] = bench_mode(mode, kv_cache_dtype, args, bandwidth, Path(tmp))
    for suffix in ("", "_fp8"):
        if all(mode + suffix in results for mode in MODES):
            results["dsa_speedup_over_dense" + suffix] = {
                str(c): results["dense" + suffix][str(c)]["step_s"] / results["dsa" + suffix][str(c)]["step_s"]
                for c in args.contexts}
            print("dsa speedup over dense" + suffix, json.dumps(results["dsa_speedup_over_dense" + suffix],
                                                                 default=lambda v: round(v, 3)))
    for mode in MODES:
        if mode in results and f"{mode}_fp8" in results:
            results[f"{mode}_fp8_speedup"] = {str(c): results[mode][str(c)]["step_s"] / results[f"{mode}_fp8"][str(c)]["step_s"]
                                             for c in args.contexts}
            print(f"{mode}: FP8 cache speedup over bf16", json.dumps(results[f"{mode}_fp8_speedup"],
                                                                      default=lambda v: round(v, 3)))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
