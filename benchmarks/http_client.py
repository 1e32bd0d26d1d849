"""The HTTP path of `tandem inference`: its routes against its own engine in process, and against vLLM's server.

    python benchmarks/http_client.py --preset tiny --device cpu --scale 0.25       # a quick look on the CPU
    python benchmarks/http_client.py --preset qwen3-0.6b --device cuda --vllm-site /tmp/site --out $OUT/http.json

Workload A of `benchmarks/inference.py` (256 concurrent requests, 128 prompt tokens, 512 output tokens;
`--scale` shrinks counts and lengths), sampled at temperature 1 with EOS ignored, so every completion
has exactly its length. Every request of a run is sent at once by httpx (the project's HTTP client) from
`--client-processes` processes, each with its share (one client alone spends more CPU per request than the
server does), to a server in its own process, as `tandem rl` runs it; each run uses fresh random prompts,
so no run is served from the prefix cache of another. Routes, non-streaming as the
orchestrator calls them (`tandem/orchestrator/inference_pool.py`):
- `generate`: `POST /v1/generate` with token ids (vLLM's equivalent: `/inference/v1/generate`, its
  sampled-token logprobs asked with `logprobs: 0`, as the orchestrator's vLLM dialect does);
- `completions`: `POST /v1/completions`, token-id prompts, `logprobs: 0` (the sampled token's logprob);
- `chat`: `POST /v1/chat/completions`, random text of the prompt's length, `logprobs: true, top_logprobs: 0`.

Figures per route and server: output tokens/s of the best of `--repeats` runs, its request latency
percentiles and the server's CPU time per request (its process and children: the overhead, robust to a
shared machine); the engine's own tokens/s in this process (`inference.run_engine`, the same code as the
engine benchmark) before any server starts; ratios of tandem's server over that engine, and of tandem over
vLLM per route. vLLM's OpenAI server runs only with `--vllm-site DIR` (put first on its PYTHONPATH) and
when vLLM imports there; it loads random weights (`--load-format dummy`) from the same model folder and
tokenizer. A part that fails is recorded with its error and the run goes on; the result file is rewritten
after each part, and the servers' logs are kept beside it (`<out stem>/<server>.log`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from inference import add_engine_arguments, attempt, engine_config, prompts_for, run_engine, scaled, with_site
from provenance import environment
from tandem.config.base import ModelConfig
from tandem.config.dump import to_toml
from tandem.config.inference import EngineConfig, InferenceConfig
from tandem.config.resolve import free_port
from tandem.inference.engine.setup import build_engine, resolve_device
from tandem.inference.vllm.args import DEV_MODE_ENV
from tandem.launch.process import ManagedProcess
from tandem.launch.rl import wait_healthy
from tandem.models.presets import PRESETS, init_model
from tandem.orchestrator.server_dialect import TandemDialect, VllmDialect

ROUTES = ("generate", "completions", "chat")

START_TIMEOUT_S = 300
"""Longest wait for a server to answer /health (a vLLM that compiles for minutes still fits; one that hangs does not
take the whole run, whose earlier figures are saved already)."""

CHAT_TEMPLATE_ROOM = 64
"""Context beyond prompt + output that the servers allow: the chat template's tokens around the user's text."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=list(PRESETS), default="tiny", help="build this preset in a temp folder")
    source.add_argument("--model", help="a model folder (instead of a preset)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts and lengths (quick runs)")
    parser.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths only (after --scale)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per route and server; the best counts")
    parser.add_argument("--routes", default=",".join(ROUTES), help="comma-separated routes: " + ", ".join(ROUTES))
    parser.add_argument("--client-processes", type=int, default=4, help="processes that send a run's requests, split evenly")
    add_engine_arguments(parser)
    parser.add_argument("--vllm-site", help="folder put first on the PYTHONPATH of vLLM's server; without it no vLLM part")
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD)")
    return parser.parse_args()


# ---- requests ----------------------------------------------------------------------------------


def chat_text(rng: random.Random, num_chars: int) -> str:
    """Random lowercase words: about a token per character with the presets' byte tokenizer."""
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(num_chars))


def request_bodies(route: str, vllm: bool, model: str, prompts: list[list[int]], output_len: int, seed: int) -> tuple[str, list[dict]]:
    """The path and the bodies of one run of `route`, on tandem's or vLLM's server."""
    common = {"max_tokens": output_len, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    if route == "generate":  # on vLLM its token-in route, as the orchestrator speaks it
        dialect = VllmDialect() if vllm else TandemDialect()
        return dialect.generate_path, [dialect.to_request({"prompt_token_ids": p, **common}) for p in prompts]
    if route == "completions":
        return "/v1/completions", [{"model": model, "prompt": p, "logprobs": 0, **common} for p in prompts]
    if route == "chat":
        rng = random.Random(seed)
        return "/v1/chat/completions", [{"model": model, "messages": [{"role": "user", "content": chat_text(rng, len(p))}],
                                          "logprobs": True, "top_logprobs": 0, **common} for p in prompts]
    raise ValueError(f"unknown route {route!r}; known: {', '.join(ROUTES)}")


def completion_length(route: str, answer: dict) -> int:
    """Output tokens of one answer, checked to carry one logprob per token (RL trains on them)."""
    choice = answer["choices"][0]
    if route == "generate":
        n, lps = len(choice["token_ids"]), choice["logprobs"]
        lps = lps["content"] if isinstance(lps, dict) else lps  # vLLM: OpenAI-style entries; tandem: floats
    elif route == "completions":
        n, lps = answer["usage"]["completion_tokens"], choice["logprobs"]["token_logprobs"]
    else:
        n, lps = answer["usage"]["completion_tokens"], choice["logprobs"]["content"]
    if len(lps) != n:
        raise RuntimeError(f"{route}: {len(lps)} logprobs for {n} output tokens")
    return n


async def send_all(url: str, path: str, bodies: list[dict]) -> tuple[list[dict], list[float]]:
    """Every request at once; the answers and each request's latency."""
    async def one(http: httpx.AsyncClient, body: dict) -> tuple[dict, float]:
        start = time.perf_counter()
        response = await http.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json(), time.perf_counter() - start

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        results = await asyncio.gather(*(one(http, b) for b in bodies))
    return [a for a, _ in results], [s for _, s in results]


def send_share(url: str, route: str, path: str, bodies: list[dict]) -> list[tuple[int, float]]:
    """One client process's share of a run (all its requests at once): each answer's output tokens and latency."""
    answers, latencies = asyncio.run(send_all(url, path, bodies))
    return [(completion_length(route, a), s) for a, s in zip(answers, latencies)]


def send_spread(clients: ProcessPoolExecutor, num_clients: int, url: str, route: str, path: str,
                bodies: list[dict]) -> tuple[list[int], list[float]]:
    """Every request at once, split over the client processes: one httpx client that holds 256 connections spends
    more CPU per request than the server (6 ms against 2.5 ms on this project's CPU machine), and would measure itself."""
    shares = [bodies[i::num_clients] for i in range(num_clients) if bodies[i::num_clients]]
    done = [f.result() for f in [clients.submit(send_share, url, route, path, share) for share in shares]]
    return [t for share in done for t, _ in share], [s for share in done for _, s in share]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process `pid` and its descendants have used so far (Linux's /proc).

    The server's CPU time per token is its overhead without the noise of a shared machine, which moves
    wall-clock times (a server that waits for the CPU loses time, not CPU seconds)."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            children = [int(c) for task in Path(f"/proc/{current}/task").iterdir()
                        for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        stack += children
    return total


def bench_route(clients: ProcessPoolExecutor, url: str, pid: int, route: str, vllm: bool, model: str, w: dict, vocab: int,
                args: argparse.Namespace) -> dict:
    """Best of `--repeats` runs of workload `w` on one route, after a small warmup run of the route."""
    warm_path, warm = request_bodies(route, vllm, model, prompts_for(dict(w, num_prompts=4), vocab, args.seed + 50), 4, args.seed)
    send_spread(clients, args.client_processes, url, route, warm_path, warm)
    runs = []
    for r in range(args.repeats):
        seed = args.seed + 1000 * (ROUTES.index(route) + 1) + r  # fresh prompts per run: no prefix-cache hits
        path, bodies = request_bodies(route, vllm, model, prompts_for(w, vocab, seed), w["output_len"], seed)
        start, cpu_start = time.perf_counter(), cpu_seconds(pid)
        lengths, latencies = send_spread(clients, args.client_processes, url, route, path, bodies)
        elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu_start
        tokens = sum(lengths)
        if tokens != w["output_len"] * len(bodies):
            raise RuntimeError(f"{route}: {tokens} output tokens, expected {w['output_len']} x {len(bodies)} (EOS not ignored?)")
        runs.append({"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed,
                     "server_cpu_ms_per_request": 1000 * cpu / len(bodies),
                     "latency_s": {"min": min(latencies), "p50": percentile(latencies, 0.5), "p90": percentile(latencies, 0.9),
                                   "p99": percentile(latencies, 0.99), "max": max(latencies)}})
    return max(runs, key=lambda r: r["output_tokens_per_s"])


# ---- servers -----------------------------------------------------------------------------------


def served_engine_config(args: argparse.Namespace, w: dict) -> EngineConfig:
    """The engine's settings, the same in this process and in the server: the workload's batch, and its
    context with room for the chat template."""
    return engine_config(args, w["num_prompts"], w["prompt_len"] + w["output_len"] + CHAT_TEMPLATE_ROOM)


def tandem_command(folder: Path, args: argparse.Namespace, w: dict, tmp: Path, port: int) -> tuple[list[str], dict]:
    """`tandem inference` as `tandem rl` starts it, in a process of its own: its argv and environment."""
    config = InferenceConfig.model_validate({
        "model": {"name": str(folder), "dtype": args.dtype}, "server": {"port": port},
        "engine": served_engine_config(args, w).model_dump()})
    (tmp / "inference.toml").write_text(to_toml(config))
    return [sys.executable, "-m", "tandem.cli", "inference", "@", str(tmp / "inference.toml")], dict(os.environ)


def vllm_available(site: str) -> str | None:
    """vLLM's version when it imports with `site` first on the path, else None."""
    probe = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], env=with_site(site),
                           capture_output=True, text=True)
    return probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 and probe.stdout.strip() else None


def vllm_command(folder: Path, args: argparse.Namespace, w: dict, tmp: Path, port: int) -> tuple[list[str], dict]:
    """vLLM's OpenAI server on the same folder, random weights, the same batch limits: its argv and environment."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", folder.name,
            "--load-format", "dummy", "--dtype", "bfloat16", "--seed", str(args.seed), "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", str(w["prompt_len"] + w["output_len"] + CHAT_TEMPLATE_ROOM),
            "--max-num-seqs", str(w["num_prompts"]), "--gpu-memory-utilization", "0.85"]
    return argv, dict(with_site(args.vllm_site), **DEV_MODE_ENV, VLLM_USE_FLASHINFER_SAMPLER="0")


@contextmanager
def started(name: str, command, folder: Path, args: argparse.Namespace, w: dict, tmp: Path, log: Path) -> Iterator[tuple[str, int]]:
    """The server that `command` describes, running and healthy; yields its URL and process id."""
    port = free_port()
    argv, env = command(folder, args, w, tmp, port)
    server = ManagedProcess(name, argv, log, env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server, timeout_s=START_TIMEOUT_S)
        yield url, server.pid
    finally:
        server.stop()


# ---- the run -----------------------------------------------------------------------------------


def bench_engine(folder: Path, args: argparse.Namespace, w: dict, vocab: int) -> dict:
    """Workload A through the engine in this process (the server's ceiling), best of `--repeats`."""
    engine = build_engine(ModelConfig(name=str(folder), dtype=args.dtype), served_engine_config(args, w), args.seed)
    run_engine(engine, prompts_for(w, vocab, args.seed), 1, w["output_len"])  # warmup: every batch size compiles
    runs = [run_engine(engine, prompts_for(w, vocab, args.seed + 100 + r), 1, w["output_len"]) for r in range(args.repeats)]
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    return {k: best[k] for k in ("output_tokens", "seconds", "output_tokens_per_s", "ttft_median_s")}


def bench_server(clients: ProcessPoolExecutor, name: str, command, folder: Path, args: argparse.Namespace, w: dict, vocab: int,
                 tmp: Path, logs: Path) -> dict:
    """Every route on one server; a route that fails is recorded and the others still run."""
    vllm = command is vllm_command
    with started(name, command, folder, args, w, tmp, logs / f"{name}.log") as (url, pid):
        # One whole untimed run first: every batch size the workload reaches compiles (kernels, graphs) here.
        path, bodies = request_bodies("generate", vllm, folder.name, prompts_for(w, vocab, args.seed + 60), w["output_len"], args.seed)
        send_spread(clients, args.client_processes, url, "generate", path, bodies)
        results: dict = {}
        for route in args.routes.split(","):
            attempt(results, route, lambda: bench_route(clients, url, pid, route, vllm, folder.name, w, vocab, args))
        return results


def ratios(results: dict, routes: list[str]) -> dict:
    rate = lambda part, route=None: (results.get(part, {}).get(route, {}) if route else results.get(part, {})).get("output_tokens_per_s")
    out = {}
    engine = rate("engine_A")
    for route in routes:
        tandem, vllm = rate("tandem_server", route), rate("vllm_server", route)
        if tandem and engine:
            out[f"tandem_{route}_over_engine"] = tandem / engine
        if tandem and vllm:
            out[f"tandem_{route}_over_vllm_{route}"] = tandem / vllm
    return out


def save(results: dict, out: str | None) -> None:
    """The figures so far, with their ratios: written after every part, so that a run cut short keeps what it measured."""
    results["ratios"] = ratios(results, results["routes"])
    if out:
        tmp = Path(out).with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(out)


def main() -> None:
    args = parse_args()
    # The client processes fork now, before this process starts threads or touches a GPU (they only speak HTTP).
    with ProcessPoolExecutor(args.client_processes, mp_context=multiprocessing.get_context("fork")) as clients:
        clients.submit(int).result()
        run(args, clients)


def run(args: argparse.Namespace, clients: ProcessPoolExecutor) -> None:
    """The engine in process, then each server in turn; the result file after each part."""
    device = resolve_device(args.device)
    w = scaled(args, "A")
    results: dict = {"workload": w, "environment": environment(device, args.commit), "routes": args.routes.split(","),
                     "client_processes": args.client_processes}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # The servers' logs: beside the result file when there is one (a failed start is read there).
        logs = (Path(args.out).parent / Path(args.out).stem) if args.out else tmp / "logs"
        folder = Path(args.model) if args.model else init_model(args.preset, tmp / args.preset, seed=args.seed)
        results["model"] = args.model or f"preset {args.preset}"
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        attempt(results, "engine_A", lambda: bench_engine(folder, args, w, vocab))
        save(results, args.out)
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()  # the engine is gone: its memory goes to the servers
        attempt(results, "tandem_server", lambda: bench_server(clients, "inference", tandem_command, folder, args, w, vocab, tmp, logs))
        save(results, args.out)
        if args.vllm_site:
            results["vllm"] = vllm_available(args.vllm_site)
            if results["vllm"]:
                attempt(results, "vllm_server", lambda: bench_server(clients, "vllm", vllm_command, folder, args, w, vocab, tmp, logs))
    save(results, args.out)
    print(json.dumps(results["ratios"], indent=1))


if __name__ == "__main__":
    main()
