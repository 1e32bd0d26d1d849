"""What depends on the served model (its vocabulary, its context) and no JSON Schema can state: a request beyond
it is a 400 naming the field, and the OpenAPI document says so with the model's numbers."""

import httpx
import pytest

VOCAB_SIZE = 260
"""The tiny model's (`tests/inference/conftest.py`); its test server's context is 1024 (`inference_helpers.ENGINE`)."""


@pytest.mark.parametrize("path, body", [
    ("/v1/generate", {"prompt_token_ids": [1, 2]}),
    ("/v1/completions", {"prompt": [1, 2]}),
    ("/v1/completions", {"prompt": "hi", "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(server, tiny_dir, path, body):
    body = {**body, "model": str(tiny_dir), "max_tokens": 2}
    refused = httpx.post(f"{server.url}{path}", json={**body, "stop_token_ids": [3, VOCAB_SIZE]}, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == {"message": f"`stop_token_ids` must be in [0, {VOCAB_SIZE}), got [{VOCAB_SIZE}]",
                                       "type": "invalid_request_error", "param": "stop_token_ids", "code": 400}
    accepted = httpx.post(f"{server.url}{path}", json={**body, "stop_token_ids": [3, VOCAB_SIZE - 1]}, timeout=60)
    assert accepted.status_code == 200, accepted.text


def test_the_openapi_document_states_the_model_limits(server, tiny_dir):
    document = httpx.get(f"{server.url}/openapi.json").json()
    vocabulary = f"Each token id below {VOCAB_SIZE}, the vocabulary size of this server's model (else a 400)."
    context = ("Prompt tokens plus completion tokens (`max_tokens`) at most 1024, the context length of this server's "
               "model (else a 400).")
    assert f"Serves `{tiny_dir}`: a context of 1024 tokens" in document["info"]["description"]
    assert f"a vocabulary of {VOCAB_SIZE} token ids" in document["info"]["description"]
    schemas = document["components"]["schemas"]
    generate = schemas["GenerateRequest"]["properties"]
    assert generate["prompt_token_ids"]["description"] == f"{vocabulary} {context}"
    assert generate["stop_token_ids"]["anyOf"][0]["description"] == vocabulary
    assert generate["max_tokens"]["description"] == f"Unset: whatever context is left after the prompt. {context}"
    completion_prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    assert completion_prompt["description"].endswith(context)
    assert [member.get("description") for member in completion_prompt["anyOf"]] == [None, None, vocabulary, None]
    assert completion_prompt["anyOf"][3]["items"]["description"] == vocabulary
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["description"] == context and chat["max_completion_tokens"]["description"].endswith(context)
    assert "x-below-vocab-size" not in str(document) and "x-within-context" not in str(document)  # marks consumed
