"""The engine thread's host cost per decode step when served, against the same engine in this process.

    python benchmarks/served_host.py --preset tiny --out benchmarks/results/served-host-cpu-<date>.json

One batch, two ways: `--num-decoding` requests (`--prompt-len` prompt tokens, `--output-len` output tokens, T = 1,
seeded, EOS ignored) given to an engine in this process as a server gives them (incremental outputs: a text piece
per token), then streamed to a `tandem inference` server in its own process, as `disaggregated.py` sends them
(`/v1/completions`, `stream`, `return_token_ids`). Figures per setup, over the steps that read a token for every
request and computed no prompt: the median step (`interval`), the engine thread's CPU time in it and how often the
thread blocked (step records, `engine.num_step_records`). For the server also, over the decoding phase, the CPU
time per step of the whole process and of its threads but the engine's (the event loop that streams the tokens,
mostly: it shares the interpreter lock with the engine thread), and the client's time between tokens. A CPU step
computes its forward on the engine thread, so both setups hold the same forward; what the server adds is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from disaggregated import BLOCK_SIZE, decode_one, prompt, save
from provenance import environment
from step_breakdown import in_window

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.config.resolve import free_port
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.inference.server import settle_heap
from tandem.launch.process import ManagedProcess
from tandem.launch.rl import wait_healthy
from tandem.models.presets import PRESETS, init_model

NUM_STEP_RECORDS = 10_000
"""More steps than one run takes."""


def decode_steps(records: list[dict], num_seqs: int) -> list[dict]:
    """The records of steps that read a token for every request and computed no prompt tokens."""
    return [r for r in records if r["read"] is not None and r["read"]["num_seqs"] == num_seqs
            and r["read"]["num_prefill_tokens"] == 0 and r["launched"] is not None]


def figures(steps: list[dict]) -> dict:
    def median_ms(key: str) -> float:
        return 1e3 * statistics.median(s[key] for s in steps)
    cpu = sorted(s["cpu_s"] for s in steps)
    return {"num_steps": len(steps), "interval_ms": median_ms("interval_s"), "engine_cpu_ms": median_ms("cpu_s"),
            "engine_cpu_p99_ms": 1e3 * cpu[int(0.99 * len(cpu))],
            "engine_blocked": statistics.median(s["num_blocked"] for s in steps)}


def in_process(args: argparse.Namespace, engine_config: EngineConfig, model: ModelConfig, vocab: int) -> dict:
    engine = build_engine(model, engine_config, args.seed)
    settle_heap()
    for i in range(args.num_decoding):
        engine.add_request(str(i), prompt(i, args.prompt_len, vocab), SamplingParams(
            max_tokens=args.output_len, temperature=1.0, seed=i, ignore_eos=True), incremental=True)
    while engine.has_unfinished:
        engine.step()
    return figures(decode_steps(engine.step_records.snapshot(), args.num_decoding))


def process_cpu_s(pid: int) -> float:
    """User and system CPU time of the process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_all(url: str, args: argparse.Namespace, vocab: int, model: str) -> list[list[float]]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        return await asyncio.gather(*(decode_one(http, url, {
            "model": model, "prompt": prompt(i, args.prompt_len, vocab), "max_tokens": args.output_len,
            "temperature": 1.0, "ignore_eos": True, "stream": True, "return_token_ids": True, "seed": i})
            for i in range(args.num_decoding)))


def served(args: argparse.Namespace, engine_config: EngineConfig, model: ModelConfig, logs: Path, vocab: int) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "tandem.cli", "inference", "--model.name", model.name, "--model.load-format",
            model.load_format, "--server.port", str(port), "--seed", str(args.seed)]
    for key in ("device", "max_model_len", "max_num_seqs", "num_blocks", "num_step_records"):
        argv += [f"--engine.{key.replace('_', '-')}", str(getattr(engine_config, key))]
    proc = ManagedProcess("server", argv, logs / "server.log", {**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout_s=600)
        cpu_before, start = process_cpu_s(proc.pid), time.perf_counter()
        times = asyncio.run(stream_all(url, args, vocab, model.name))
        cpu_s, end = process_cpu_s(proc.pid) - cpu_before, time.perf_counter()
        records = httpx.get(f"{url}/engine/steps", timeout=60).json()["steps"]
    finally:
        proc.stop()
    window = in_window(records, start, end)
    gaps = sorted(b - a for t in times for a, b in zip(t, t[1:]))
    num_steps = sum(r["read"] is not None for r in window)
    return {**figures(decode_steps(window, args.num_decoding)),
            "process_cpu_ms_per_step": 1e3 * cpu_s / num_steps,
            "other_threads_cpu_ms_per_step": 1e3 * (cpu_s - sum(r["cpu_s"] for r in window)) / num_steps,
            "tbt_p50_ms": 1e3 * gaps[len(gaps) // 2], "tbt_p99_ms": 1e3 * gaps[int(0.99 * len(gaps))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--num-decoding", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process and the server's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {"workload": {k: v for k, v in vars(args).items() if k != "out"},
                     "environment": environment(torch.device("cpu"))}
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_model(args.preset, Path(tmp) / args.preset, seed=args.seed, weights=False)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        model = ModelConfig(name=str(folder), load_format="dummy")
        max_len = args.prompt_len + args.output_len
        engine_config = EngineConfig(device="cpu", max_model_len=max_len, max_num_seqs=args.num_decoding,
                                     num_blocks=args.num_decoding * -(-max_len // BLOCK_SIZE),
                                     num_step_records=NUM_STEP_RECORDS)
        results["in_process"] = in_process(args, engine_config, model, vocab)
        logs = Path(args.out).with_suffix("") if args.out else Path(tmp) / "logs"
        results["served"] = served(args, engine_config, model, logs, vocab)
    results["served_engine_cpu_over_in_process"] = (results["served"]["engine_cpu_ms"]
                                                     / results["in_process"]["engine_cpu_ms"])
    save(results, args.out)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
