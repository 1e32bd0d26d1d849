"""Bad input: an OpenAI-style error with a 4xx status and a message naming the problem; the server keeps serving."""

import httpx
import pytest
import torch
from inference_helpers import make_config, teacher_forced_logprobs

from tandem.inference.server import BackgroundServer
from tandem.models.weights import load_state_dict, save_state_dict

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def check_error(response: httpx.Response, status: int, message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"], error["message"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status


def post(server, path: str, body=None, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": "ten"}, 400, "`max_tokens`: Input should be a valid integer (got \"ten\")"),
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": 3, "temprature": 0.5}, 400, "unknown field `temprature`"),
    ("/v1/generate", {"max_tokens": 3}, 400, "missing field `prompt_token_ids`"),
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": 0}, 400, "`max_tokens`: Input should be greater than or equal to 1 (got 0)"),
    ("/v1/generate", {"prompt_token_ids": [1] * 1000, "max_tokens": 100}, 400,
     "maximum context length is 1024 tokens. However, you requested 1100 tokens (1000 in the prompt, 100 in the completion)"),
    ("/v1/generate", {"prompt_token_ids": [1] * 1100}, 400, "the prompt has 1100 tokens, more than fit in the model's context of 1024"),
    ("/v1/generate", {"prompt_token_ids": [], "max_tokens": 3}, 400, "`prompt_token_ids`: List should have at least 1 item"),
    ("/v1/generate", {"prompt_token_ids": [1, 99999], "max_tokens": 3}, 400, "prompt token ids must be in [0, 260), got [99999]"),
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": 3, "top_p": 1.5}, 400, "`top_p`: Input should be less than or equal to 1 (got 1.5)"),
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": 3, "temperature": -1}, 400, "`temperature`: must be 0 (greedy) or in [0.01, 100] (got -1)"),
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": 3, "n": 0}, 400, "`n`: Input should be greater than or equal to 1"),
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": 3, "model": "nope"}, 404, "The model `nope` does not exist"),
    ("/v1/chat/completions", {"model": "nope", **CHAT}, 404, "The model `nope` does not exist"),
    ("/v1/chat/completions", {"model": "MODEL", **CHAT, "frequency_penalty": 0.5}, 400, "`frequency_penalty`: only 0.0 is supported by tandem's engine (got 0.5)"),
    ("/v1/chat/completions", {"model": "MODEL", **CHAT, "tool_choice": "required"}, 400, "`tool_choice`"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "robot", "content": "hi"}]}, 400, "`messages.0.role`"),
    ("/v1/chat/completions", {"model": "MODEL", **CHAT, "top_logprobs": 2}, 400, "`top_logprobs`: needs `logprobs: true` (got 2)"),
    ("/v1/chat/completions", {"model": "MODEL", **CHAT, "max_completion_tokens": 0}, 400, "`max_completion_tokens`: Input should be greater than or equal to 1"),
    ("/v1/chat/completions", {"model": "MODEL", **CHAT, "stream": True, "max_tokens": 5000}, 400, "maximum context length is 1024"),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "stop": 5}, 400, "`stop`: Input should be a valid string or Input should be a valid list"),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "echo": True}, 400, "`echo`: only False is supported by tandem's engine (got true)"),
    ("/update_weights", {"path": "/no/such/folder"}, 404, "weights folder not found: /no/such/folder"),
    ("/update_weights", {}, 400, "missing field `path`"),
])
def test_bad_request_is_a_4xx_naming_the_problem(server, tiny_dir, path, body, status, message):
    if body.get("model") == "MODEL":
        body = {**body, "model": str(tiny_dir)}
    check_error(post(server, path, body), status, message)


def test_malformed_json(server):
    check_error(post(server, "/v1/generate", content=b'{"prompt_token_ids": [1,', headers={"content-type": "application/json"}),
                400, "malformed JSON body")
    check_error(post(server, "/v1/generate", content=b"prompt=1", headers={"content-type": "application/x-www-form-urlencoded"}),
                400, "the request body must be a JSON object")


def test_failed_weight_updates_keep_the_previous_weights(server, tiny_dir, tiny_model, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    check_error(post(server, "/update_weights", {"path": str(empty)}), 404, "no .safetensors files")
    state = load_state_dict(tiny_dir)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 7)
    save_state_dict(state, tmp_path / "bad_shape", {"tie_word_embeddings": True})
    check_error(post(server, "/update_weights", {"path": str(tmp_path / "bad_shape")}), 400,
                "do not fit the model: shape mismatch for model.layers.0.mlp.up_proj.weight: model (384, 128), weights (7, 7)")
    state = load_state_dict(tiny_dir)
    del state["model.norm.weight"]
    save_state_dict(state, tmp_path / "missing", {"tie_word_embeddings": True})
    check_error(post(server, "/update_weights", {"path": str(tmp_path / "missing")}), 400, "missing ['model.norm.weight']")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file")
    check_error(post(server, "/update_weights", {"path": str(tmp_path / "corrupt")}), 400, "could not read weights from")
    # Still serving, on the original weights and version.
    body = post(server, "/v1/generate", {"prompt_token_ids": [4, 5, 6], "max_tokens": 20, "seed": 1}).json()
    assert body["weight_version"] == 0
    choice = body["choices"][0]
    expected = teacher_forced_logprobs(tiny_model, [4, 5, 6], choice["token_ids"], 1.0)
    assert torch.allclose(torch.tensor(choice["logprobs"]), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_a_failing_engine_step_fails_its_requests_and_the_server_goes_on(tiny_dir, overlap):
    running = BackgroundServer(make_config(tiny_dir))
    running.served.engine.engine.overlap = overlap
    runner = running.served.engine.engine.runner
    real_run, calls = runner.run, []

    def fail_once(batch, previous_tokens=None):
        calls.append(1)
        if len(calls) == 3:  # the third step: with overlap, the second is still in flight
            raise RuntimeError("kernel exploded")
        return real_run(batch, previous_tokens)

    runner.run = fail_once
    try:
        failing = {"prompt_token_ids": [1, 2], "max_tokens": 3, "ignore_eos": True}
        check_error(post(running, "/v1/generate", failing), 500, "the engine failed: kernel exploded")
        assert running.served.engine.engine.in_flight is None
        ok = post(running, "/v1/generate", {"prompt_token_ids": [1, 2], "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3
        assert running.served.engine.stats().kv_cache_usage == 0
    finally:
        running.stop()
