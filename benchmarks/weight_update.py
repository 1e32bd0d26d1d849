"""Weight-update latency: from "the trainer holds the new weights" to "a server samples with them".

    python benchmarks/weight_update.py --preset tiny --device cpu                    # CPU: filesystem and gloo broadcast
    python benchmarks/weight_update.py --preset qwen3-0.6b --device cuda --out benchmarks/results/weight-update-h200-DATE.json
    PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/weight_update.py \
        --preset qwen3-0.6b --device cuda --parts filesystem,vllm --out $OUT/weight-update.json   # with vLLM

The server is `tandem inference` in its own process (as `tandem rl` runs it); this process plays
trainer rank 0 and the orchestrator, with the real code of both. The new weights start where the trainer's
publishing takes them from, in the published dtype: for a folder, where `gather_full_state` leaves them (whole,
on the CPU); for a broadcast, on the trainer end's device (the trainer sends from its GPU, a bucket at a
time). They alternate between two random sets so that every update changes every tensor. One update is timed
until a one-token request comes back with the new `weight_version`:
- `filesystem`: `write_weights_folder` (safetensors + `STABLE`), then `POST /update_weights {"path"}`;
- `broadcast`: `WeightBroadcaster.send` (announcement, then buckets over the group) while the
  orchestrator's `BroadcastPolicies.load` drives the server's weight-transfer routes. The group is
  formed once, before timing. On CUDA the trainer end takes its own GPU (NCCL runs one rank per
  GPU): it needs two visible GPUs and is recorded as skipped otherwise;
- part `vllm` (when vLLM is installed), to `tandem inference --backend vllm`, one server for both:
  `vllm_filesystem`, the same folder write, then vLLM's reload (`/pause?mode=keep`, `/collective_rpc
  reload_weights`, `/resume`: `tandem/orchestrator/server_dialect.py`), and `vllm_broadcast`, the broadcast
  through vLLM's NCCL engine (two GPUs). vLLM reports no weight version: its check is a greedy one-token
  probe whose token and logprob must be those the same weights gave in the untimed updates (the two weight
  sets give different ones, which is checked too).
Median and min over `--repeats` updates, after two untimed updates (one per weight set), and the MiB of weights moved per
second at the median: a fixed cost (HTTP calls, polling the announcement) plus size over bandwidth,
so a projection to a larger model from one small preset overstates its time; two presets separate them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from inference import attempt
from provenance import environment
from tandem.config.dump import to_toml
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import ClientConfig
from tandem.config.weight_transport import BroadcastWeightTransport
from tandem.inference.engine.setup import resolve_device
from tandem.launch.process import ManagedProcess
from tandem.config.resolve import free_port
from tandem.launch.rl import wait_healthy
from tandem.models.hub import read_hf_config
from tandem.models.presets import PRESETS, init_model
from tandem.models.weights import load_state_dict
from tandem.orchestrator.inference_pool import InferencePool
from tandem.orchestrator.policy_source import BroadcastPolicies, FolderPolicies
from tandem.trainer.broadcast_publish import WeightBroadcaster
from tandem.trainer.publish import published_dtype, write_weights_folder


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--device", default="auto", help="the server's device: auto, cpu, cuda")
    parser.add_argument("--parts", default="filesystem,broadcast,vllm", help="comma-separated parts to run")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per part")
    parser.add_argument("--bucket-mib", type=float, default=BroadcastWeightTransport().bucket_mib)
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD)")
    return parser.parse_args()


class Server:
    """`tandem inference` in a process of its own, on a free port."""

    def __init__(self, folder: Path, device: torch.device, tmp: Path, backend: str = "tandem"):
        self.port = free_port()
        config = InferenceConfig.model_validate({
            "backend": backend, "model": {"name": str(folder)}, "server": {"port": self.port},
            "engine": {"device": str(device), "max_num_seqs": 4, "max_model_len": 256, "cuda_graphs": False},
            # vLLM: no compile or graph capture (a quicker start; an update's latency does not depend on them).
            "vllm": {"extra_args": {"enforce_eager": True} if backend == "vllm" else {}}})
        (tmp / f"{backend}.toml").write_text(to_toml(config))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="0") if device.type == "cuda" else dict(os.environ)
        self.process = ManagedProcess("inference", [sys.executable, "-m", "tandem.cli", "inference", "@",
                                                    str(tmp / f"{backend}.toml")], tmp / f"{backend}.log", env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.backend = backend
        self.probes: dict[int, tuple[int, float]] = {}
        """vLLM: the probe's (token, logprob) per weight set (`_probe_matches`)."""
        wait_healthy(self.url, self.process, timeout_s=900)

    def samples_with(self, version: int) -> None:
        """One token; raise unless the new policy sampled it."""
        if self.backend == "vllm":
            return self._probe_matches(version)
        body = {"prompt_token_ids": [1, 2, 3], "max_tokens": 1, "temperature": 1.0, "seed": version}
        choice = httpx.post(f"{self.url}/v1/generate", json=body, timeout=600).json()["choices"][0]
        if choice["weight_version"] != version:
            raise RuntimeError(f"sampled with policy {choice['weight_version']}, expected {version}")

    def _probe_matches(self, version: int) -> None:
        """vLLM: the greedy token and its logprob must be those of weight set `version % 2` (recorded at the first
        updates, which must tell the two sets apart). Not detokenized: random weights sample ids past the
        byte tokenizer's."""
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "temperature": 0.0, "logprobs": 0,
                                                            "detokenize": False}}
        choice = httpx.post(f"{self.url}/inference/v1/generate", json=body, timeout=600).json()["choices"][0]
        probe = (choice["token_ids"][0], round(choice["logprobs"]["content"][0]["logprob"], 3))
        expected = self.probes.setdefault(version % 2, probe)
        if len(self.probes) == 2 and self.probes[0] == self.probes[1]:
            raise RuntimeError(f"both weight sets give the probe {probe}: it cannot tell them apart")
        if probe != expected:
            raise RuntimeError(f"probe {probe} after update {version}, expected {expected}: the new weights are not served")

    def stop(self) -> None:
        self.process.stop(grace=30)  # vLLM takes a few seconds to free its GPU


def timed_updates(update, check, states: list[dict], repeats: int) -> dict:
    """Seconds of each `update(version, state)` + `check(version)`, after two untimed updates (one per
    weight set), and the weight bytes moved per second at the median (to project other model sizes from)."""
    seconds = []
    for version in range(1, repeats + 3):
        start = time.perf_counter()
        update(version, states[version % 2])
        check(version)
        if version > 2:
            seconds.append(time.perf_counter() - start)
    mib = sum(t.numel() * t.element_size() for t in states[0].values()) / 2**20
    median = statistics.median(seconds)
    return {"median_s": median, "min_s": min(seconds), "mib_per_s_at_median": mib / median, "seconds": seconds}


def bench_filesystem(server: Server, folder: Path, states: list[dict], run_dir: Path, repeats: int) -> dict:
    hf_config = read_hf_config(folder)
    source = FolderPolicies(run_dir)

    def update(version: int, state: dict) -> None:
        write_weights_folder(run_dir, version, state, folder, hf_config)
        asyncio.run(_with_pool([server.url], server.backend, lambda pool: source.load(pool, version)))

    return timed_updates(update, server.samples_with, states, repeats)


def bench_broadcast(server: Server, states: list[dict], run_dir: Path, args: argparse.Namespace,
                    trainer_device: torch.device, backend: str) -> dict:
    config = BroadcastWeightTransport(port=free_port(), bucket_mib=args.bucket_mib, receiver=backend)
    source = BroadcastPolicies(run_dir, config)
    joined: list[WeightBroadcaster] = []
    trainer = threading.Thread(target=lambda: joined.append(WeightBroadcaster(run_dir, config, trainer_device)))
    trainer.start()
    asyncio.run(_with_pool([server.url], backend, source.setup))
    trainer.join()

    def update(version: int, state: dict) -> None:
        sending = threading.Thread(target=joined[0].send, args=(version, state))
        sending.start()
        while source.next_version(version - 1) != version:
            time.sleep(0.0005)
        asyncio.run(_with_pool([server.url], backend, lambda pool: source.load(pool, version)))
        sending.join()

    try:
        on_trainer = [{name: t.to(trainer_device) for name, t in state.items()} for state in states]
        return timed_updates(update, server.samples_with, on_trainer, args.repeats)
    finally:
        joined[0].close()


async def _with_pool(urls: list[str], backend: str, fn):
    pool = InferencePool(ClientConfig(base_urls=urls, backend=backend))
    try:
        return await fn(pool)
    finally:
        await pool.aclose()


def trainer_device_for(server_device: torch.device) -> torch.device | None:
    """The trainer end's device: the CPU beside a CPU server, a second GPU beside a CUDA one (None: none)."""
    if server_device.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", 1) if torch.cuda.device_count() > 1 else None


def run_part(results: dict, part: str, folder: Path, device: torch.device, tmp: Path, states: list[dict],
             args: argparse.Namespace) -> None:
    """Part `filesystem` or `broadcast` (tandem's server), or `vllm` (both transports, one vLLM server)."""
    backend = "vllm" if part == "vllm" else "tandem"
    names = {"filesystem": ["filesystem"], "broadcast": ["broadcast"], "vllm": ["vllm_filesystem", "vllm_broadcast"]}[part]
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        results.update({name: {"skipped": "vLLM is not installed"} for name in names})
        return
    trainer_device = trainer_device_for(device)
    if backend == "vllm" and device.type != "cuda":
        trainer_device = None  # vLLM's NCCL engine: CUDA only
    runnable = [n for n in names if n.endswith("filesystem") or trainer_device is not None]
    results.update({n: {"skipped": "broadcast needs the trainer end on a GPU of its own (NCCL: one rank per GPU; "
                                   "vLLM's engine: CUDA only)"} for n in names if n not in runnable})
    if not runnable:
        return
    server = Server(folder, device, tmp, backend)
    try:
        for name in runnable:
            run_dir = tmp / name
            if name.endswith("filesystem"):
                attempt(results, name, lambda: bench_filesystem(server, folder, states, run_dir, args.repeats))
            else:
                attempt(results, name, lambda: bench_broadcast(server, states, run_dir, args, trainer_device, backend))
    finally:
        server.stop()


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    results: dict = {"preset": args.preset, "environment": environment(device, args.commit), "repeats": args.repeats,
                     "bucket_mib": args.bucket_mib}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        folder = init_model(args.preset, tmp / "model", seed=0)
        dtype = torch.bfloat16 if device.type == "cuda" else published_dtype(json.loads((folder / "config.json").read_text()))
        states = [{k: v.to(dtype) for k, v in load_state_dict(init_model(args.preset, tmp / f"policy_{i}", seed=i + 1)).items()}
                  for i in range(2)]
        results["weights_mib"] = sum(t.numel() * t.element_size() for t in states[0].values()) / 2**20
        for part in args.parts.split(","):
            run_part(results, part, folder, device, tmp, states, args)
            if args.out:  # after each part: a run cut short (a server slow to stop) keeps what it measured
                Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "environment"}, indent=1, default=str))


if __name__ == "__main__":
    main()
