"""The official `openai` client against a running server: chat and completions, streamed or not, n=4."""

import openai
import pytest

from tandem.models.byte_tokenizer import build_byte_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model_with_its_context(client, tiny_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_dir)]
    assert models[0].max_model_len == 1024


def test_chat_n4_with_token_ids_and_logprobs(client, tiny_dir):
    response = client.chat.completions.create(
        model=str(tiny_dir), messages=MESSAGES, n=4, max_tokens=12, logprobs=True, top_logprobs=2, seed=1,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    tokenizer = build_byte_tokenizer()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert response.prompt_token_ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert response.weight_version == 0
    for choice in response.choices:
        assert choice.finish_reason in ("stop", "length") and choice.weight_version == 0
        assert len(choice.token_ids) == len(choice.logprobs.content) <= 12
        assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        assert choice.message.content == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(response.prompt_token_ids)
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in response.choices)
    assert len({tuple(c.token_ids) for c in response.choices}) > 1  # four samples, not one copied


def test_chat_stream_n4_matches_the_same_request_unstreamed(client, tiny_dir):
    args = dict(model=str(tiny_dir), messages=MESSAGES, n=4, max_tokens=12, seed=7)
    whole = client.chat.completions.create(**args)
    texts, reasons, usage = [""] * 4, [None] * 4, None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_n4_streamed_and_not(client, tiny_dir):
    args = dict(model=str(tiny_dir), prompt="Once upon a time", n=4, max_tokens=10, seed=3)
    whole = client.completions.create(**args, logprobs=1)
    assert len(whole.choices) == 4
    for choice in whole.choices:
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(logprobs.text_offset) <= 10
        assert all(lp <= 0 for lp in logprobs.token_logprobs) and len(logprobs.top_logprobs[0]) == 1
    texts = [""] * 4
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_completions_accept_token_id_prompts_and_batches(client, tiny_dir):
    response = client.completions.create(model=str(tiny_dir), prompt=[[1, 2, 3], [4, 5]], n=2,
                                         max_tokens=3, extra_body={"return_token_ids": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in response.choices] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]


def test_tools_are_rendered_by_the_chat_template(client, tiny_dir):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    response = client.chat.completions.create(model=str(tiny_dir), messages=MESSAGES, tools=[tool], max_tokens=2,
                                              extra_body={"return_token_ids": True})
    prompt = build_byte_tokenizer().decode(response.prompt_token_ids)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    without = client.chat.completions.create(model=str(tiny_dir), messages=MESSAGES, tools=[tool], tool_choice="none",
                                             max_tokens=2, extra_body={"return_token_ids": True})
    assert "get_weather" not in build_byte_tokenizer().decode(without.prompt_token_ids)


def test_the_folder_basename_names_the_model_too(client, tiny_dir):
    response = client.completions.create(model=tiny_dir.name, prompt="a", max_tokens=1)
    assert response.model == str(tiny_dir)


def test_bad_requests_raise_the_clients_errors(client, tiny_dir):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="`max_tokens`: Input should be greater than or equal to 1"):
        client.completions.create(model=str(tiny_dir), prompt="a", max_tokens=0)
