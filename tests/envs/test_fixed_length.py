import asyncio
from types import SimpleNamespace

import pytest

from tandem.envs import load_environment
from tandem.envs.fixed_length import even_token_reward


def response(token_ids: list[int], finish_reason: str = "length") -> SimpleNamespace:
    message = SimpleNamespace(role="assistant", content="x", tool_calls=None)
    return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason=finish_reason, token_ids=token_ids)])


def test_prompts_have_the_asked_length_and_are_seeded():
    env = load_environment("fixed_length", num_examples=20, prompt_chars=48, seed=1)
    questions = [e["prompt"][-1]["content"] for e in env.get_dataset()]
    assert len(questions) == 20 and {len(q) for q in questions} == {48}
    assert len(set(questions)) == 20
    again = load_environment("fixed-length", num_examples=20, prompt_chars=48, seed=1)
    assert [e["prompt"] for e in again.get_dataset()] == [e["prompt"] for e in env.get_dataset()]
    assert load_environment("fixed_length", num_examples=20, prompt_chars=48, seed=2).get_dataset() != env.get_dataset()


def test_rollouts_ask_to_ignore_eos_and_score_even_tokens():
    env = load_environment("fixed_length", num_examples=2)
    calls = []

    async def create(**kwargs):
        calls.append(kwargs)
        return response([2, 4, 5, 7])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    example = env.get_dataset()[0]

    async def rollout_and_score():
        completion, state = await env.rollout(client, "m", example["prompt"], sampling_args={"max_tokens": 4})
        return await env.rubric.score_rollout(example["prompt"], completion, "", state)

    score = asyncio.run(rollout_and_score())
    assert calls[0]["ignore_eos"] is True and calls[0]["max_tokens"] == 4
    assert score.reward == 0.5 and score.metrics == {"even_token_reward": 0.5}


def test_reward_without_tokens_is_zero():
    assert even_token_reward({"responses": []}) == 0.0
    assert even_token_reward({"responses": [response([])]}) == 0.0
    assert even_token_reward({"responses": [response([1, 3, 6])]}) == pytest.approx(1 / 3)


def test_bad_sizes_are_errors():
    with pytest.raises(ValueError, match="prompt_chars"):
        load_environment("fixed_length", prompt_chars=0)
