"""Prefill/decode disaggregation against one colocated server, with staggered arrivals (CPU only for now).
    python benchmarks/disaggregated.py --preset tiny --out benchmarks/results/pd-cpu-<date>.json

Workload: `--num-decoding` requests (`--decode-prompt-len` prompt tokens, `--output-len` output tokens, streamed,
EOS ignored) decode while prompts of `--long-prompt-len` tokens arrive every `--arrival-ms` (each asks one token, as
an agent's next turn or a new rollout would start). Workload D of `inference.py` admits everything at once, so no
prompt lands in the middle of decoding: this one measures exactly that. Two setups, each in processes of their own
as `tandem rl` starts them, on the same model folder: one colocated server; a prefill and a decode server (the
client talks to the decode server, whose `min_remote_prefill_tokens` is below the long prompts and above a short
one). Figures per setup: the decoding requests' time between tokens (p50, p99, from the stream's arrival times at
the client) and their output tokens/s; for the disaggregated setup, the KV hand-off alone (`GET /kv` of the http
transport) per 1k prompt tokens. The goal of the design: p99 time between tokens within 2x the median step, at no
more than 10% fewer output tokens/s than colocated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import torch
from provenance import environment

from tandem.config.resolve import free_port
from tandem.launch.process import ManagedProcess
from tandem.launch.rl import wait_healthy
from tandem.models.presets import PRESETS, init_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--num-decoding", type=int, default=16)
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--long-prompt-len", type=int, default=1024)
    parser.add_argument("--arrival-ms", type=float, default=200.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


@contextmanager
def server(folder: Path, logs: Path, name: str, args: argparse.Namespace, *flags: str):
    """A `tandem inference` process on the CPU; yields its URL once it answers /health."""
    port = free_port()
    max_len = max(args.decode_prompt_len + args.output_len, args.long_prompt_len + 1)
    argv = [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(folder), "--server.port", str(port),
            "--engine.device", "cpu", "--engine.max-model-len", str(max_len), "--seed", str(args.seed), *flags]
    proc = ManagedProcess(name, argv, logs / f"{name}.log", {**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout_s=300)
        yield url
    finally:
        proc.stop()


def prompt(i: int, length: int, vocab: int) -> list[int]:
    return [(i * 7919 + j * 104729) % (vocab - 1) + 1 for j in range(length)]


async def decode_one(http: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    """Arrival times of the tokens of one streamed completion."""
    times = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times += [time.perf_counter()] * len(json.loads(line[6:])["choices"][0].get("token_ids") or [0])
    return times


async def workload(url: str, args: argparse.Namespace, vocab: int, model: str) -> dict:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        decoding = [asyncio.create_task(decode_one(http, url, {
            "model": model, "prompt": prompt(i, args.decode_prompt_len, vocab), "max_tokens": args.output_len,
            "temperature": 1.0, "ignore_eos": True, "stream": True, "return_token_ids": True, "seed": i}))
            for i in range(args.num_decoding)]
        start = time.perf_counter()
        arrivals = []
        while not all(task.done() for task in decoding):
            long = {"prompt_token_ids": prompt(10_000 + len(arrivals), args.long_prompt_len, vocab), "max_tokens": 1}
            arrivals.append(asyncio.create_task(http.post(f"{url}/v1/generate", json=long)))
            await asyncio.sleep(args.arrival_ms / 1000)
        times = [await task for task in decoding]
        end = time.perf_counter()
        for task in arrivals:
            (await task).raise_for_status()
    gaps = sorted(b - a for t in times for a, b in zip(t, t[1:]))
    num_tokens = sum(len(t) for t in times)
    return {"output_tokens": num_tokens, "output_tokens_per_s": num_tokens / (end - start),
            "tbt_p50_ms": 1000 * gaps[len(gaps) // 2], "tbt_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)],
            "num_long_prompts": len(arrivals)}


def hand_off_ms_per_1k(prefill_url: str, args: argparse.Namespace, vocab: int) -> float:
    """The http transport alone: `GET /kv` of a prompt the prefill server holds, per 1k prompt tokens (median of 5)."""
    times = []
    for i in range(5):
        answer = httpx.post(f"{prefill_url}/prefill", json={"prompt_token_ids": prompt(90_000 + i, args.long_prompt_len,
                                                                                     vocab), "weight_version": 0},
                            timeout=None).json()
        start = time.perf_counter()
        httpx.get(f"{prefill_url}/kv/{answer['transfer_id']}", timeout=None).raise_for_status()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[2] / (args.long_prompt_len / 1000)


def main() -> None:
    args = parse_args()
    results: dict = {"workload": {k: v for k, v in vars(args).items() if k != "out"}, "environment": environment(torch.device("cpu"))}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = init_model(args.preset, Path(tmp) / args.preset, seed=args.seed)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        logs = Path(args.out).with_suffix("") if args.out else Path(tmp) / "logs"
        url = stack.enter_context(server(folder, logs, "colocated", args))
        results["colocated"] = asyncio.run(workload(url, args, vocab, str(folder)))
        stack.close()
        prefill_url = stack.enter_context(server(folder, logs, "prefill", args, "--disaggregation.role", "prefill"))
        decode_url = stack.enter_context(server(
            folder, logs, "decode", args, "--disaggregation.role", "decode", "--disaggregation.prefill-urls",
            json.dumps([prefill_url]), "--disaggregation.min-remote-prefill-tokens",
            str((args.decode_prompt_len + args.long_prompt_len) // 2)))
        results["disaggregated"] = asyncio.run(workload(decode_url, args, vocab, str(folder)))
        results["disaggregated"]["stats"] = httpx.get(f"{decode_url}/disaggregation/stats").json()
        results["disaggregated"]["hand_off_ms_per_1k_tokens"] = hand_off_ms_per_1k(prefill_url, args, vocab)
    print(json.dumps(results, indent=1))
    if args.out:
        out = Path(args.out)
        out.with_suffix(".tmp").write_text(json.dumps(results, indent=1) + "\n")
        out.with_suffix(".tmp").replace(out)


if __name__ == "__main__":
    main()
