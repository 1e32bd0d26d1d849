"""Health, model list and Prometheus metrics."""

import time

import httpx


def metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_health_and_models(server, tiny_dir):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(str(tiny_dir), 1024)]


def test_metrics_count_tokens_and_show_the_engine_state(server):
    before = httpx.get(f"{server.url}/metrics")
    assert before.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE tandem_generation_tokens_total counter" in before.text
    httpx.post(f"{server.url}/v1/generate", json={"prompt_token_ids": [1, 2, 3, 4], "n": 2, "max_tokens": 5, "ignore_eos": True})
    after = httpx.get(f"{server.url}/metrics").text
    assert metric(after, "tandem_generation_tokens_total") - metric(before.text, "tandem_generation_tokens_total") == 10
    assert metric(after, "tandem_prompt_tokens_total") - metric(before.text, "tandem_prompt_tokens_total") == 4
    for name in ("tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_ratio", "tandem_weight_version"):
        assert metric(after, name) == 0


def test_a_client_leaving_mid_stream_frees_its_sequences(server, tiny_dir):
    engine = server.served.engine
    before = engine.stats().num_generation_tokens
    body = {"model": str(tiny_dir), "prompt": "abc", "n": 8, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                break
    deadline = time.monotonic() + 60
    while engine.stats().num_running + engine.stats().num_waiting > 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # Left alone, the request would have run to 8 x 1000 tokens before the engine went idle.
    assert engine.stats().num_generation_tokens - before < 8 * 1000 / 2
    assert engine.stats().kv_cache_usage == 0
