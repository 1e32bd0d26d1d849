"""Health, model list and Prometheus metrics."""

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
