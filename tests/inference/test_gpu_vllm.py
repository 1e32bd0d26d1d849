"""`tandem inference --backend vllm` against a real vLLM 0.26 on one GPU (skips without CUDA or vLLM).

One server for the module: the tiny preset's random weights (`tandem model init`), started the way
`tandem rl` starts it. Through tandem's own client parts (the pool and its vLLM dialect) and vLLM's
OpenAI routes: chat and completions with token ids and logprobs, token-in generation with the
logprobs tandem's trainer computes, a folder update as the trainer publishes one, and a pause that
keeps in-flight requests. On one GPU the NCCL weight transfer is skipped: NCCL refuses two ranks
of one communicator on one device ("Duplicate GPU detected"), and vLLM's `PyNcclCommunicator` asks
each rank to bind its own device (`vllm/distributed/device_communicators/pynccl.py`); vLLM's
same-GPU transport is its CUDA-IPC engine, which tandem does not drive.

    PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python -m pytest -s tests/inference/test_gpu_vllm.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from inference_helpers import teacher_forced_logprobs
from transformers import AutoTokenizer

from tandem.config.dump import to_toml
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import ClientConfig
from tandem.config.resolve import free_port
from tandem.launch.process import ManagedProcess
from tandem.launch.rl import wait_healthy
from tandem.models.chat import render_chat
from tandem.models.hub import read_hf_config
from tandem.models.loading import build_native, load_causal_lm
from tandem.models.lora import LoraSpec, apply_lora, export_merged, initial_adapters, write_adapter_folder
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict
from tandem.orchestrator.inference_pool import InferencePool
from tandem.trainer.publish import write_weights_folder

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.26 (importable)"),
]

LORA = {"enabled": True, "rank": 8, "alpha": 16.0}
PROMPT = [258, 104, 105, 33, 257, 10]
"""Byte-tokenizer ids: a short ChatML-like prompt (any ids below the vocabulary would do)."""


class Served:
    def __init__(self, tmp: Path, lora: dict | None = None, quantization: str = "none"):
        self.model = init_model("tiny", tmp / "model", seed=0)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = InferenceConfig.model_validate({
            "backend": "vllm", "model": {"name": str(self.model)}, "server": {"port": self.port},
            "engine": {"memory_fraction": 0.3, "max_model_len": 1024, "max_num_seqs": 32, "lora": lora or {},
                       "quantization": quantization},
            "vllm": {"extra_args": {"enforce_eager": True}}})  # no compile or graph capture: a quicker start
        (tmp / "inference.toml").write_text(to_toml(config))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
        self.process = ManagedProcess("inference", [sys.executable, "-m", "tandem.cli", "inference", "@",
                                                    str(tmp / "inference.toml")], tmp / "inference.log", env)
        self.run_dir = tmp / "run"

    def publish(self, step: int, seed: int) -> str:
        """Policy `step` as the trainer publishes it: new random weights of the same model, in `weights/step_N`."""
        state = load_state_dict(init_model("tiny", self.run_dir / f"source_{seed}", seed=seed))
        return str(write_weights_folder(self.run_dir, step, state, self.model, read_hf_config(self.model)).resolve())


def serving(tmp: Path, lora: dict | None = None, quantization: str = "none"):
    """A fixture's body: the server up until the module's tests are done, then stopped, with its last lines."""
    served = Served(tmp, lora, quantization)
    try:
        wait_healthy(served.url, served.process, timeout_s=600)
        yield served
    finally:
        served.process.stop(grace=30)
        print(f"\n--- last lines of {served.process.log_path}:\n" + "\n".join(served.process.tail(40)))


def pool_call(served: Served, fn):
    async def run():
        pool = InferencePool(ClientConfig(base_urls=[served.url], backend="vllm", timeout_s=300), str(served.model))
        try:
            return await fn(pool)
        finally:
            await pool.aclose()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="module")
def served_lora(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("vllm-lora"), LORA)


@pytest.fixture(scope="module")
def served_fp8(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("vllm-fp8"), quantization="fp8")


def greedy(pool: InferencePool, max_tokens: int = 12):
    return pool.generate({"prompt_token_ids": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                          "n": 1}, 0)


def test_chat_and_completions_carry_token_ids_and_logprobs(served):
    """vLLM's OpenAI routes with `return_token_ids`: the chat prompt is the one tandem's orchestrator renders."""
    name, messages = str(served.model), [{"role": "user", "content": "abc"}]
    chat = httpx.post(f"{served.url}/v1/chat/completions", timeout=120, json={
        "model": name, "messages": messages, "max_tokens": 8, "logprobs": True, "return_token_ids": True,
        "ignore_eos": True}).json()
    choice = chat["choices"][0]
    assert chat["prompt_token_ids"] == render_chat(AutoTokenizer.from_pretrained(name), messages)
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == 8
    assert all(entry["logprob"] <= 0 for entry in choice["logprobs"]["content"])
    completion = httpx.post(f"{served.url}/v1/completions", timeout=120, json={
        "model": name, "prompt": PROMPT, "max_tokens": 8, "logprobs": 0, "return_token_ids": True,
        "ignore_eos": True, "temperature": 0.0}).json()["choices"][0]
    assert completion["prompt_token_ids"] == PROMPT and len(completion["token_ids"]) == 8
    assert len(completion["logprobs"]["token_logprobs"]) == 8


def test_generate_through_the_pool_reports_the_trainers_logprobs(served):
    """vLLM's token-in route through the dialect: greedy equals /v1/completions, and the logprobs at T = 0.5 are
    log_softmax(logits / T) of tandem's own model (what the trainer computes), not vLLM's default raw logprobs."""
    answer = pool_call(served, lambda pool: greedy(pool, 8))["choices"][0]
    completion = httpx.post(f"{served.url}/v1/completions", timeout=120, json={
        "model": str(served.model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True,
        "ignore_eos": True}).json()["choices"][0]
    assert answer["token_ids"] == completion["token_ids"] and answer["weight_version"] == 0
    temperature = 0.5
    tempered = pool_call(served, lambda pool: pool.generate({"prompt_token_ids": PROMPT, "max_tokens": 16, "seed": 3,
                                                             "temperature": temperature, "ignore_eos": True, "n": 1}, 0))
    tokens, logprobs = tempered["choices"][0]["token_ids"], torch.tensor(tempered["choices"][0]["logprobs"])
    model = load_causal_lm(str(served.model), device="cuda", dtype="bfloat16")
    tempered_error, raw_error = ((teacher_forced_logprobs(model, PROMPT, tokens, t, device="cuda") - logprobs).abs().max().item()
                                 for t in (temperature, 1.0))
    print(f"\nlogprobs at T = {temperature}: max error {tempered_error:.4f} against log_softmax(logits / T), "
          f"{raw_error:.4f} against log_softmax(logits)")
    assert tempered_error < 0.1 and tempered_error < raw_error


def test_a_published_folder_changes_what_the_server_samples(served):
    before = pool_call(served, greedy)["choices"][0]
    step_1 = served.publish(1, seed=11)

    async def update_and_sample(pool):
        start = time.perf_counter()
        await pool.update_weights(step_1, 1)
        seconds = time.perf_counter() - start
        return seconds, await greedy(pool), pool.versions

    seconds, after, versions = pool_call(served, update_and_sample)
    print(f"\nvLLM folder update of the tiny model: {seconds:.3f} s")
    assert versions == [1] and after["choices"][0]["weight_version"] == 1
    assert (after["choices"][0]["token_ids"], after["choices"][0]["logprobs"]) != (before["token_ids"], before["logprobs"])
    step_2 = served.publish(2, seed=0)  # the starting weights again: sampling must come back exactly

    async def revert_and_sample(pool):
        await pool.update_weights(step_2, 2)
        return await greedy(pool)

    again = pool_call(served, revert_and_sample)["choices"][0]
    assert again["token_ids"] == before["token_ids"]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(again["logprobs"], before["logprobs"]))


def test_an_update_keeps_in_flight_requests(served):
    """Requests running when an update pauses the server (`/pause?mode=keep`) finish in full afterwards."""
    step_3 = served.publish(3, seed=12)

    async def run(pool):
        long = {"prompt_token_ids": PROMPT, "max_tokens": 800, "temperature": 1.0, "ignore_eos": True, "n": 1}
        requests = [asyncio.create_task(pool.generate(dict(long, seed=i), 0)) for i in range(8)]
        await asyncio.sleep(0.3)
        assert not any(r.done() for r in requests), "the requests ended before the update: lengthen them"
        await pool.update_weights(step_3, 3)
        return await asyncio.gather(*requests), pool.versions

    answers, versions = pool_call(served, run)
    assert all(len(a["choices"][0]["token_ids"]) == 800 and a["choices"][0]["finish_reason"] == "length" for a in answers)
    # Sent while this (new) pool knew the server at version 0: the older of the two versions is recorded.
    assert versions == [3] and all(a["choices"][0]["weight_version"] == 0 for a in answers)


def test_a_paused_server_queues_requests_until_resumed(served):
    assert httpx.post(f"{served.url}/pause?mode=keep", timeout=60).json() == {"status": "paused"}
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(pool_call(served, greedy)))
    thread.start()
    thread.join(timeout=2.0)
    assert not answer, "a request was served while paused"
    assert httpx.post(f"{served.url}/resume", timeout=60).json() == {"status": "resumed"}
    thread.join(timeout=60)
    assert answer and len(answer[0]["choices"][0]["token_ids"]) > 0


def test_a_lora_policy_is_served_as_a_vllm_adapter_beside_its_base(served_lora, tmp_path):
    """A LoRA run on vLLM: the policy (an adapter named as the model) starts as the base; a published adapter
    folder replaces it in place, and vLLM then samples with the logprobs of tandem's merged model, while the base
    keeps its own name and answers."""
    base_name = f"{served_lora.model}-base"

    def base_greedy():
        body = {"model": base_name, "token_ids": PROMPT, "sampling_params": {"max_tokens": 12, "temperature": 0.0,
                                                                             "ignore_eos": True, "logprobs": 0}}
        return httpx.post(f"{served_lora.url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]

    start, base = pool_call(served_lora, greedy)["choices"][0], base_greedy()
    assert start["token_ids"] == base["token_ids"]  # B = 0: the policy starts as the base
    spec = LoraSpec(LORA["rank"], LORA["alpha"], tuple(InferenceConfig().engine.lora.target_modules))
    model = build_native(read_hf_config(served_lora.model))
    apply_lora(model, spec, "test")
    generator = torch.Generator().manual_seed(5)
    adapters = {name: torch.randn(t.shape, generator=generator) * (0.1 if name.endswith("lora_B.weight") else 1.0)
                for name, t in initial_adapters(model, 0).items()}
    folder = tmp_path / "weights" / "step_1"
    write_adapter_folder(folder, adapters, spec, str(served_lora.model))
    temperature = 0.5

    async def update_and_sample(pool):
        await pool.update_weights(str(folder), 1)
        return await pool.generate({"prompt_token_ids": PROMPT, "max_tokens": 16, "seed": 3, "temperature": temperature,
                                    "ignore_eos": True, "n": 1}, 0), await greedy(pool), pool.versions

    tempered, after, versions = pool_call(served_lora, update_and_sample)
    assert versions == [1] and after["choices"][0]["token_ids"] != start["token_ids"]
    assert base_greedy()["token_ids"] == base["token_ids"]  # the base is untouched by the adapter
    tokens, logprobs = tempered["choices"][0]["token_ids"], torch.tensor(tempered["choices"][0]["logprobs"])
    merged = load_causal_lm(str(export_merged(folder, tmp_path / "merged", str(served_lora.model))), device="cuda",
                            dtype="bfloat16")
    plain = load_causal_lm(str(served_lora.model), device="cuda", dtype="bfloat16")
    merged_error, base_error = ((teacher_forced_logprobs(m, PROMPT, tokens, temperature, device="cuda") - logprobs).abs().max().item()
                                for m in (merged, plain))
    print(f"\nvLLM LoRA logprobs: max error {merged_error:.4f} against tandem's merged model, {base_error:.4f} against the base")
    assert merged_error < 0.1 and merged_error < base_error


def test_fp8_rollouts_on_vllm_sample_with_the_logprobs_of_tandems_fp8_model(served_fp8):
    """`engine.quantization = "fp8"` on vLLM (`--quantization fp8_per_block`, the bf16 tiny model quantized on load):
    its logprobs are those of tandem's own FP8 model (the same 128 x 128 weight blocks, activations per token and
    128 columns), closer than to the bf16 model's."""
    temperature = 0.5
    tempered = pool_call(served_fp8, lambda pool: pool.generate({"prompt_token_ids": PROMPT, "max_tokens": 16, "seed": 3,
                                                                 "temperature": temperature, "ignore_eos": True, "n": 1}, 0))
    tokens, logprobs = tempered["choices"][0]["token_ids"], torch.tensor(tempered["choices"][0]["logprobs"])
    name = str(served_fp8.model)
    fp8, bf16 = (load_causal_lm(name, device="cuda", dtype="bfloat16", quantization=q) for q in ("fp8", "none"))
    fp8_error, bf16_error = ((teacher_forced_logprobs(m, PROMPT, tokens, temperature, device="cuda") - logprobs).abs().mean().item()
                             for m in (fp8, bf16))
    print(f"\nvLLM FP8 logprobs: mean error {fp8_error:.4f} against tandem's FP8 model, {bf16_error:.4f} against bf16")
    assert fp8_error < 0.05 and fp8_error < bf16_error
