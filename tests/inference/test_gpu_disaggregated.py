"""The `shared_memory` KV transport on CUDA: a prefill and a decode server, processes of their own on one GPU, the
blocks through a CUDA IPC staging area, against one server (the prefill server answering itself).

The processes run with expandable segments, as `tandem rl` starts processes that share a GPU: the staging area
must still be a plain allocation another process opens by its IPC handle. A lone request runs the forwards one
server would (the prompt prefilled whole, then one sequence per decode step), so tokens and logprobs agree bit for
bit; the comparison allows fp32 rounding all the same, since kernels may pick other tilings in another process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

import httpx
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from local_servers import serving  # noqa: E402

from tandem.config.resolve import free_port  # noqa: E402
from tandem.launch.rl import SHARED_GPU_ALLOCATOR  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STAGING_MIB = 0.05
"""50 KiB, where a 300-token prompt's blocks of the tiny model take 304 KiB: each transfer crosses in pieces."""


@contextlib.contextmanager
def cuda_server(name: str, folder, tmp_path, *flags: str) -> Iterator[str]:
    """A `tandem inference` process of the tiny model in fp32 on the GPU (few sequences: few graphs to capture);
    yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(folder), "--server.port", str(port),
            "--engine.device", "cuda", "--model.dtype", "float32", "--engine.num-blocks", "256",
            "--engine.max-model-len", "1024", "--engine.max-num-batched-tokens", "512", "--engine.max-num-seqs", "4",
            "--seed", "0", *flags]
    with serving(name, argv, url, tmp_path / f"{name}.log", start_timeout_s=300, env=SHARED_GPU_ALLOCATOR):
        yield url


def generate(url: str, prompt: list[int], seed: int) -> dict:
    body = {"prompt_token_ids": prompt, "max_tokens": 16, "temperature": 1.0, "seed": seed, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]}


def test_a_pair_on_one_gpu_hands_prompts_over_through_cuda_ipc_and_matches_one_server(tiny_dir, tmp_path):
    """The prefill server serves the API as any server does: its own answers are one server's."""
    prompts = [[(11 * i + 5 * j) % 250 + 1 for j in range(300)] for i in range(3)]
    with cuda_server("prefill", tiny_dir, tmp_path, "--disaggregation.role", "prefill",
                     "--disaggregation.staging-mib", str(STAGING_MIB)) as prefill_url, \
            cuda_server("decode", tiny_dir, tmp_path, "--disaggregation.role", "decode",
                        "--disaggregation.prefill-urls", json.dumps([prefill_url]),
                        "--disaggregation.kv-transport", "shared_memory",
                        "--disaggregation.min-remote-prefill-tokens", "64") as decode_url:
        got = [generate(decode_url, prompt, seed) for seed, prompt in enumerate(prompts)]
        counts = httpx.get(f"{decode_url}/disaggregation/stats").json()
        want = [generate(prefill_url, prompt, seed) for seed, prompt in enumerate(prompts)]
    assert counts == {"num_prefills_handed": 3, "num_prefills_failed": 0, "num_prefilled_taken": 3,
                      "num_prefilled_refused": 0, "num_prefill_busy_answers": 0}
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    assert [lp for g in got for lp in g["logprobs"]] == pytest.approx([lp for w in want for lp in w["logprobs"]],
                                                                      abs=1e-5)
