"""tandem's inference engine against transformers on the same model, in the same run.

    python benchmarks/inference.py --preset tiny --device cpu --scale 0.125       # a quick look on CPU
    python benchmarks/inference.py --preset qwen3-0.6b --device cuda --out benchmarks/results/engine-h200-DATE.json
    python benchmarks/inference.py --preset qwen3-30b-a3b --device cuda --parts engine,vllm --out ...  # random weights
    python benchmarks/inference.py --preset tiny-moe --device cpu --scale 0.0625 --load-format dummy --parts engine
    python benchmarks/inference.py --preset qwen3-0.6b --device cuda --parts engine,vllm --workloads C,D,E --out ...
    python benchmarks/inference.py --preset qwen3-30b-a3b --device cuda --parts engine --moe-tile-table T.json  # tuned MoE tiles
    python benchmarks/inference.py --preset qwen3-0.6b --device cuda --parts engine,vllm --workloads C,D --kv-cache-dtypes auto,fp8 --out ...
    python benchmarks/inference.py --preset qwen3-30b-a3b --num-layers 12 --device cuda --parts engine --workloads A --quantizations none,fp8 --fp8-experts

Weights (`--load-format`, as `model.load_format`): `safetensors` writes the preset's folder with its random
weights; `dummy` (the default for presets too large for the GPU host's disk, such as qwen3-30b-a3b: 61 GB)
writes only its config and tokenizer, and engine and server build random weights directly on the device,
as vLLM does with `load_format="dummy"` from the same folder. The transformers parts (generate,
generate_batch) need `safetensors`, and are recorded as errors otherwise.

Workloads (the GPU speed issue's), all sampling at temperature 1 with EOS ignored, so every
sequence gets exactly its output length; random prompt token ids; `--scale` shrinks the counts:
- A (throughput): 256 concurrent requests of 128 prompt tokens, 512 output tokens each;
- B (RL-like): 64 prompts x n = 8 samples, 256 prompt tokens, 1024 output tokens;
- C (reasoning length): 128 requests of 256 prompt tokens, 4,096 output tokens;
- D (long reasoning, groups): 16 prompts x n = 4 samples, 1,024 prompt tokens, 8,192 output tokens;
- E (32k decode): 4 requests of 32,768 prompt tokens, 128 output tokens, on an engine of their own
  (its `max_model_len`): the decode step time of a few sequences at 32k context;
- F (128k decode): E at 131,072 tokens of context (prompt and output); a model whose context is shorter
  is extended to it by YaRN, as Qwen3 reaches 128k (`--max-position-embeddings`, presets only);
- G (long shared prompts, groups): 16 prompts x n = 8 samples, 4,096 prompt tokens, 4,096 output tokens: the
  workload where cascade attention (`engine.cascade_attention`) reads each group's prompt once per step.
`--workloads` picks which run (GPU time is scarce); A, B, C, D, G share one engine sized for the
longest and widest of them.

Figures:
- engine (in process, `LLMEngine.step()` in a loop, as the server's engine thread runs it):
  output tokens/s, median time to first token, median decode-only step time at the full batch, the
  longest step that held a decoding sequence (its worst time between tokens: prefill chunks stall it),
  KV-cache capacity, and for B and D the prompt tokens computed against those asked for (prefill
  shared across n); where the engine overlaps steps (CUDA), A again with each step read before
  the next is launched (`engine_A_read_each_step`), the baseline of that overlap;
- roofline (each engine workload's `decode_roofline`, `benchmarks/roofline.py`): the time to read
  the weights once and the KV cache in use at the GPU's nominal bandwidth and at the bandwidth of a
  large device copy measured in the same run (`memory_bandwidth`), and the decode steps' fraction
  of it (1.0: memory speed);
- server (A): the same requests through HTTP `/v1/generate`, all sent at once, to `tandem
  inference` started in its own process (as `tandem rl` runs it), best of `--repeats`;
- transformers (A): one `generate` batch of the 256 prompts (equal lengths: no padding, its best
  case) and continuous batching (`generate_batch`), and tandem's ratios over both;
- vLLM (part `vllm`, CUDA, not in the default parts): A with and without the sampled token's
  logprob, B, C, D with it (those of `--workloads`), through `benchmarks/vllm_workloads.py` in a
  child process on the same model and prompts (`--vllm-site DIR` puts an offline vLLM install on
  its path), and the ratios of tandem's engine over vLLM with logprobs;
- mismatch (B): the engine's logprob of each sampled token against a teacher-forced forward of
  the whole sequence by tandem's model code (what the trainer computes: for a mixture of experts,
  the model's own MoE path, not the engine's kernels), same dtype and temperature: the mean k3
  estimate of KL(engine || trainer), exp(r) - 1 - r with r = trainer - engine. With `--exact`, the
  forward, head and log_softmax are the exact trainer's (`tandem.models.exact`): every difference must be 0. For a mixture of
  experts also `mismatch_B_router_replay`: a run of B's first 16 prompts asking for the routed
  experts, its mismatch without and with the trainer replaying them (`loss.router_replay`);
- cascade off (`--cascade-off-too`): each shared workload but A again on the same engine with its cascade
  planner removed (plain decode attention; fresh prompts of the same shape, so no prefix is cached from the first
  run), as `engine_<W>_cascade_off`, and `ratio_engine_<W>_over_engine_<W>_cascade_off`.

KV-cache dtypes (`--kv-cache-dtypes`, `engine.kv_cache_dtype`, default `auto`): the engine parts and vLLM's
run once per dtype listed, each on an engine (and a vLLM) of its own, in the same call. `auto`'s figures keep
the names above; `fp8`'s carry the suffix `_kv_fp8` (`engine_C_kv_fp8`, `kv_cache_kv_fp8`, `mismatch_B_kv_fp8`,
`vllm_kv_fp8`: vLLM with its own `kv_cache_dtype="fp8"`), with the ratios `ratio_engine_C_kv_fp8_over_engine_C`,
`ratio_engine_C_kv_fp8_over_vllm_with_logprobs` (over vLLM in bf16) and
`ratio_engine_C_kv_fp8_over_vllm_kv_fp8_with_logprobs`.

Weight quantizations (`--quantizations`, `engine.quantization`, default `none`): likewise the engine parts run once
per value listed (and per KV-cache dtype), each on an engine of its own; `fp8`'s figures carry the suffix `_w_fp8`
before any KV one (`engine_A_w_fp8`, `engine_A_w_fp8_kv_fp8`), with the ratio `ratio_engine_A_w_fp8_over_engine_A`.
vLLM runs once per variant too: `fp8` as the same scheme, a checkpoint config of 128 x 128 blocks
(`quantization_config`: `quant_method = "fp8"`, `weight_block_size = [128, 128]`, dynamic activations; vLLM's dummy
FP8 weights) as `vllm_w_fp8`, with the ratio `ratio_engine_A_w_fp8_over_vllm_w_fp8_with_logprobs`. Its dense
products take CUTLASS's block-scaled kernel (`VLLM_USE_DEEP_GEMM=0`: DeepGEMM compiles some thousand kernels at
start-up, longer than a GPU call lasts), its experts vLLM's Triton FP8 kernel.

Profile (`--profile`, with workload A): after A's timed runs, on the same engine, two prefill steps and ten
decode steps of a fresh A run under `torch.profiler` (`engine_profile.py`): GPU milliseconds per step by kernel
group (dense products in FP8 and in bf16, the activations' quantization, experts, attention, pointwise, other), the
kernels that take most, and the GPU's idle time per step with the host code each idle gap waited for, as
`profile_A` (with each variant's suffix), and a table of the groups side by side for every variant run
(`--quantizations none,fp8`: bf16 against FP8).

Each part that fails is recorded in the result file with its error and the run goes on (GPU
time is scarce; one broken baseline should not cost the others).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import httpx
import torch

from engine_profile import print_comparison, profiled_steps
from provenance import environment
from roofline import decode_roofline, measured_copy_bandwidth, nominal_bandwidth, weight_bytes
from tandem.config.base import ModelConfig
from tandem.config.dump import to_toml
from tandem.config.inference import EngineConfig, InferenceConfig
from tandem.inference.engine.fused_moe import eager_moe, moe_blocks
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine, resolve_device
from tandem.launch.process import ManagedProcess
from tandem.config.resolve import free_port
from tandem.launch.rl import wait_healthy
from tandem.models.exact import ExactDocumentAttention, exact_log_softmax, exact_logits
from tandem.models.loading import resolve_dtype
from tandem.models.moe import replayed_routing
from tandem.models.presets import PRESETS, init_model

DUMMY_PRESETS = {"qwen3-30b-a3b"}
"""Presets whose weights are built on the device by default: their folder would not fit the GPU host's disk."""

WORKLOADS = {"A": dict(num_prompts=256, n=1, prompt_len=128, output_len=512),
             "B": dict(num_prompts=64, n=8, prompt_len=256, output_len=1024),
             "C": dict(num_prompts=128, n=1, prompt_len=256, output_len=4096),
             "D": dict(num_prompts=16, n=4, prompt_len=1024, output_len=8192),
             "E": dict(num_prompts=4, n=1, prompt_len=32768, output_len=128),
             "F": dict(num_prompts=4, n=1, prompt_len=131072 - 128, output_len=128),
             "G": dict(num_prompts=16, n=8, prompt_len=4096, output_len=4096)}
SHARED_ENGINE = ("A", "B", "C", "D", "G")
"""Workloads run on one engine (and one vLLM) sized for them all; E and F build their own (32k, 128k)."""
KV_CACHE_DTYPES = ("auto", "fp8")
"""`engine.kv_cache_dtype`s the engine parts can run with (`--kv-cache-dtypes`)."""
QUANTIZATIONS = ("none", "fp8")
"""`engine.quantization`s the engine parts can run with (`--quantizations`)."""


def kv_suffix(kv_cache_dtype: str) -> str:
    """The suffix of the figures of a KV-cache dtype: none for the default, `_kv_fp8` for FP8."""
    return "" if kv_cache_dtype == "auto" else f"_kv_{kv_cache_dtype}"


def variant_suffix(quantization: str, kv_cache_dtype: str) -> str:
    """The suffix of the engine figures of one weight quantization and KV-cache dtype: `_w_fp8`, then `kv_suffix`."""
    return ("" if quantization == "none" else f"_w_{quantization}") + kv_suffix(kv_cache_dtype)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=list(PRESETS), default="tiny", help="build this preset in a temp folder")
    source.add_argument("--model", help="a model folder (instead of a preset)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--load-format", choices=["safetensors", "dummy"],
                        help="dummy: random weights built on the device, no weights folder (default for " + ", ".join(DUMMY_PRESETS) + ")")
    parser.add_argument("--num-layers", type=int, help="cut the preset to this many layers")
    parser.add_argument("--max-position-embeddings", type=int,
                        help="extend the preset's context to this many positions by YaRN (default: F's 131,072 when F runs)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts and lengths (quick runs)")
    parser.add_argument("--output-scale", type=float, default=1.0,
                        help="multiply output lengths only (quick runs that keep a workload's batch and prompts)")
    parser.add_argument("--repeats", type=int, default=2, help="timed engine runs of workload A; the best counts")
    parser.add_argument("--parts", default="engine,server,generate,generate_batch,mismatch",
                        help="comma-separated parts to run")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated workloads of the engine and vLLM parts (server and transformers run A)")
    add_engine_arguments(parser)
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma-separated `engine.kv_cache_dtype`s (auto, fp8): the engine parts and vLLM's run once "
                        "per dtype; fp8's figures carry the suffix _kv_fp8")
    parser.add_argument("--cascade-off-too", action="store_true",
                        help="run each shared workload but A again with cascade attention off, on the same engine")
    parser.add_argument("--quantizations", default="none",
                        help="comma-separated `engine.quantization`s (none, fp8): the engine parts run once per value "
                        "(and KV-cache dtype); fp8's figures carry the suffix _w_fp8")
    parser.add_argument("--exact", action="store_true", help="`run.exact`: the engine's batch-invariant path "
                        "(tandem.models.exact); the mismatch part then recomputes as the exact trainer does (expect 0)")
    parser.add_argument("--profile", action="store_true",
                        help="with workload A: profile prefill and decode steps by kernel group (profile_A)")
    parser.add_argument("--vllm-site", help="folder put first on PYTHONPATH of the vLLM part (an offline install)")
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD, which a copied tree may hold stale)")
    return parser.parse_args()


def scaled(args: argparse.Namespace, name: str) -> dict:
    w = dict(WORKLOADS[name])
    for key in ("num_prompts", "prompt_len", "output_len"):
        w[key] = max(1, int(w[key] * args.scale))
    w["output_len"] = max(1, int(w["output_len"] * args.output_scale))
    return w


def prompts_for(w: dict, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(vocab, 256)) for _ in range(w["prompt_len"])] for _ in range(w["num_prompts"])]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine settings every engine benchmark takes (defaults: `EngineConfig`'s), read by `engine_config`."""
    defaults = EngineConfig()
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="tokens of one engine step (prefill chunking); default max(4096, longest sequence)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=defaults.cuda_graphs)
    parser.add_argument("--compile-norms", action=argparse.BooleanOptionalAction, default=defaults.compile_norms)
    parser.add_argument("--moe-tile-table", default=defaults.moe_tile_table,
                        help="`engine.moe_tile_table`: MoE tiles tuned by benchmarks/moe_tune.py "
                        "(default: the table shipped for the GPU, else the rule)")
    parser.add_argument("--fused-blocks", action=argparse.BooleanOptionalAction, default=defaults.fused_blocks,
                        help="`engine.fused_blocks`: the blocks' norms, RoPE and cache write as Triton kernels")
    parser.add_argument("--cascade-attention", choices=["auto", "on", "off"], default=defaults.cascade_attention,
                        help="`engine.cascade_attention`: groups read their shared prompt once per decode step")
    parser.add_argument("--cascade-min-saved-tokens", type=int, default=defaults.cascade_min_saved_tokens,
                        help="`engine.cascade_min_saved_tokens`")
    parser.add_argument("--fp8-experts", action=argparse.BooleanOptionalAction, default=defaults.fp8_experts,
                        help="`engine.fp8_experts`: with an FP8 quantization, the routed experts in FP8 too")
    parser.add_argument("--fp8-tile-table", default=defaults.fp8_tile_table,
                        help="`engine.fp8_tile_table`: the dense FP8 products' choices, written by benchmarks/fp8_matmul.py "
                        "--table-out (default: the table shipped for the GPU, else the rule)")


def engine_config(args: argparse.Namespace, max_num_seqs: int, max_model_len: int,
                  kv_cache_dtype: str = "auto", quantization: str = "none") -> EngineConfig:
    return EngineConfig(device=args.device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens or max(4096, max_model_len), cuda_graphs=args.cuda_graphs,
                        compile_norms=args.compile_norms, moe_tile_table=args.moe_tile_table, fused_blocks=args.fused_blocks,
                        kv_cache_dtype=kv_cache_dtype, cascade_attention=args.cascade_attention,
                        cascade_min_saved_tokens=args.cascade_min_saved_tokens, quantization=quantization,
                        fp8_experts=args.fp8_experts, fp8_tile_table=args.fp8_tile_table)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(tokens: int, seconds: float) -> dict:
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def run_engine(engine, prompts: list[list[int]], n: int, output_len: int, return_routed_experts: bool = False) -> dict:
    """Drive the engine to completion; throughput, TTFT, decode step times, the longest step of a sequence
    already decoding (the worst time between two of its tokens: a prefill chunk in its step), prompt tokens
    computed, and `decode_steps` (sequences, contexts summed, seconds) of each decode-only step, for the roofline."""
    batches: list = []
    contexts: list[int] = []
    schedule = engine.scheduler.schedule
    counts = {"prompt_tokens_computed": 0}
    has_decodes: list[bool] = []

    def recording_schedule(**options):
        batch = schedule(**options)
        batches.append(batch)
        contexts.append(sum(s.num_computed_tokens + k for s, k in zip(batch.seqs, batch.num_new_tokens)))
        has_decodes.append(any(s.num_computed_tokens >= s.num_prompt_tokens for s in batch.seqs))
        counts["prompt_tokens_computed"] += sum(k for s, k in zip(batch.seqs, batch.num_new_tokens)
                                                if s.num_computed_tokens < s.num_prompt_tokens)
        return batch

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(max_tokens=output_len, temperature=1.0, ignore_eos=True, return_routed_experts=return_routed_experts)
    sync(engine.device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, n, incremental=False)
    pending = [s for seqs in engine.requests.values() for s in seqs]
    first_token: list[float] = []
    decode_steps: list[tuple[int, int, float]] = []
    step_times: list[tuple[int, int, float]] = []
    outputs = []
    while engine.has_unfinished:
        t0 = time.perf_counter()
        outputs.extend(engine.step())
        t1 = time.perf_counter()
        batch = batches[-1]
        step_times.append((len(batch.seqs), batch.num_tokens, t1 - t0))
        if batch.seqs and batch.is_decode_only:
            decode_steps.append((len(batch.seqs), contexts[-1], t1 - t0))
        if pending:
            still = []
            for s in pending:
                (first_token.append(t1 - start) if s.num_completion_tokens > 0 else still.append(s))
            pending = still
    elapsed = time.perf_counter() - start
    engine.scheduler.schedule = schedule
    tokens = sum(len(o.token_ids) for o in outputs)
    full = max((b for b, _, _ in decode_steps), default=0)
    return {
        **throughput(tokens, elapsed),
        "ttft_median_s": statistics.median(first_token), "steps": len(batches),
        "decode_step_median_s_at_full_batch": statistics.median([t for b, _, t in decode_steps if b == full]) if full else None,
        "full_decode_batch": full,
        "decode_step_median_s_all": statistics.median([t for _, _, t in decode_steps]) if decode_steps else None,
        "time_between_tokens_max_s": max((t for (_, _, t), d in zip(step_times, has_decodes) if d), default=None),
        "prompt_tokens_requested": sum(len(p) for p in prompts) * n,
        "prompt_tokens_computed": counts["prompt_tokens_computed"],
        "first_steps": [{"seqs": b, "tokens": n, "s": t} for b, n, t in step_times[:16]],
        "step_seconds": [t for _, _, t in step_times],
        "decode_steps": decode_steps,
        "outputs": outputs,
    }


def mismatch_kl(model: torch.nn.Module, prompts: list[list[int]], outputs: list, temperature: float,
                router_replay: bool = False, exact: bool = False) -> dict:
    """k3 of KL(engine || teacher-forced forward) over every sampled token, one sequence at a time;
    `router_replay`: the forward routes each sampling position through the experts the engine reported;
    `exact`: the forward is the trainer's in exact mode (its attention backend and head), so every
    difference must be 0."""
    by_request = {f"r{i}": p for i, p in enumerate(prompts)}
    r_all = []
    with torch.no_grad(), eager_moe(model):
        for out in outputs:
            prompt = by_request[out.request_id]
            ids = torch.tensor([prompt + out.token_ids], device=model.lm_head.weight.device)
            replay = contextlib.nullcontext()
            if router_replay:
                routed = torch.tensor(out.routed_experts, device=ids.device)
                given = torch.full((ids.shape[1], *routed.shape[1:]), -1, device=ids.device)
                given[len(prompt) - 1:-1] = routed
                replay = replayed_routing(model, given)
            attention = ExactDocumentAttention([[ids.shape[1]]]) if exact else None
            with replay:
                hidden = model(ids, torch.arange(ids.shape[1], device=ids.device)[None], attention=attention)
            rows = hidden[0, len(prompt) - 1:-1]
            if exact:
                logprobs = exact_log_softmax(exact_logits(rows, model.lm_head.weight, model.lm_head.bias),
                                             torch.full((rows.shape[0],), temperature, device=ids.device))
            else:
                logprobs = (model.lm_head(rows).float() / temperature).log_softmax(-1)
            teacher = logprobs.gather(-1, ids[0, len(prompt):, None])[:, 0]
            r_all.append(teacher - torch.tensor(out.logprobs, device=ids.device))
    r = torch.cat(r_all).double()
    return {"tokens": r.numel(), "mean_k3": (r.exp() - 1 - r).mean().item(), "mean_abs_logprob_diff": r.abs().mean().item(),
            "max_abs_logprob_diff": r.abs().max().item()}


def replay_mismatch(engine, prompts: list[list[int]], w: dict) -> dict:
    """Mismatch KL of one run asking for the routed experts, without and with the trainer replaying them."""
    outputs = run_engine(engine, prompts, w["n"], w["output_len"], return_routed_experts=True)["outputs"]
    model = engine.runner.model
    return {"without_replay": mismatch_kl(model, prompts, outputs, 1.0),
            "with_replay": mismatch_kl(model, prompts, outputs, 1.0, router_replay=True)}


async def send_all(url: str, prompts: list[list[int]], output_len: int) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=len(prompts))) as http:
        responses = await asyncio.gather(*(
            http.post("/v1/generate", json={"prompt_token_ids": p, "max_tokens": output_len, "ignore_eos": True})
            for p in prompts))
    for r in responses:
        r.raise_for_status()
    return sum(len(r.json()["choices"][0]["token_ids"]) for r in responses)


def bench_server(folder: Path, args: argparse.Namespace, w: dict, vocab: int, tmp: Path) -> dict:
    """Workload A over HTTP to `tandem inference` in a process of its own, as `tandem rl` runs it (the
    client in this process would otherwise share the server's interpreter lock); best of `--repeats`."""
    max_len = w["prompt_len"] + w["output_len"]
    port = free_port()
    config = InferenceConfig.model_validate({"model": {"name": str(folder), "dtype": args.dtype, "load_format": args.load_format},
                                             "server": {"port": port}, "run": {"exact": args.exact},
                                             "engine": engine_config(args, w["num_prompts"], max_len).model_dump()})
    (tmp / "inference.toml").write_text(to_toml(config))
    server = ManagedProcess("inference", [sys.executable, "-m", "tandem.cli", "inference", "@", str(tmp / "inference.toml")],
                            tmp / "inference.log", dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, timeout_s=900)
        asyncio.run(send_all(url, prompts_for(dict(w, num_prompts=8), vocab, args.seed + 300), 8))  # warmup
        runs = []
        for r in range(args.repeats):  # fresh prompts each time: the same ones would hit the prefix cache
            prompts = prompts_for(w, vocab, args.seed + 400 + r)
            start = time.perf_counter()
            tokens = asyncio.run(send_all(url, prompts, w["output_len"]))
            runs.append(throughput(tokens, time.perf_counter() - start))
        return max(runs, key=lambda r: r["output_tokens_per_s"])
    finally:
        server.stop()


def with_site(site: str | None) -> dict:
    """This process's environment with `site` (an offline vLLM install) first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p))


VLLM_FP8_BLOCKS = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The `quantization_config` of a released block-scaled FP8 checkpoint, as vLLM reads it: the engine's FP8 scheme."""


def vllm_folder(folder: Path, quantization: str, tmp: Path) -> Path:
    """The model folder vLLM loads for a weight quantization: `folder` itself, or for `fp8` a copy of its config whose
    `quantization_config` makes vLLM build (dummy) FP8 weights of 128 x 128 blocks."""
    if quantization == "none":
        return folder
    quantized = tmp / f"vllm_{quantization}"
    quantized.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(dict(config, quantization_config=VLLM_FP8_BLOCKS)))
    return quantized


def bench_vllm(folder: Path, args: argparse.Namespace, workloads: dict, prompts: dict, tmp: Path,
               kv_cache_dtype: str = "auto", quantization: str = "none") -> dict:
    spec, out = tmp / "vllm_spec.json", tmp / "vllm_result.json"
    folder = vllm_folder(folder, quantization, tmp)
    spec.write_text(json.dumps({"workloads": workloads, "prompts": prompts}))
    env = dict(with_site(args.vllm_site), VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_USE_DEEP_GEMM="0")
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_workloads.py")), "--model", str(folder),
                            "--spec", str(spec), "--out", str(out), "--kv-cache-dtype", kv_cache_dtype], env=env)
    if child.returncode != 0:
        raise RuntimeError(f"vllm_workloads.py exited with {child.returncode}")
    return json.loads(out.read_text())


def load_transformers(folder: Path, args: argparse.Namespace, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=resolve_dtype(args.dtype, device),
                                                attn_implementation="sdpa").to(device).eval()


def bench_generate(model, device: torch.device, w: dict, prompts: list[list[int]]) -> dict:
    ids = torch.tensor(prompts, device=device)

    def run(new_tokens: int) -> int:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        sync(device)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    run(4)
    start = time.perf_counter()
    tokens = run(w["output_len"])
    return throughput(tokens, time.perf_counter() - start)


def bench_generate_batch(model, device: torch.device, w: dict, prompts: list[list[int]]) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=w["output_len"], do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(**{**config.to_dict(), "max_new_tokens": 4}))
        sync(device)
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=config)
        sync(device)
    elapsed = time.perf_counter() - start
    return throughput(sum(len(r.generated_tokens) for r in results.values()), elapsed)


BULKY = ("outputs", "step_seconds", "decode_steps")
"""Per-token and per-step lists a result keeps only until its figures are computed."""


def attempt(results: dict, name: str, fn) -> None:
    print(f"--- {name}", flush=True)
    try:
        results[name] = fn()
    except Exception as err:  # record and go on: see the module docstring
        traceback.print_exc()
        results[name] = {"error": f"{type(err).__name__}: {err}"}
    shown = ({k: v for k, v in results[name].items() if k not in BULKY}
             if isinstance(results[name], dict) else results[name])
    print(json.dumps(shown, default=str), flush=True)


def roofline_of(engine, results: dict, keys: list[str], bandwidths: dict) -> None:
    """Add each engine result's `decode_roofline` (see `benchmarks/roofline.py`) and drop its bulky lists."""
    weights, kv_per_token = weight_bytes(engine.runner.model), engine.runner.cache.bytes_per_token
    for key in keys:
        result = results.get(key, {})
        if "decode_steps" in result:
            result["decode_roofline"] = decode_roofline(result["decode_steps"], weights, kv_per_token, bandwidths)
        for bulky in BULKY:
            result.pop(bulky, None)


def bench_engine(folder: Path, args: argparse.Namespace, results: dict, workloads: dict, prompts: dict, vocab: int,
                 parts: set, bandwidths: dict, kv_cache_dtype: str = "auto", quantization: str = "none") -> None:
    """The engine on the shared workloads asked for (A with repeats and its read-each-step baseline; the
    mismatch on B), one engine sized for them all. Its memory is the caller's to free once this returns (the
    closures here hold the engine until then)."""
    max_seqs = max(w["num_prompts"] * w["n"] for w in workloads.values())
    max_len = max(w["prompt_len"] + w["output_len"] for w in workloads.values())
    t0 = time.perf_counter()
    model_config = ModelConfig(name=str(folder), dtype=args.dtype, load_format=args.load_format)
    engine = build_engine(model_config, engine_config(args, max_seqs, max_len, kv_cache_dtype, quantization), args.seed,
                          exact=args.exact)
    results["engine_build_s"] = time.perf_counter() - t0
    results["kv_cache"] = {"blocks": engine.block_manager.num_blocks, "block_size": engine.block_manager.block_size,
                           "tokens": engine.block_manager.num_blocks * engine.block_manager.block_size}
    print(f"engine built in {results['engine_build_s']:.1f} s; KV cache {results['kv_cache']}", flush=True)
    # Warmup (prefill kernels compile) on prompts no workload shares a block with: a workload's own would be
    # cached for its timed run, and not for the cascade-off run beside it.
    length = max(1, min(64, max_len // 2))
    run_engine(engine, [[token] * length for token in (1, 2, 3, 4)], 2, max(1, min(8, max_len - length)))
    if "A" in workloads:
        a = workloads["A"]

        # Fresh prompts for every repeat: the same ones would hit the prefix cache of the last.
        def best_of_repeats(offset: int) -> dict:
            return max((run_engine(engine, prompts_for(a, vocab, args.seed + offset + r), a["n"], a["output_len"])
                        for r in range(args.repeats)), key=lambda r: r["output_tokens_per_s"])

        attempt(results, "engine_A", lambda: best_of_repeats(100))
        if engine.overlap:
            engine.overlap = False
            attempt(results, "engine_A_read_each_step", lambda: best_of_repeats(200))
            engine.overlap = True
        if args.profile:
            label = variant_suffix(quantization, kv_cache_dtype).strip("_") or "default"
            attempt(results, "profile_A", lambda: profiled_steps(engine, prompts_for(a, vocab, args.seed + 500),
                                                                 a["output_len"], num_decode=10, label=label))
    for key in [k for k in workloads if k != "A"]:
        w = workloads[key]
        attempt(results, f"engine_{key}", lambda: run_engine(engine, prompts[key], w["n"], w["output_len"]))
        if args.cascade_off_too:
            attempt(results, f"engine_{key}_cascade_off", lambda: without_cascade(engine, prompts_for(
                w, vocab, args.seed + 300 + list(WORKLOADS).index(key)), w))
    b_outputs = results.get("engine_B", {}).get("outputs")
    if "mismatch" in parts and b_outputs:
        attempt(results, "mismatch_B", lambda: mismatch_kl(engine.runner.model, prompts["B"], b_outputs, 1.0, exact=args.exact))
    if "mismatch" in parts and "B" in workloads and moe_blocks(engine.runner.model):
        attempt(results, "mismatch_B_router_replay", lambda: replay_mismatch(engine, prompts["B"][:16], workloads["B"]))
    roofline_of(engine, results, ["engine_A", "engine_A_read_each_step", *(f"engine_{k}" for k in workloads),
                                  *(f"engine_{k}_cascade_off" for k in workloads)], bandwidths)


def without_cascade(engine, prompts: list[list[int]], w: dict) -> dict:
    """A run of workload `w` with the engine's cascade planner removed: every decode step attends plainly."""
    planner, engine.runner.cascade = engine.runner.cascade, None
    try:
        return run_engine(engine, prompts, w["n"], w["output_len"])
    finally:
        engine.runner.cascade = planner


def bench_long_decode(folder: Path, args: argparse.Namespace, name: str, w: dict, prompts: list[list[int]],
                      bandwidths: dict, kv_cache_dtype: str = "auto", quantization: str = "none") -> dict:
    """Workload `name` (E or F) on an engine of its own, sized for it: the decode step at its long context and
    its roofline."""
    model_config = ModelConfig(name=str(folder), dtype=args.dtype, load_format=args.load_format)
    engine = build_engine(model_config, engine_config(args, w["num_prompts"] * w["n"], w["prompt_len"] + w["output_len"],
                                                      kv_cache_dtype, quantization), args.seed, exact=args.exact)
    run_engine(engine, [[1] * 64, [2] * 64], 1, 4)  # warmup (prompts no later one shares a block with)
    result = {f"engine_{name}": run_engine(engine, prompts, w["n"], w["output_len"])}
    roofline_of(engine, result, [f"engine_{name}"], bandwidths)
    del engine
    free_device_memory(args)
    return result[f"engine_{name}"]


def free_device_memory(args: argparse.Namespace) -> None:
    """Return a dropped engine's GPU memory (KV cache, graph pool) for the next part."""
    gc.collect()
    if resolve_device(args.device).type == "cuda":
        torch.cuda.empty_cache()


def add_ratios(results: dict, workloads: list[str], suffixes: list[str]) -> None:
    """`suffixes`: those of the variants run (`variant_suffix`), the engine's and vLLM's alike."""
    engine_a = results.get("engine_A", {}).get("output_tokens_per_s")
    read_each_step = results.get("engine_A_read_each_step", {}).get("output_tokens_per_s")
    if engine_a and read_each_step:
        results["ratio_engine_A_overlap_over_read_each_step"] = engine_a / read_each_step
    for base in ("transformers_generate_A", "transformers_generate_batch_A"):
        rate = results.get(base, {}).get("output_tokens_per_s")
        if engine_a and rate:
            results[f"ratio_engine_A_over_{base.removeprefix('transformers_')}"] = engine_a / rate
            server = results.get("server_A", {}).get("output_tokens_per_s")
            if server:
                results[f"ratio_server_A_over_{base.removeprefix('transformers_')}"] = server / rate
    for key in workloads:
        on, off = (results.get(f"engine_{key}{part}", {}).get("output_tokens_per_s") for part in ("", "_cascade_off"))
        if on and off:
            results[f"ratio_engine_{key}_over_engine_{key}_cascade_off"] = on / off
        anchor = results.get("vllm", {}).get(f"vllm_{key}_logprobs", {}).get("output_tokens_per_s")
        for suffix in suffixes:
            engine = results.get(f"engine_{key}{suffix}", {}).get("output_tokens_per_s")
            if engine and anchor:
                results[f"ratio_engine_{key}{suffix}_over_vllm_with_logprobs"] = engine / anchor
            if not suffix or not engine:
                continue
            default = results.get(f"engine_{key}", {}).get("output_tokens_per_s")
            if default:
                results[f"ratio_engine_{key}{suffix}_over_engine_{key}"] = engine / default
            alike = results.get(f"vllm{suffix}", {}).get(f"vllm_{key}_logprobs", {}).get("output_tokens_per_s")
            if alike:
                results[f"ratio_engine_{key}{suffix}_over_vllm{suffix}_with_logprobs"] = engine / alike


def summarize(results: dict, workloads: list[str], suffixes: list[str]) -> dict:
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in results.items() if k.startswith("ratio")}
    keys = [f"{key}{suffix}" for suffix in suffixes
            for key in ("engine_A", "engine_A_read_each_step", *(f"engine_{k}" for k in workloads if k != "A"),
                        *(f"engine_{k}_cascade_off" for k in workloads if k != "A"), "mismatch_B")]
    keys += ["server_A", "transformers_generate_A", "transformers_generate_batch_A"]
    for key in (k for k in keys if k in results):
        r = results[key]
        summary[key] = {k: r[k] for k in ("output_tokens_per_s", "ttft_median_s", "decode_step_median_s_at_full_batch",
                                          "time_between_tokens_max_s", "prompt_tokens_computed", "prompt_tokens_requested", "mean_k3", "error") if k in r}
        roofline = r.get("decode_roofline", {})
        for bandwidth in ("nominal", "measured_copy"):
            if bandwidth in roofline:
                summary[key][f"roofline_fraction_{bandwidth}"] = roofline[bandwidth]["full_batch_fraction"]
    replay = results.get("mismatch_B_router_replay", {})
    if replay:
        summary["mismatch_B_router_replay"] = {k: v.get("mean_k3") if isinstance(v, dict) else v for k, v in replay.items()}
    for vllm in (f"vllm{suffix}" for suffix in suffixes if f"vllm{suffix}" in results):
        summary[vllm] = {k: (v.get("output_tokens_per_s", v.get("error")) if isinstance(v, dict) else v)
                         for k, v in results[vllm].items()}
    return summary


def main() -> None:
    args = parse_args()
    parts = set(args.parts.split(","))
    chosen = args.workloads.split(",")
    unknown = [k for k in chosen if k not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; choose among {list(WORKLOADS)}")
    kv_cache_dtypes = args.kv_cache_dtypes.split(",")
    if not set(kv_cache_dtypes) <= set(KV_CACHE_DTYPES):
        raise SystemExit(f"--kv-cache-dtypes: {args.kv_cache_dtypes!r}; choose among {list(KV_CACHE_DTYPES)}")
    quantizations = args.quantizations.split(",")
    if not set(quantizations) <= set(QUANTIZATIONS):
        raise SystemExit(f"--quantizations: {args.quantizations!r}; choose among {list(QUANTIZATIONS)}")
    variants = [(q, kv) for q in quantizations for kv in kv_cache_dtypes]
    suffixes = [variant_suffix(q, kv) for q, kv in variants]
    device = resolve_device(args.device)
    workloads = {k: scaled(args, k) for k in chosen}
    results: dict = {"workloads": workloads, "environment": environment(device, args.commit), "cuda_graphs": args.cuda_graphs,
                     "cascade_attention": args.cascade_attention, "cascade_min_saved_tokens": args.cascade_min_saved_tokens,
                     "compile_norms": args.compile_norms, "moe_tile_table": args.moe_tile_table, "exact": args.exact,
                     "fused_blocks": args.fused_blocks, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "kv_cache_dtypes": kv_cache_dtypes, "quantizations": quantizations, "fp8_experts": args.fp8_experts,
                     "fp8_tile_table": args.fp8_tile_table}
    with tempfile.TemporaryDirectory() as tmp:
        if args.load_format is None:
            args.load_format = "dummy" if not args.model and args.preset in DUMMY_PRESETS else "safetensors"
        context = max(w["prompt_len"] + w["output_len"] for w in workloads.values())
        if not args.model and args.max_position_embeddings is None and context > PRESETS[args.preset]["max_position_embeddings"]:
            args.max_position_embeddings = context
        folder = Path(args.model) if args.model else init_model(
            args.preset, Path(tmp) / args.preset, seed=args.seed, num_layers=args.num_layers, weights=args.load_format != "dummy",
            max_position_embeddings=args.max_position_embeddings)
        results["model"] = args.model or (f"preset {args.preset}" + (f", {args.num_layers} layers" if args.num_layers else "")
                                          + (f", {args.max_position_embeddings} positions" if args.max_position_embeddings else ""))
        results["load_format"] = args.load_format
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompts = {k: prompts_for(w, vocab, args.seed + list(WORKLOADS).index(k)) for k, w in workloads.items()}
        shared = {k: w for k, w in workloads.items() if k in SHARED_ENGINE}
        if parts & {"engine", "mismatch"}:
            bandwidths = {"nominal": nominal_bandwidth(device), "measured_copy": measured_copy_bandwidth(device)}
            results["memory_bandwidth"] = bandwidths
            for q, kv in variants:
                suffix = variant_suffix(q, kv)
                if shared:
                    figures: dict = {}
                    bench_engine(folder, args, figures, shared, {k: prompts[k] for k in shared}, vocab, parts, bandwidths,
                                 kv, q)
                    free_device_memory(args)
                    results.update({f"{key}{suffix}": value for key, value in figures.items()})
                for name in (k for k in ("E", "F") if k in workloads):
                    attempt(results, f"engine_{name}{suffix}",
                            lambda: bench_long_decode(folder, args, name, workloads[name], prompts[name], bandwidths, kv, q))
        if "vllm" in parts and shared:
            for q, kv in variants:
                attempt(results, f"vllm{variant_suffix(q, kv)}",
                        lambda: bench_vllm(folder, args, shared, {k: prompts[k] for k in shared}, Path(tmp), kv, q))
        a = scaled(args, "A")
        prompts_a = prompts.get("A") or prompts_for(a, vocab, args.seed)
        if "server" in parts:
            attempt(results, "server_A", lambda: bench_server(folder, args, a, vocab, Path(tmp)))
        if parts & {"generate", "generate_batch"}:
            model = load_transformers(folder, args, device)
            if "generate" in parts:
                attempt(results, "transformers_generate_A", lambda: bench_generate(model, device, a, prompts_a))
            if "generate_batch" in parts:
                attempt(results, "transformers_generate_batch_A", lambda: bench_generate_batch(model, device, a, prompts_a))
    add_ratios(results, chosen, suffixes)
    profiles = {suffix.strip("_") or "default": results[f"profile_A{suffix}"] for suffix in suffixes
                if "prefill" in results.get(f"profile_A{suffix}", {})}
    if profiles:
        print_comparison(profiles)
    summary = summarize(results, chosen, suffixes)
    print(json.dumps(summary, indent=1, default=lambda v: round(v, 4) if isinstance(v, float) else str(v)))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
