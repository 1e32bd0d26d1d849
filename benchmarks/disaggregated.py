"""Prefill/decode disaggregation against one colocated server, with staggered arrivals, on the CPU or one GPU.
    python benchmarks/disaggregated.py --preset tiny --out benchmarks/results/pd-cpu-<date>.json
    python benchmarks/disaggregated.py --device cuda --preset qwen3-0.6b --num-decoding 64 --output-len 4096 \
        --long-prompt-len 8192 --arrival-ms 100 --kv-transports shared_memory,http --out benchmarks/results/pd-gpu-<date>.json

Workload: `--num-decoding` requests (`--decode-prompt-len` prompt tokens, `--output-len` output tokens, streamed,
EOS ignored) decode while prompts of `--long-prompt-len` tokens arrive every `--arrival-ms` (each asks one token, as
an agent's next turn or a new rollout would start). Workload D of `inference.py` admits everything at once, so no
prompt lands in the middle of decoding: this one measures exactly that. Two setups, each in processes of their own
as `tandem rl` starts them, on the same model folder: one colocated server; a prefill server and, for each of
`--kv-transports`, a decode server taking the blocks through it (the client talks to the decode server, whose
`min_remote_prefill_tokens` is below the long prompts and above a short one). On a GPU every server runs on device
0, as `deployment.disaggregated_memory_fraction` places them; each server's KV cache is sized to the workload
(`engine.num_blocks`: the decoding requests and `--long-in-flight` long prompts), the colocated server's to both
pools', so the comparison is at equal cache memory. Figures per setup: the decoding requests' time between tokens
(p50, p99, from the stream's arrival times at the client; the median is the decode step as the client sees it) and
their output tokens/s, with the goal's two ratios (p99 / p50, tokens/s against colocated); the long prompts served
by `--drain-s` after the decoding ends (later ones are cancelled: a transport that cannot keep up shows as few);
and each transport's hand-off alone (a prompt the prefill server holds, taken into this process's device memory)
per 1k prompt tokens. The goal of the design: p99 time between tokens within 2x the median step, at no more than
10% fewer output tokens/s than colocated.

Each setup's `steps` say what made its slow steps slow: every server keeps step records (`engine.num_step_records`),
and those of the server the client talks to, over the decoding phase, are broken down by `step_breakdown.py`: the
slowest percent of steps against the median ones (time parts, batch, handed-over prompts joining and their KV
tokens written in, graph or eager) and, per possible cause, its share of the slow steps; for a decode server the
prefill server's records mark the steps during which it computed prompts on the same device (`peer_busy`); the
records themselves are kept beside the servers' logs. `--isolate` tells the decode server's own costs of a hand-off
from the prefill server's work on a shared device: the same decode server runs the workload with the long prompts
sent to the prefill server itself (`decode_prefill_busy`: the device shared, nothing handed over), then with none
(`decode_alone`). `--switch-interval-ms` sets every server's `server.switch_interval_ms`: how long the engine thread
may wait for the interpreter lock that the HTTP side holds.
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
import msgspec
import torch
from provenance import environment
from step_breakdown import breakdown, in_window

from tandem.config.resolve import free_port
from tandem.inference.disaggregated import make_kv_transport
from tandem.inference.disaggregated.wire import PrefillAnswer
from tandem.launch.process import ManagedProcess
from tandem.launch.rl import wait_healthy
from tandem.models.presets import PRESETS, init_model

BLOCK_SIZE = 16
"""`engine.block_size`'s default: the servers' caches are counted in its blocks."""

NUM_STEP_RECORDS = 50_000
"""`engine.num_step_records` of every server: more steps than a run of this benchmark takes."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--num-decoding", type=int, default=16)
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--long-prompt-len", type=int, default=1024)
    parser.add_argument("--arrival-ms", type=float, default=200.0)
    parser.add_argument("--long-in-flight", type=int, default=8,
                        help="long prompts each cache has room for beside the decoding requests")
    parser.add_argument("--drain-s", type=float, default=10.0,
                        help="how long the long prompts still running when the decoding ends may take to finish")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--kv-transports", default="http", help="comma-separated `disaggregation.kv_transport` values")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server process")
    parser.add_argument("--isolate", action="store_true",
                        help="on the first transport's decode server, run the workload twice more to tell the causes "
                             "of slow steps apart: the long prompts sent to the prefill server itself (it computes on "
                             "the device, nothing is handed over), then no long prompts at all")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="every server's `server.switch_interval_ms` (unset: Python's 5 ms)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def num_blocks(args: argparse.Namespace, pool: str) -> int:
    """KV blocks of a `pool` server's cache (`decode`, `prefill`, `colocated`: both): the decoding requests in a
    decode server, `--long-in-flight` long prompts in each."""
    def blocks(num_tokens: int) -> int:
        return -(-num_tokens // BLOCK_SIZE)
    long = args.long_in_flight * blocks(args.long_prompt_len + 1)
    decoding = args.num_decoding * blocks(args.decode_prompt_len + args.output_len)
    return {"prefill": long, "decode": decoding + long, "colocated": decoding + 2 * long}[pool]


@contextmanager
def server(folder: Path, logs: Path, name: str, args: argparse.Namespace, pool: str, *flags: str):
    """A `tandem inference` process (on GPU 0 with `--device cuda`); yields its URL once it answers /health."""
    port = free_port()
    max_len = max(args.decode_prompt_len + args.output_len, args.long_prompt_len + 1)
    weights = ["--model.load-format", "dummy"] if args.device == "cuda" else []
    if args.switch_interval_ms is not None:
        flags = (*flags, "--server.switch-interval-ms", str(args.switch_interval_ms))
    argv = [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(folder), "--server.port", str(port),
            "--engine.device", args.device, "--engine.max-model-len", str(max_len), "--seed", str(args.seed),
            "--engine.num-blocks", str(num_blocks(args, pool)),
            "--engine.max-num-seqs", str(args.num_decoding + args.long_in_flight),
            "--engine.num-step-records", str(NUM_STEP_RECORDS), *weights, *flags]
    proc = ManagedProcess(name, argv, logs / f"{name}.log", {**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout_s=600)
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


async def workload(url: str, args: argparse.Namespace, vocab: int, model: str, long_url: str | None = "",
                   long_seed: int = 10_000) -> dict:
    """The decoding requests to `url` while the long prompts arrive at `long_url` (default `url`; None: no long
    prompts), these numbered from `long_seed` on (a server that computed a prompt before would find it cached)."""
    long_url = url if long_url == "" else long_url
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        decoding = [asyncio.create_task(decode_one(http, url, {
            "model": model, "prompt": prompt(i, args.decode_prompt_len, vocab), "max_tokens": args.output_len,
            "temperature": 1.0, "ignore_eos": True, "stream": True, "return_token_ids": True, "seed": i}))
            for i in range(args.num_decoding)]
        start = time.perf_counter()
        arrivals = []
        while long_url is not None and not all(task.done() for task in decoding):
            long = {"prompt_token_ids": prompt(long_seed + len(arrivals), args.long_prompt_len, vocab), "max_tokens": 1}
            arrivals.append(asyncio.create_task(http.post(f"{long_url}/v1/generate", json=long)))
            await asyncio.sleep(args.arrival_ms / 1000)
        times = [await task for task in decoding]
        end = time.perf_counter()
        served, late = await asyncio.wait(arrivals, timeout=args.drain_s) if arrivals else (set(), set())
        for task in served:
            task.result().raise_for_status()
        for task in late:
            task.cancel()
    gaps = sorted(b - a for t in times for a, b in zip(t, t[1:]))
    num_tokens = sum(len(t) for t in times)
    p50, p99 = gaps[len(gaps) // 2], gaps[int(len(gaps) * 0.99)]
    return {"output_tokens": num_tokens, "output_tokens_per_s": num_tokens / (end - start),
            "tbt_p50_ms": 1000 * p50, "tbt_p99_ms": 1000 * p99, "tbt_p99_over_p50": p99 / p50,
            "num_long_prompts": len(arrivals), "num_long_prompts_served": len(served),
            "decoding_window": [max(t[0] for t in times if t), end]}


async def hand_off_ms_per_1k(prefill_url: str, transport_name: str, device: torch.device, args: argparse.Namespace,
                             vocab: int) -> float:
    """One transport alone: a prompt the prefill server holds, taken into `device` (the copy an engine's cache
    import starts from), per 1k prompt tokens (median of 3)."""
    transport = make_kv_transport(transport_name, device, 60.0)
    await asyncio.to_thread(transport.connect, prefill_url, 60.0, {})
    times = []
    try:
        async with httpx.AsyncClient(timeout=None) as http:
            for i in range(3):
                response = await http.post(f"{prefill_url}/prefill", json={
                    "prompt_token_ids": prompt(90_000 + i, args.long_prompt_len, vocab), "weight_version": 0})
                response.raise_for_status()
                answer = msgspec.json.decode(response.content, type=PrefillAnswer)
                start = time.perf_counter()
                tensors = [t.to(device) for t in await transport.receive(http, prefill_url, answer)]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
                del tensors
    finally:
        transport.close()
    return 1000 * sorted(times)[1] / (args.long_prompt_len / 1000)


def main() -> None:
    args = parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    results: dict = {"workload": {k: v for k, v in vars(args).items() if k != "out"}, "environment": environment(device)}
    transports = args.kv_transports.split(",")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = init_model(args.preset, Path(tmp) / args.preset, seed=args.seed, weights=args.device == "cpu")
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        logs = Path(args.out).with_suffix("") if args.out else Path(tmp) / "logs"
        url = stack.enter_context(server(folder, logs, "colocated", args, "colocated"))
        colocated = results["colocated"] = asyncio.run(workload(url, args, vocab, str(folder)))
        colocated["steps"] = step_figures(url, colocated, None, logs / "colocated.steps.json")
        save(results, args.out)
        stack.close()
        prefill_url = stack.enter_context(server(folder, logs, "prefill", args, "prefill", "--disaggregation.role",
                                                 "prefill"))
        for transport in transports:
            with server(folder, logs, f"decode-{transport}", args, "decode", "--disaggregation.role", "decode",
                        "--disaggregation.prefill-urls", json.dumps([prefill_url]),
                        "--disaggregation.kv-transport", transport, "--disaggregation.min-remote-prefill-tokens",
                        str((args.decode_prompt_len + args.long_prompt_len) // 2)) as decode_url:
                setup = asyncio.run(workload(decode_url, args, vocab, str(folder)))
                setup["output_tokens_per_s_over_colocated"] = setup["output_tokens_per_s"] / colocated["output_tokens_per_s"]
                setup["stats"] = httpx.get(f"{decode_url}/disaggregation/stats").json()
                setup["steps"] = step_figures(decode_url, setup, prefill_url, logs / f"decode-{transport}.steps.json")
                results[f"disaggregated_{transport}"] = setup
                save(results, args.out)
                if args.isolate and transport == transports[0]:
                    for name, long_url, long_seed in (("prefill_busy", prefill_url, 20_000), ("alone", None, 0)):
                        alone = asyncio.run(workload(decode_url, args, vocab, str(folder), long_url, long_seed))
                        alone["steps"] = step_figures(decode_url, alone, prefill_url,
                                                      logs / f"decode-{transport}-{name}.steps.json")
                        results[f"decode_{name}"] = alone
                        save(results, args.out)
            setup["hand_off_ms_per_1k_tokens"] = asyncio.run(hand_off_ms_per_1k(prefill_url, transport, device, args, vocab))
            save(results, args.out)
    print(json.dumps(results, indent=1))


def step_figures(url: str, setup: dict, peer_url: str | None, keep: Path) -> dict:
    """The breakdown of the decoding phase's steps of the server at `url` (`step_breakdown.breakdown`), the server
    at `peer_url` (sharing its device) as the peer; the records themselves go to `keep`, for a closer look."""
    def steps(at: str) -> list[dict]:
        return in_window(httpx.get(f"{at}/engine/steps", timeout=60).json()["steps"], *setup["decoding_window"])
    own, peer = steps(url), steps(peer_url) if peer_url else []
    keep.parent.mkdir(parents=True, exist_ok=True)
    keep.write_text(json.dumps({"steps": own, "peer_steps": peer}))
    return breakdown(own, peer)


def save(results: dict, out: str | None) -> None:
    """After each setup, so that a run cut short keeps the setups it finished."""
    if out:
        path = Path(out)
        path.with_suffix(".tmp").write_text(json.dumps(results, indent=1) + "\n")
        path.with_suffix(".tmp").replace(path)


if __name__ == "__main__":
    main()
