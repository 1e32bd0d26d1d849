"""Retries, backoff and failover of the HTTP pool."""

import asyncio
import time

import pytest
from fake_inference_server import free_port

from tandem.config.orchestrator import ClientConfig
from tandem.orchestrator.inference_pool import InferencePool, InferenceRequestError, InferenceUnavailableError

REQUEST = {"prompt_token_ids": [1, 2, 3], "n": 1, "max_tokens": 8}


async def call(pool_config, body):
    pool = InferencePool(pool_config)
    try:
        return pool, await body(pool)
    finally:
        await pool.aclose()


def test_5xx_is_retried_with_backoff_until_it_succeeds(fake_servers):
    (backend, url), = fake_servers()
    backend.fail_next = 2
    config = ClientConfig(base_urls=[url], max_retries=3, backoff_s=0.05)
    start = time.monotonic()
    pool, response = asyncio.run(call(config, lambda pool: pool.generate(REQUEST, 0)))
    assert response["choices"][0]["finish_reason"] == "stop"
    assert len(backend.requests) == 3 and pool.num_retries == 2
    assert time.monotonic() - start >= 0.05 + 0.1  # 0.05 s, then doubled


def test_retries_run_out_into_a_clear_error(fake_servers):
    (backend, url), = fake_servers()
    backend.fail_next = 10
    config = ClientConfig(base_urls=[url], max_retries=2, backoff_s=0.0)
    with pytest.raises(InferenceUnavailableError, match=r"failed 3 times; last: .*HTTP 503"):
        asyncio.run(call(config, lambda pool: pool.generate(REQUEST, 0)))


def test_4xx_is_not_retried(fake_servers):
    (backend, url), = fake_servers()
    backend.fail_next, backend.fail_status = 1, 400
    config = ClientConfig(base_urls=[url], max_retries=3, backoff_s=0.0)
    with pytest.raises(InferenceRequestError, match="HTTP 400: .*injected failure"):
        asyncio.run(call(config, lambda pool: pool.generate(REQUEST, 0)))
    assert len(backend.requests) == 1


def test_a_dead_server_fails_over_to_a_live_one(fake_servers):
    (backend, url), = fake_servers()
    dead = f"http://127.0.0.1:{free_port()}"
    config = ClientConfig(base_urls=[dead, url], max_retries=1, backoff_s=0.0)
    pool, response = asyncio.run(call(config, lambda pool: pool.generate(REQUEST, 0)))
    assert response["prompt_token_ids"] == [1, 2, 3] and pool.num_retries == 1


def test_update_weights_reaches_every_server(fake_servers):
    servers = fake_servers(2)
    config = ClientConfig(base_urls=[url for _, url in servers])
    asyncio.run(call(config, lambda pool: pool.update_weights("/w/step_3", 3)))
    assert [b.updates for b, _ in servers] == [[("/w/step_3", 3)]] * 2
    assert [b.version for b, _ in servers] == [3, 3]


def test_waiting_for_health_times_out_naming_the_server():
    dead = f"http://127.0.0.1:{free_port()}"
    config = ClientConfig(base_urls=[dead], health_timeout_s=0.3)
    with pytest.raises(InferenceUnavailableError, match=f"{dead} not healthy"):
        asyncio.run(call(config, lambda pool: pool.wait_healthy()))
