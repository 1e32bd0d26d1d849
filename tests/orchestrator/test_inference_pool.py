"""Retries, backoff and failover of the HTTP pool."""

import asyncio
import time

import pytest

from tandem.config.orchestrator import ClientConfig
from tandem.config.resolve import free_port
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


def test_a_server_that_misses_a_weight_update_gets_no_requests_until_readmitted(fake_servers):
    (backend, url), = fake_servers()
    dead = f"http://127.0.0.1:{free_port()}"
    config = ClientConfig(base_urls=[dead, url], max_retries=1, backoff_s=0.0)

    async def body(pool):
        await pool.update_weights("/w/step_1", 1)
        excluded_after_update = set(pool.excluded)
        retries_before = pool.num_retries
        await pool.generate(REQUEST, 0)  # asks for the dead server first
        no_retry = pool.num_retries == retries_before
        await pool.readmit("/w/step_1", 1)  # still dead
        still_excluded = set(pool.excluded)
        pool.base_urls[0] = url  # "restarted": the same server answers there now
        await pool.readmit("/w/step_1", 1)
        return excluded_after_update, no_retry, still_excluded, set(pool.excluded)

    _, (after_update, no_retry, still_excluded, after_readmit) = asyncio.run(call(config, body))
    assert after_update == {0} and no_retry and still_excluded == {0} and after_readmit == set()
    assert backend.updates == [("/w/step_1", 1), ("/w/step_1", 1)]


def test_a_weight_update_that_reaches_no_server_raises():
    config = ClientConfig(base_urls=[f"http://127.0.0.1:{free_port()}"], max_retries=0)
    with pytest.raises(InferenceUnavailableError, match="no server loaded policy 2"):
        asyncio.run(call(config, lambda pool: pool.update_weights("/w/step_2", 2)))


def test_broadcast_updates_set_aside_a_missing_server_and_readmit_it_when_it_takes_one(fake_servers):
    (backend, url), = fake_servers()
    dead = f"http://127.0.0.1:{free_port()}"
    config = ClientConfig(base_urls=[dead, url], backoff_s=0.0)

    async def body(pool):
        await pool.broadcast_update({"names": []}, 4)
        excluded = set(pool.excluded)
        pool.base_urls[0] = url  # "restarted": it takes part in the next update
        await pool.broadcast_update({"names": []}, 5)
        return excluded, set(pool.excluded), list(pool.versions)

    _, (excluded, readmitted, versions) = asyncio.run(call(config, body))
    assert excluded == {0} and readmitted == set() and versions == [5, 5]
    assert backend.transfer_calls[:5] == ["pause", "start_weight_update", "update_weights", "finish 4", "resume"]


def test_a_broadcast_update_that_reaches_no_server_raises():
    config = ClientConfig(base_urls=[f"http://127.0.0.1:{free_port()}"] * 2)
    with pytest.raises(InferenceUnavailableError, match="no server loaded policy 2"):
        asyncio.run(call(config, lambda pool: pool.broadcast_update({"names": []}, 2)))
