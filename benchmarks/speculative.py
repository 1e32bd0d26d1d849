"""Speculative decoding in tandem's engine against the same engine without it, in one run.

    python benchmarks/speculative.py --preset tiny --device cpu                      # a quick look
    python benchmarks/speculative.py --preset qwen3-0.6b --device cuda --out $OUT/spec.json

Four engines on the same model (random weights of the preset's shape, `model.load_format = "dummy"`): the default
(overlapped steps on CUDA), the same with `overlap_steps = false`, and n-gram speculation
(`engine.speculative.method = "ngram"`, k = `--num-tokens`) with and without overlapped steps. Each serves the same
seeded requests; the figures are output tokens/s, the acceptance (accepted over drafted tokens) and whether every
request's tokens equal the non-speculative engine's (the promise of deterministic drafts: the same seed gives the
same tokens; in bf16 on CUDA the verifying forward rounds otherwise than a decode step, see docs/inference.md).

Random weights decode at temperature 1 near uniformly over the vocabulary, where no draft is ever right; greedy
decoding of random weights falls into loops, which prompt lookup drafts well. `--temperatures` picks which: 0 gives
a best case for n-gram drafts (loops), 1 the worst (nothing repeats). Neither is a trained model's acceptance.
Each engine is built once (graph captures) and serves the requests at every temperature in turn.

Per engine and temperature the file also holds the steps' wall times (median, 90th percentile, the longest), how
many steps verified drafts, and work a steady step should not do (graphs compiled, device allocations:
`step_profile.once_only_counts`; garbage collections); `--breakdown` adds the milliseconds a step spends, on average, in each of the
engine's parts (`BREAKDOWN`), so that a gap between two engines shows where it lies: host work (scheduling, the
drafting rule, step inputs and launches, reading results) or `wait`, the host blocked on the device's results.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from provenance import environment, source_commit
from step_profile import counts_since, once_only_counts
from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig, SpeculativeConfig
from tandem.inference.engine.host_copies import HostRead
from tandem.inference.engine.llm_engine import LLMEngine
from tandem.inference.engine.model_runner import PagedModelRunner
from tandem.inference.engine.sampler import Sampler
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.scheduler import Scheduler
from tandem.inference.engine.setup import build_engine
from tandem.inference.engine.speculative import Speculator
from tandem.inference.engine.step_inputs import StepInputBuilder
from tandem.inference.server import settle_heap
from tandem.models.presets import PRESETS, init_model


BREAKDOWN = {"should_draft": (Speculator, "should_draft"), "schedule": (Scheduler, "schedule"),
             "launch": (LLMEngine, "_launch"), "propose": (Speculator, "propose"), "runner": (PagedModelRunner, "run"),
             "observe": (Speculator, "observe"),
             "inputs": (StepInputBuilder, "build"), "verify_inputs": (StepInputBuilder, "build_verify"),
             "forward": (PagedModelRunner, "_forward"), "head": (PagedModelRunner, "_logits"),
             "sample": (Sampler, "sample"), "verify": (Speculator, "verify"), "read": (LLMEngine, "_read"),
             "wait": (HostRead, "values")}
"""Engine parts timed by `--breakdown`: `launch` includes `propose`, `runner` (step inputs, graph replay or eager
forward), `observe` (the proposer's work after the policy's forward is launched), `sample` and `verify`; `runner` includes `inputs` or `verify_inputs` (the step's tensors), `forward` (an
eager step's model, on CPU its compute) and `head` (the LM head); `read` includes `wait`. A step's wall time past
`should_draft` + `schedule` + `launch` + `read` is the engine's own bookkeeping."""


@contextmanager
def timed_parts(seconds: dict[str, float]):
    """Add the wall time of each call of `BREAKDOWN`'s methods to `seconds[name]` while the block runs."""
    originals = {name: getattr(cls, method) for name, (cls, method) in BREAKDOWN.items()}

    def timing(name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
        return wrapper

    for name, (cls, method) in BREAKDOWN.items():
        setattr(cls, method, timing(name, originals[name]))
    try:
        yield
    finally:
        for name, (cls, method) in BREAKDOWN.items():
            setattr(cls, method, originals[name])


def run(engine, prompts: list[list[int]], max_tokens: int, temperature: float, breakdown: bool = False
        ) -> tuple[dict, float, dict]:
    """Every request to its end; (request id -> (tokens, logprobs)), seconds, and the steps' figures. The heap is
    settled first as the server settles it (`settle_heap`), so that a full collection of what earlier runs and
    engines left does not land in one engine's timing; unfrozen after, so that a dropped engine's memory can be
    collected."""
    settle_heap()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                                          ignore_eos=True), incremental=False)
    outputs = {}
    step_seconds = []
    parts: dict[str, float] = collections.defaultdict(float)
    verifying_parts: dict[str, float] = collections.defaultdict(float)
    """The parts of the steps that verified drafts (read with the step that launched them: overlap off)."""
    drafted_before = engine.num_draft_tokens
    num_verifying = 0
    verifying_seconds = 0.0
    once_only = once_only_counts(engine.device)
    collections_before = [g["collections"] for g in gc.get_stats()]
    with timed_parts(parts) if breakdown else nullcontext():
        start = time.perf_counter()
        while engine.has_unfinished:
            step_start = time.perf_counter()
            drafted = engine.num_draft_tokens
            parts_before = dict(parts)
            for out in engine.step():
                outputs[out.request_id] = (out.token_ids, out.logprobs)
            step_seconds.append(time.perf_counter() - step_start)
            if engine.num_draft_tokens > drafted:
                num_verifying += 1
                verifying_seconds += step_seconds[-1]
                for name, seconds in parts.items():
                    verifying_parts[name] += seconds - parts_before.get(name, 0.0)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        seconds = time.perf_counter() - start
    once_only = counts_since(once_only, engine.device)
    gc_collections = [g["collections"] - before for g, before in zip(gc.get_stats(), collections_before)]
    gc.unfreeze()
    ms = sorted(1e3 * t for t in step_seconds)
    steps = {"num_steps": len(ms), "num_verifying_steps": num_verifying, "median_step_ms": statistics.median(ms),
             "p90_step_ms": ms[int(0.9 * (len(ms) - 1))], "max_step_ms": ms[-1],
             "drafted_per_verifying_step": (engine.num_draft_tokens - drafted_before) / max(num_verifying, 1),
             "mean_verifying_step_ms": 1e3 * verifying_seconds / max(num_verifying, 1),
             "once_only": once_only, "gc_collections": gc_collections}
    if breakdown:
        steps["ms_per_step"] = {name: 1e3 * parts[name] / len(ms) for name in BREAKDOWN}
        if num_verifying:
            steps["ms_per_verifying_step"] = {name: 1e3 * verifying_parts[name] / num_verifying for name in BREAKDOWN}
    return outputs, seconds, steps


ENGINES = ("default", "no_overlap", "ngram", "ngram_no_overlap")


def ratio(results: dict, a: str, b: str) -> float | None:
    """Output tokens/s of engine `a` over engine `b`, where both ran."""
    if a not in results or b not in results:
        return None
    return results[a]["output_tokens_per_s"] / results[b]["output_tokens_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperatures", default="0", help="comma-separated; each engine serves the requests at each")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--num-tokens", type=int, default=4, help="k, tokens drafted per sequence and step")
    parser.add_argument("--min-expected-tokens", type=float,
                        help="the n-gram drafting rule's bar (`engine.speculative.min_expected_tokens`; default: its own)")
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the engine's parts per step (`BREAKDOWN`); costs a microsecond or two a call")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD, which a copied tree may hold stale)")
    args = parser.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    names = args.engines.split(",")
    unknown = set(names) - set(ENGINES)
    if unknown:
        parser.error(f"--engines: unknown {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    rng = random.Random(0)
    results: dict[float, dict] = {t: {} for t in temperatures}
    outputs: dict[float, dict] = {t: {} for t in temperatures}
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_model(args.preset, Path(tmp) / "model", weights=False)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
        model = ModelConfig(name=str(folder), load_format="dummy")
        base = dict(device=args.device, max_num_seqs=args.requests, max_model_len=args.prompt_tokens + args.max_tokens + 16)
        rule = {} if args.min_expected_tokens is None else {"min_expected_tokens": args.min_expected_tokens}
        spec = SpeculativeConfig(method="ngram", num_tokens=args.num_tokens, **rule)
        configs = {"default": EngineConfig(**base),
                   "no_overlap": EngineConfig(**base, overlap_steps=False),
                   "ngram": EngineConfig(**base, speculative=spec),
                   "ngram_no_overlap": EngineConfig(**base, overlap_steps=False, speculative=spec)}
        for name in names:
            engine = build_engine(model, configs[name], seed=0)
            run(engine, prompts[:2], 8, temperatures[0])  # warm-up: compilation, graphs
            for t in temperatures:
                drafted, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
                outputs[t][name], seconds, steps = run(engine, prompts, args.max_tokens, t, args.breakdown)
                tokens = sum(len(ids) for ids, _ in outputs[t][name].values())
                drafted, accepted = engine.num_draft_tokens - drafted, engine.num_accepted_tokens - accepted
                results[t][name] = {"seconds": seconds, "output_tokens_per_s": tokens / seconds, "drafted": drafted,
                                    "accepted": accepted, "acceptance": accepted / max(drafted, 1), **steps}
                print(f"T = {t:g}, {name}: {tokens / seconds:,.0f} output tokens/s, drafted {drafted}, accepted "
                      f"{accepted}; {steps['num_steps']} steps ({steps['num_verifying_steps']} verifying), median "
                      f"{steps['median_step_ms']:.2f} ms, p90 {steps['p90_step_ms']:.2f}, max {steps['max_step_ms']:.1f}",
                      file=sys.stderr)
                print(f"    once-only work {steps['once_only']}, garbage collections per generation "
                      f"{steps['gc_collections']}", file=sys.stderr)
                if args.breakdown:
                    for label, key in (("ms/step", "ms_per_step"), ("ms/verifying step", "ms_per_verifying_step")):
                        if key in steps:
                            print(f"    {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in steps[key].items()),
                                  file=sys.stderr)
            del engine
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    summary = {}
    for t in temperatures:
        entry: dict = {"speedup_over_default": ratio(results[t], "ngram", "default"),
                       "speedup_without_overlap": ratio(results[t], "ngram_no_overlap", "no_overlap")}
        if "ngram" in outputs[t] and "default" in outputs[t]:
            spec_out, plain = outputs[t]["ngram"], outputs[t]["default"]
            entry["same_tokens_as_without"] = all(spec_out[r][0] == plain[r][0] for r in plain)
            entry["max_logprob_difference"] = max(
                max((abs(a - b) for a, b in zip(spec_out[r][1], plain[r][1])), default=0.0) for r in plain)
        summary[f"T={t:g}"] = entry
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "speculative", "commit": source_commit(args.commit),
                                              "settings": vars(args),
                                              "engines": {f"T={t:g}": results[t] for t in temperatures},
                                              "summary": summary,
                                              "environment": environment(torch.device(args.device), args.commit)},
                                             indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
