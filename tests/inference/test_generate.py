"""`POST /v1/generate` over real HTTP: the contract, logprob parity, batch-invariant greedy decoding."""

import asyncio
import random

import httpx
import pytest
import torch
from inference_helpers import make_config, teacher_forced_logprobs

from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm


async def generate_all(url: str, bodies: list[dict]) -> list[dict]:
    """Send every request at once and wait for all answers."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        responses = await asyncio.gather(*(http.post("/v1/generate", json=b) for b in bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses if r.status_code != 200]
    return [r.json() for r in responses]


def test_response_follows_the_contract(server):
    body = httpx.post(f"{server.url}/v1/generate", json={"prompt_token_ids": [5, 6, 7], "n": 2, "max_tokens": 4, "seed": 0}).json()
    assert set(body) == {"id", "prompt_token_ids", "choices", "weight_version", "usage"}
    assert body["prompt_token_ids"] == [5, 6, 7] and body["weight_version"] == 0
    for i, choice in enumerate(body["choices"]):
        assert set(choice) == {"index", "token_ids", "logprobs", "text", "finish_reason", "weight_version"}
        assert choice["index"] == i and len(choice["token_ids"]) == len(choice["logprobs"]) == 4
        assert choice["finish_reason"] == "length" and choice["weight_version"] == 0
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}  # no drafts: no details


def test_logprobs_equal_a_teacher_forced_pass_for_concurrent_mixed_requests(server, tiny_model):
    rng = random.Random(1)
    bodies = []
    for i in range(24):
        bodies.append({
            "prompt_token_ids": [rng.randrange(256) for _ in range(rng.choice([1, 5, 17, 40, 120, 300]))],
            "n": 1 + i % 3, "max_tokens": rng.randint(1, 40), "temperature": [1.0, 0.6, 0.0, 1.4][i % 4],
            "top_p": [1.0, 0.9][i % 2], "top_k": [-1, 50, -1][i % 3], "seed": i, "ignore_eos": True,
        })
    responses = asyncio.run(generate_all(server.url, bodies))
    worst = 0.0
    for body, response in zip(bodies, responses):
        assert len(response["choices"]) == body["n"]
        for choice in response["choices"]:
            assert len(choice["token_ids"]) == body["max_tokens"]
            expected = teacher_forced_logprobs(tiny_model, body["prompt_token_ids"], choice["token_ids"], body["temperature"])
            worst = max(worst, (torch.tensor(choice["logprobs"]) - expected).abs().max().item())
    assert worst < 1e-5


@pytest.fixture(scope="module")
def sharp_server(sharp_dir):
    running = BackgroundServer(make_config(sharp_dir))
    yield running
    running.stop()


def test_greedy_output_is_the_same_alone_or_among_64_requests(sharp_server, sharp_dir):
    rng = random.Random(2)
    bodies = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(1, 200))], "max_tokens": 32,
               "temperature": 0.0, "ignore_eos": True} for _ in range(64)]
    together = [r["choices"][0]["token_ids"] for r in asyncio.run(generate_all(sharp_server.url, bodies))]
    for i in range(0, 64, 4):
        alone = asyncio.run(generate_all(sharp_server.url, [bodies[i]]))[0]["choices"][0]["token_ids"]
        assert alone == together[i], f"request {i} differs"
    assert len({tuple(t) for t in together}) == 64 and sum(len(set(t)) for t in together) > 64 * 16
    model = load_causal_lm(str(sharp_dir))
    for body, tokens in zip(bodies[:8], together[:8]):
        ids = torch.tensor([body["prompt_token_ids"] + tokens])
        with torch.no_grad():
            logits = model.lm_head(model(ids, torch.arange(ids.shape[1])[None]))[0]
        assert logits[len(body["prompt_token_ids"]) - 1:-1].argmax(-1).tolist() == tokens


def test_requests_wait_when_the_cache_is_short_and_all_finish(tiny_dir, tiny_model):
    # 16 blocks of 16 = 256 tokens for 8 requests of up to 160 tokens each: most wait, some get preempted.
    running = BackgroundServer(make_config(tiny_dir, num_blocks=16, max_model_len=256, max_num_batched_tokens=128))
    try:
        rng = random.Random(3)
        bodies = [{"prompt_token_ids": [rng.randrange(256) for _ in range(60)], "max_tokens": 100, "seed": i,
                   "ignore_eos": True} for i in range(8)]
        responses = asyncio.run(generate_all(running.url, bodies))
        for body, response in zip(bodies, responses):
            choice = response["choices"][0]
            expected = teacher_forced_logprobs(tiny_model, body["prompt_token_ids"], choice["token_ids"], 1.0)
            assert torch.allclose(torch.tensor(choice["logprobs"]), expected, atol=1e-5, rtol=0)
        assert running.served.engine.stats().num_preemptions > 0
    finally:
        running.stop()
