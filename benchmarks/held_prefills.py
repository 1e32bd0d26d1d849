"""What a prefill server holds while long prompts arrive faster than its decode server takes them, on the CPU.
    python benchmarks/held_prefills.py --out benchmarks/results/held-prefills-cpu-<date>.json

A prefill and a decode server of the tiny model run in this process (`BackgroundServer`), the decode server taking
the blocks through `--kv-transport`; `--num-decoding` requests decode while a `--long-prompt-len` prompt arrives
every `--arrival-ms`, as in `disaggregated.py` (whose client bounds no number of long prompts in flight). Every
`--sample-ms` the prefill server's held prompts are counted: those `HeldPrefills` holds and their bytes, and the
exported tensors still alive anywhere (a weak reference to each one held), so that a tensor kept past its take
shows as alive and not held. Figures: the peaks and the last sample, after the run; the decode server's counts of
where its prompts were prefilled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
import weakref
from pathlib import Path

import httpx

from tandem.config.inference import InferenceConfig
from tandem.inference.server import BackgroundServer
from tandem.models.presets import init_model

ENGINE = {"device": "cpu", "block_size": 16, "max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def config(folder: Path, num_blocks: int, **disaggregation) -> InferenceConfig:
    return InferenceConfig.model_validate({"model": {"name": str(folder)}, "engine": {**ENGINE, "num_blocks": num_blocks},
                                           "disaggregation": disaggregation})


class ExportWatch:
    """The prefill server's held prompts, and every exported tensor it held that is still alive."""

    def __init__(self, held):
        self.held = held
        self.alive: set[int] = set()
        self.alive_bytes = 0
        put = held.put

        def watched_put(tensors):
            key, num_bytes = id(tensors[0]), sum(t.nbytes for t in tensors)
            self.alive.add(key)
            self.alive_bytes += num_bytes
            weakref.finalize(tensors[0], self._gone, key, num_bytes)
            return put(tensors)

        held.put = watched_put

    def _gone(self, key: int, num_bytes: int) -> None:
        self.alive.discard(key)
        self.alive_bytes -= num_bytes

    def sample(self) -> dict:
        entries = list(self.held._held.values())
        return {"held": len(entries), "held_bytes": sum(t.nbytes for _, ts in entries for t in ts),
                "alive": len(self.alive), "alive_bytes": self.alive_bytes}


async def workload(url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        decoding = [asyncio.create_task(http.post(f"{url}/v1/generate", json={
            "prompt_token_ids": [(i * 31 + j) % 250 + 1 for j in range(args.decode_prompt_len)],
            "max_tokens": args.output_len, "ignore_eos": True, "seed": i})) for i in range(args.num_decoding)]
        arrivals = []
        while not all(task.done() for task in decoding):
            long = [(len(arrivals) * 7919 + j * 104729) % 250 + 1 for j in range(args.long_prompt_len)]
            arrivals.append(asyncio.create_task(http.post(f"{url}/v1/generate", json={"prompt_token_ids": long,
                                                                                       "max_tokens": 1})))
            await asyncio.sleep(args.arrival_ms / 1000)
        responses = await asyncio.gather(*decoding, *arrivals)
    return {"num_long_prompts": len(arrivals), "num_ok": sum(r.status_code == 200 for r in responses)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-decoding", type=int, default=8)
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--long-prompt-len", type=int, default=1024)
    parser.add_argument("--arrival-ms", type=float, default=50.0)
    parser.add_argument("--long-in-flight", type=int, default=8, help="long prompts the prefill server's cache holds")
    parser.add_argument("--kv-transport", default="shared_memory")
    parser.add_argument("--staging-mib", type=float, default=512.0, help="`disaggregation.staging_mib`: small, a "
                        "transfer crosses in many pieces, each a round trip, and the decode server takes slower")
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_model("tiny", Path(tmp) / "tiny", seed=0)
        prefill_blocks = args.long_in_flight * -(-(args.long_prompt_len + 1) // 16)
        prefill = BackgroundServer(config(folder, prefill_blocks, role="prefill", staging_mib=args.staging_mib))
        decode = BackgroundServer(config(folder, 4096, role="decode", prefill_urls=[prefill.url],
                                         kv_transport=args.kv_transport, min_remote_prefill_tokens=512))
        watch = ExportWatch(prefill.server.config.app.state.held_prefills)
        samples, done = [], threading.Event()

        def sampler():
            start = time.perf_counter()
            while not done.is_set():
                samples.append({"t_s": round(time.perf_counter() - start, 3), **watch.sample()})
                time.sleep(args.sample_ms / 1000)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        try:
            run = asyncio.run(workload(decode.url, args))
            time.sleep(0.5)
            done.set()
            thread.join()
            run["stats"] = httpx.get(f"{decode.url}/disaggregation/stats").json()
        finally:
            decode.stop()
            prefill.stop()
    results = {"workload": {k: v for k, v in vars(args).items() if k != "out"}, **run,
               **{f"max_{key}": max(s[key] for s in samples) for key in ("held", "held_bytes", "alive", "alive_bytes")},
               "last": samples[-1], "samples": samples}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
