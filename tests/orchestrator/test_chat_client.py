"""The token-keeping OpenAI-shaped client against a fake server over real HTTP."""

import asyncio

import pytest

from tandem.config.orchestrator import ClientConfig
from tandem.orchestrator.chat_client import TokenChatClient
from tandem.orchestrator.inference_pool import InferencePool
from tandem.orchestrator.samples import build_samples

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


def run(coro):
    return asyncio.run(coro)


async def with_client(url, tokenizer, body, seq_len=2048):
    pool = InferencePool(ClientConfig(base_urls=[url], max_retries=0))
    try:
        return await body(TokenChatClient(pool, tokenizer, 0, seq_len))
    finally:
        await pool.aclose()


def test_a_call_renders_the_chat_template_and_returns_tokens_logprobs_and_version(fake_servers, tokenizer):
    (backend, url), = fake_servers(respond=lambda prompt, rng: "olleh")
    backend.version = 3
    messages = [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "hello"}]

    async def body(client):
        return client, await client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0.5)

    client, response = run(with_client(url, tokenizer, body))
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    sent = backend.requests[0]
    assert sent["prompt_token_ids"] == expected and response.prompt_token_ids == expected
    assert sent["max_tokens"] == 20 and sent["temperature"] == 0.5
    choice = response.choices[0]
    assert choice.message.content == "olleh" and choice.message.tool_calls is None
    assert choice.finish_reason == "stop" and response.weight_version == 3 == choice.weight_version
    assert choice.token_ids == tokenizer.encode("olleh", add_special_tokens=False) + [backend.eos_id]
    assert [t.logprob for t in choice.logprobs.content] == [-0.25] * len(choice.token_ids)
    (turn,) = client.turns
    assert turn.prompt_ids == expected and turn.completion_ids == choice.token_ids
    assert turn.version == 3 and turn.temperature == 0.5


def test_the_next_turn_extends_the_exact_tokens_so_the_rollout_is_one_sample(fake_servers, tokenizer):
    (backend, url), = fake_servers(respond=lambda prompt, rng: "guess")
    conversation = [{"role": "user", "content": "start"}]

    async def body(client):
        for reply in ["warmer", "colder"]:
            response = await client.chat.completions.create(model="m", messages=conversation)
            conversation.append({"role": "assistant", "content": response.choices[0].message.content})
            conversation.append({"role": "user", "content": reply})
        return client

    client = run(with_client(url, tokenizer, body))
    first, second = client.turns
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == first.prompt_ids + first.completion_ids
    (sample,) = build_samples(client.turns)
    assert sample.num_loss_tokens == len(first.completion_ids) + len(second.completion_ids)


def test_each_turn_of_a_seeded_rollout_samples_with_its_own_seed(fake_servers, tokenizer):
    """One seed for every turn would replay the same random draws at each turn."""
    (backend, url), = fake_servers(respond=lambda prompt, rng: "guess")

    async def body(client):
        conversation = [{"role": "user", "content": "start"}]
        for _ in range(4):
            response = await client.chat.completions.create(model="m", messages=conversation, seed=7)
            conversation += [{"role": "assistant", "content": response.choices[0].message.content},
                             {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "start"}])  # unseeded

    for _ in range(2):
        run(with_client(url, tokenizer, body))
    seeds = [request.get("seed") for request in backend.requests]
    assert seeds[:5] == seeds[5:] and seeds[0] == 7 and len(set(seeds[:4])) == 4 and seeds[4] is None
    assert all(0 <= seed < 2**31 for seed in seeds[:4])


def test_hermes_tool_calls_become_openai_tool_calls_when_tools_are_offered(fake_servers, tokenizer):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    (backend, url), = fake_servers(respond=lambda prompt, rng: "Adding.\n" + call)
    messages = [{"role": "user", "content": "2+?"}]

    async def body(client):
        with_tools = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        without = await client.chat.completions.create(model="m", messages=messages)
        return with_tools, without

    with_tools, without = run(with_client(url, tokenizer, body))
    choice = with_tools.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.function.name == "add"
    assert tool_call.function.arguments == '{"a": 2}'
    assert "# Tools" in tokenizer.decode(backend.requests[0]["prompt_token_ids"])
    assert without.choices[0].message.tool_calls is None and call in without.choices[0].message.content


def test_turns_are_capped_to_fit_seq_len(fake_servers, tokenizer):
    (backend, url), = fake_servers(respond=lambda prompt, rng: "x" * 50)
    messages = [{"role": "user", "content": "hi"}]
    prompt_len = len(tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                      add_special_tokens=False))

    async def body(client):
        cut = await client.chat.completions.create(model="m", messages=messages, max_tokens=100)
        client.seq_len = prompt_len
        full = await client.chat.completions.create(model="m", messages=messages, max_tokens=100)
        return cut, full

    cut, full = run(with_client(url, tokenizer, body, seq_len=prompt_len + 10))
    assert backend.requests[0]["max_tokens"] == 10 and cut.choices[0].finish_reason == "length"
    assert len(backend.requests) == 1, "a conversation that fills seq_len is not sent"
    assert full.choices[0].finish_reason == "length" and full.choices[0].token_ids == []


def test_unsupported_arguments_are_named(fake_servers, tokenizer):
    (_, url), = fake_servers()

    async def body(client):
        with pytest.raises(TypeError, match=r"\['frequency_penalty'\]"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 frequency_penalty=0.5)
        with pytest.raises(ValueError, match="one choice per call"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=4)
        # verifiers-style arguments: n=1, extra_body, max_completion_tokens and response-shaping flags
        return await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=1,
                                                    extra_body={"top_k": 5}, max_completion_tokens=7, logprobs=True)

    response = run(with_client(url, tokenizer, body))
    assert response.choices[0].message.content == "x"


def test_a_tool_env_rollout_keeps_its_tool_turns_in_one_sample(fake_servers, tokenizer):
    from tandem.envs import ToolEnv

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    # The model writes its tool call exactly as the chat template renders one (as a model trained on
    # that template does): the assistant turn of a rendered conversation, minus the end-of-turn.
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me add.", "tool_calls": [call]}],
        tokenize=False)
    tool_turn = rendered.rsplit("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]

    def respond(prompt, rng):
        if "<tool_response>" not in prompt:
            return tool_turn
        return "The sum is " + prompt.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]

    (backend, url), = fake_servers(respond=respond)
    env = ToolEnv(tools=[add], dataset=[{"question": "2+3?", "answer": "5"}])

    async def body(client):
        return client, await env.rollout(client, "m", env.get_dataset()[0]["prompt"])

    client, (completion, state) = run(with_client(url, tokenizer, body))
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
    assert completion[1]["content"] == "5" and completion[2]["content"] == "The sum is 5"
    (sample,) = build_samples(client.turns)  # the re-rendered tool call reproduced the sampled tokens
    assert sample.num_loss_tokens == sum(len(t.completion_ids) for t in client.turns)
