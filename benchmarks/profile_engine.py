"""Where an engine step's time goes, on workload A of `benchmarks/inference.py`.

    python benchmarks/profile_engine.py --preset qwen3-0.6b --device cuda --out profile.json

Runs A once with per-step wall times and Python's garbage collections timed (`gc.callbacks`),
reporting the slow steps (over twice the median decode step) and how much of them the
collections explain; then profiles a few prefill and decode steps of a fresh A run with
`torch.profiler` and prints the GPU time by kernel group, the kernels and the host functions that take
the most time (`engine_profile.py`; `inference.py --profile` does the same beside its timed runs, for
every engine variant it runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

from engine_profile import profiled_steps
from inference import add_engine_arguments, engine_config, prompts_for, run_engine, scaled
from tandem.config.base import ModelConfig
from tandem.inference.engine.setup import build_engine
from tandem.models.presets import PRESETS, init_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts and lengths")
    parser.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths only")
    add_engine_arguments(parser)
    parser.add_argument("--exact", action="store_true", help="`run.exact`: the engine's batch-invariant path")
    parser.add_argument("--out", help="write the figures to this JSON file")
    return parser.parse_args()


def timed_run(engine, w: dict, vocab: int, seed: int) -> dict:
    """One run of `w` (`inference.run_engine`) with the garbage collections timed; the slow steps."""
    collections: list[tuple[int, float]] = []
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started["t"]))

    gc.callbacks.append(on_gc)
    try:
        run = run_engine(engine, prompts_for(w, vocab, seed), w["n"], w["output_len"])
    finally:
        gc.callbacks.remove(on_gc)
    times = run["step_seconds"]
    median = statistics.median(times)
    slow = sorted(((i, t) for i, t in enumerate(times) if t > 2 * median), key=lambda x: -x[1])
    return {
        "seconds": run["seconds"], "steps": len(times), "step_median_s": median,
        "slow_steps": len(slow), "slow_steps_s": sum(t for _, t in slow), "slowest": slow[:10],
        "gc": {f"gen{g}": {"count": sum(1 for gen, _ in collections if gen == g),
                           "seconds": sum(d for gen, d in collections if gen == g)} for g in range(3)},
    }


def main() -> None:
    args = parse_args()
    w = scaled(args, "A")
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_model(args.preset, Path(tmp) / args.preset, seed=0)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        engine = build_engine(ModelConfig(name=str(folder)), engine_config(args, w["num_prompts"], w["prompt_len"] + w["output_len"]), 0,
                              exact=args.exact)
        warm = dict(w, num_prompts=4, output_len=8)
        timed_run(engine, warm, vocab, 1)
        results = {"timed": timed_run(engine, w, vocab, 2)}
        print(json.dumps(results["timed"], indent=1), flush=True)
        results["profiled"] = profiled_steps(engine, prompts_for(w, vocab, 3), w["output_len"], num_decode=10)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
