"""wiki_search, code_fix and swe through the orchestrator's client over HTTP: a fake server plays a
model that writes each SFT demonstration's assistant turns exactly as the chat template renders
them. The rollout must call the real tools, get the demonstration's replies, score 1, and keep
every turn in one token-exact sample: the demonstrations teach the very format RL rollouts
produce and parse."""

from __future__ import annotations

import pytest
from test_chat_client import run, with_client

from tandem.envs import code_fix, swe, wiki_search
from tandem.orchestrator.samples import build_samples

ENVS = {
    "wiki_search": (wiki_search, {"num_eval_examples": 10, "seed": 3}),
    "code_fix": (code_fix, {"num_eval_examples": 10, "seed": 3}),
    "swe": (swe, {"instance_ids": ["tkem__cachetools-462e8679", "PyCQA__pyflakes-e19886e5"], "num_eval_examples": 1}),
}


def rendered_assistant_turns(tokenizer, messages) -> list[str]:
    """Each assistant message's text as the template renders it, without its end-of-turn."""
    turns = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            turns.append(text.rsplit("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0])
    return turns


@pytest.mark.parametrize("name", sorted(ENVS))
def test_a_demonstration_replayed_over_http_calls_the_tools_and_scores_one(name, fake_servers, tokenizer):
    module, args = ENVS[name]
    env = module.load_environment(num_train_examples=1, **args)
    example = env.get_dataset()[0]
    (demonstration,) = module.sft_examples(1, **args)
    turns = rendered_assistant_turns(tokenizer, demonstration["messages"])

    def respond(prompt, rng):
        return turns[prompt.count("<|im_start|>assistant\n") - 1]

    (_, url), = fake_servers(respond=respond)

    async def body(client):
        return client, await env.run_rollout(client, "m", example)

    client, rollout = run(with_client(url, tokenizer, body, seq_len=8192))
    assert rollout.score.reward == 1.0, rollout.state.get("final_test_report")
    expected = demonstration["messages"][2:]
    assert [m["role"] for m in rollout.completion] == [m["role"] for m in expected]
    assert [m["content"] for m in rollout.completion if m["role"] == "tool"] == [
        m["content"] for m in expected if m["role"] == "tool"]
    calls = [m["tool_calls"][0]["function"] for m in rollout.completion if m.get("tool_calls")]
    assert calls == [m["tool_calls"][0]["function"] for m in expected if m.get("tool_calls")]
    assert rollout.score.metrics["num_tool_errors"] == 0.0
    (sample,) = build_samples(client.turns)
    assert sample.num_loss_tokens == sum(len(t.completion_ids) for t in client.turns)
