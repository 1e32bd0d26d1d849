"""Live weight updates: mid-flight, version bookkeeping, and what serves afterwards."""

import asyncio
import random
import time

import httpx
import pytest
import torch
from inference_helpers import make_config, teacher_forced_logprobs

from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm


@pytest.fixture(params=[False, True], ids=["read-each-step", "overlap"])
def fresh_server(tiny_dir, request):
    """A CPU server; with `overlap` its engine launches each step before reading the last, as on CUDA."""
    running = BackgroundServer(make_config(tiny_dir))
    running.served.engine.engine.overlap = request.param
    yield running
    running.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_update_in_the_middle_of_32_requests(fresh_server, tiny_model, tiny_other_dir):
    rng = random.Random(4)
    bodies = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(1, 50))], "max_tokens": 120,
               "seed": i, "ignore_eos": True} for i in range(32)]
    stats = fresh_server.served.engine.stats
    scheduler = fresh_server.served.engine.engine.scheduler

    def every_request_began() -> bool:
        """Each of the 32 sequences holds a token of version 0 (a count of tokens alone can come from fewer)."""
        running = list(scheduler.running)
        return len(running) == 32 and all(seq.oldest_weight_version == 0 for seq in running)

    async def scenario():
        async with httpx.AsyncClient(base_url=fresh_server.url, timeout=120) as http:
            in_flight = [asyncio.create_task(http.post("/v1/generate", json=b)) for b in bodies]
            while stats().num_generation_tokens < 32 * 5 or not every_request_began():
                await asyncio.sleep(0.005)
            update = await http.post("/update_weights", json={"path": str(tiny_other_dir)})
            unfinished = sum(not t.done() for t in in_flight)
            return update, unfinished, await asyncio.gather(*in_flight)

    update, unfinished, responses = asyncio.run(scenario())
    assert update.status_code == 200 and update.json() == {"weight_version": 1}
    assert unfinished > 0, "the update came too late to land mid-flight"
    for body, response in zip(bodies, responses):
        assert response.status_code == 200
        choice = response.json()["choices"][0]
        assert len(choice["token_ids"]) == 120 and choice["weight_version"] == 0
        # Tokens sampled before the update carry the old weights' logprobs.
        old = teacher_forced_logprobs(tiny_model, body["prompt_token_ids"], choice["token_ids"], 1.0)
        assert torch.allclose(torch.tensor(choice["logprobs"][:5]), old[:5], atol=1e-5, rtol=0)
    changed = sum(
        not torch.allclose(torch.tensor(r.json()["choices"][0]["logprobs"]),
                           teacher_forced_logprobs(tiny_model, b["prompt_token_ids"], r.json()["choices"][0]["token_ids"], 1.0),
                           atol=1e-3)
        for b, r in zip(bodies, responses))
    assert changed > 0  # tokens sampled after the update came from the new weights

    # Requests sent afterwards follow the new weights only.
    after = post(fresh_server, "/v1/generate", {"prompt_token_ids": [1, 2, 3], "max_tokens": 30, "seed": 0, "ignore_eos": True}).json()
    choice = after["choices"][0]
    assert after["weight_version"] == 1 and choice["weight_version"] == 1
    new_model = load_causal_lm(str(tiny_other_dir))
    new = teacher_forced_logprobs(new_model, [1, 2, 3], choice["token_ids"], 1.0)
    old = teacher_forced_logprobs(tiny_model, [1, 2, 3], choice["token_ids"], 1.0)
    assert torch.allclose(torch.tensor(choice["logprobs"]), new, atol=1e-5, rtol=0)
    assert (new - old).abs().max() > 0.1  # visibly different weights


def test_versions_default_to_the_next_and_follow_the_caller(fresh_server, tiny_dir, tiny_other_dir):
    assert post(fresh_server, "/update_weights", {"path": str(tiny_other_dir), "version": 5}).json() == {"weight_version": 5}
    assert post(fresh_server, "/update_weights", {"path": str(tiny_dir)}).json() == {"weight_version": 6}
    metrics = httpx.get(f"{fresh_server.url}/metrics").text
    assert f'tandem_weight_version{{model_name="{tiny_dir}"}} 6' in metrics


def test_pause_holds_new_requests_until_resume(fresh_server):
    assert post(fresh_server, "/pause", {}).json() == {"paused": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=fresh_server.url, timeout=60) as http:
            pending = asyncio.create_task(http.post("/v1/generate", json={"prompt_token_ids": [1], "max_tokens": 3}))
            await asyncio.sleep(0.3)
            held = not pending.done() and fresh_server.served.engine.stats().num_waiting == 1
            assert (await http.post("/resume")).json() == {"paused": False}
            return held, await pending

    held, response = asyncio.run(scenario())
    assert held and response.status_code == 200


def test_a_weight_update_lands_while_paused(fresh_server, tiny_other_dir):
    post(fresh_server, "/pause", {})
    start = time.monotonic()
    assert post(fresh_server, "/update_weights", {"path": str(tiny_other_dir)}).json() == {"weight_version": 1}
    assert time.monotonic() - start < 10
    post(fresh_server, "/resume", {})
    assert post(fresh_server, "/v1/generate", {"prompt_token_ids": [1], "max_tokens": 2}).json()["weight_version"] == 1
