"""Every request field checked at the edge: finite, in range, a 400 whose `param` names the field (issue 24)."""

import json
import math

import httpx
import pytest
import torch
from inference_helpers import make_config

from tandem.inference.engine.sampling_params import MIN_TEMPERATURE
from tandem.inference.server import BackgroundServer
from tandem.models.hub import read_hf_config
from tandem.models.weights import load_state_dict, save_state_dict

GENERATE = {"prompt_token_ids": [4, 5, 6], "max_tokens": 4}


def strict_json(text: str):
    """JSON as the spec has it: NaN and Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in a response: {text[:200]}"))


def post_raw(server, path: str, raw: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=raw.encode(), headers={"content-type": "application/json"}, timeout=60, **kwargs)


def check_400(response: httpx.Response, param: str | None, message: str) -> None:
    assert response.status_code == 400, response.text
    error = strict_json(response.text)["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    assert message in error["message"], error["message"]


@pytest.mark.parametrize("field, literal, message", [
    ("temperature", "1e-39", f"`temperature`: must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100]"),
    ("temperature", "0.001", f"`temperature`: must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100]"),
    ("temperature", "1e300", "`temperature`: must be 0 (greedy) or in"),
    ("temperature", "NaN", "`temperature`: Input should be a finite number"),
    ("temperature", "Infinity", "`temperature`: Input should be a finite number"),
    ("temperature", "-Infinity", "`temperature`: Input should be a finite number"),
    ("top_p", "NaN", "`top_p`: Input should be a finite number"),
    ("top_p", "0", "`top_p`: Input should be greater than 0"),
    ("min_p", "Infinity", "`min_p`: Input should be a finite number"),
    ("seed", str(2**64), "`seed`: Input should be less than or equal to 9007199254740991"),
    ("max_tokens", "0", "`max_tokens`: Input should be greater than or equal to 1"),
    ("top_k", "-2", "`top_k`: Input should be greater than or equal to -1"),
    ("n", "2.5", "`n`: Input should be a valid integer"),
    ("stop_token_ids", "[-1]", "`stop_token_ids.0`: Input should be greater than or equal to 0"),
    ("stop", '[""]', "`stop.0`: String should have at least 1 character"),
])
def test_a_number_out_of_range_is_a_400_naming_the_field(server, field, literal, message):
    raw = json.dumps(GENERATE)[:-1] + f', "{field}": {literal}}}'
    check_400(post_raw(server, "/v1/generate", raw), field, message)


def test_the_smallest_temperature_gives_finite_logprobs_everywhere(server, tiny_dir):
    chat = {"model": str(tiny_dir), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": MIN_TEMPERATURE, "logprobs": True, "top_logprobs": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200, response.text
    content = strict_json(response.text)["choices"][0]["logprobs"]["content"]
    assert content and all(math.isfinite(e["logprob"]) for e in content)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: {")]
    assert events and all(strict_json(e) for e in events)
    generated = httpx.post(f"{server.url}/v1/generate", json={**GENERATE, "temperature": MIN_TEMPERATURE}, timeout=60).json()
    assert all(math.isfinite(lp) for lp in generated["choices"][0]["logprobs"])


def test_an_integral_float_is_an_integer(server):
    # JSON Schema (and so the OpenAPI document) calls 2.0 an integer; the server agrees.
    response = post_raw(server, "/v1/generate", json.dumps(GENERATE)[:-1] + ', "n": 2.0, "max_tokens": 3.0}')
    assert response.status_code == 200, response.text
    assert [len(c["token_ids"]) for c in response.json()["choices"]] in ([3, 3], [1, 3], [3, 1], [1, 1], [2, 3], [3, 2])


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/generate", {"prompt_token_ids": [1, 99999], "max_tokens": 3}, "prompt_token_ids", "prompt token ids must be in [0, 260)"),
    ("/v1/generate", {"prompt_token_ids": [], "max_tokens": 3}, "prompt_token_ids", "`prompt_token_ids`: List should have at least 1 item"),
    ("/v1/generate", {"prompt_token_ids": [1] * 1000, "max_tokens": 100}, "max_tokens", "maximum context length is 1024 tokens"),
    ("/v1/generate", {"prompt_token_ids": [1] * 1100}, "prompt_token_ids", "the prompt has 1100 tokens"),
    ("/v1/completions", {"model": "MODEL", "prompt": "x" * 1100}, "prompt", "the prompt has 1100 tokens"),
    ("/v1/completions", {"model": "MODEL", "prompt": []}, "prompt", "`prompt`: Input should be a valid string or List should have at least 1 item"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2000},
     "max_completion_tokens", "maximum context length is 1024 tokens"),
    ("/update_weights", {"path": ""}, "path", "`path`: String should have at least 1 character"),
])
def test_engine_checks_name_their_field(server, tiny_dir, path, body, param, message):
    if body.get("model") == "MODEL":
        body = {**body, "model": str(tiny_dir)}
    check_400(httpx.post(f"{server.url}{path}", json=body, timeout=60), param, message)


def test_an_empty_body_says_so(server):
    check_400(post_raw(server, "/v1/generate", ""), None, "the request body is empty: send a JSON object")


def test_weights_of_a_non_floating_dtype_are_refused(tmp_path, tiny_dir):
    running = BackgroundServer(make_config(tiny_dir))
    try:
        state = {name: torch.ones_like(t, dtype=torch.int64) for name, t in load_state_dict(tiny_dir).items()}
        save_state_dict(state, tmp_path / "ints", read_hf_config(tiny_dir))
        response = httpx.post(f"{running.url}/update_weights", json={"path": str(tmp_path / "ints")}, timeout=60)
        check_400(response, "path", "dtype mismatch for model.embed_tokens.weight: model float32, weights int64")
        assert running.served.weight_version == 0
    finally:
        running.stop()


def test_streamed_completions_give_every_choice_its_prompt_token_ids(server, tiny_dir):
    body = {"model": str(tiny_dir), "prompt": ["ab", "cde"], "n": 3, "max_tokens": 4, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    prompts: dict[int, list[list[int]]] = {}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if "prompt_token_ids" in choice:
                        prompts.setdefault(choice["index"], []).append(choice["prompt_token_ids"])
    assert prompts == {i: [[97, 98] if i < 3 else [99, 100, 101]] for i in range(6)}


def test_logprob_bytes_are_the_token_bytes(server, tiny_dir):
    body = {"model": str(tiny_dir), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3, "return_token_ids": True, "seed": 0}
    choice = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert any(t >= 128 for t in choice["token_ids"])  # the random model samples bytes that are no character alone
    for token_id, entry in zip(choice["token_ids"], entries):
        if token_id < 256:  # the byte tokenizer: ids 0-255 are the bytes
            assert entry["bytes"] == [token_id], (token_id, entry)


def local_address(response: httpx.Response) -> tuple:
    return response.extensions["network_stream"].get_extra_info("socket").getsockname()


def test_the_connection_survives_an_unexpected_error(tiny_dir, monkeypatch):
    running = BackgroundServer(make_config(tiny_dir))
    calls = []

    def fail_once(token_ids):
        calls.append(token_ids)
        raise RuntimeError("a bug")

    monkeypatch.setattr(running.served, "token_texts", fail_once)
    body = {"model": str(tiny_dir), "prompt": "ab", "max_tokens": 2, "logprobs": 0}
    try:
        with httpx.Client(base_url=running.url, timeout=60) as client:
            failed = client.post("/v1/completions", json=body)
            assert failed.status_code == 500 and "a bug" in strict_json(failed.text)["error"]["message"]
            for _ in range(3):  # the next requests go over the same keep-alive connection
                ok = client.get("/health")
                assert ok.status_code == 200 and local_address(ok) == local_address(failed)
        assert calls
    finally:
        running.stop()
