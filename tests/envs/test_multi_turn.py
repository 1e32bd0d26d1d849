import asyncio
from types import SimpleNamespace

import pytest

from tandem.envs import MultiTurnEnv, Rubric, SingleTurnEnv, StopReason, format_dataset

ROWS = [{"question": f"q{i}", "answer": str(i)} for i in range(10)]
ROWS_PROMPT = [{"role": "user", "content": "go"}]


class CountdownEnv(MultiTurnEnv):
    """Replies "again" until the model says "done"; async hooks, like newer verifiers."""

    async def setup_state(self, state, **kwargs):
        state["env_turns"] = 0
        return state

    async def is_completed(self, messages, state, **kwargs):
        return messages[-1]["role"] == "assistant" and messages[-1]["content"] == "done"

    async def env_response(self, messages, state, **kwargs):
        state["env_turns"] += 1
        return [{"role": "user", "content": "again"}], state


def test_single_turn_rollout_keeps_raw_responses_and_merges_sampling_args(scripted_client):
    env = SingleTurnEnv(dataset=ROWS, sampling_args={"temperature": 1.0, "max_tokens": 8})
    client = scripted_client(["hello"])
    prompt = env.get_dataset(1)[0]["prompt"]
    completion, state = asyncio.run(
        env.rollout(client, "m", prompt, answer="0", sampling_args={"max_tokens": 4})
    )
    assert completion == [{"role": "assistant", "content": "hello"}]
    assert state["stop_reason"] == StopReason.COMPLETED
    assert state["turn"] == 1
    assert [r.token_ids for r in state["responses"]] == [[1]]
    assert state["prompt"] == prompt and state["answer"] == "0" and state["task"] == "default"
    call = client.calls[0]
    assert call == {"model": "m", "messages": prompt, "temperature": 1.0, "max_tokens": 4}
    assert "tools" not in call


def test_multi_turn_stops_when_completed(scripted_client):
    env = CountdownEnv(dataset=ROWS, max_turns=5)
    client = scripted_client(["no", "no", "done"])
    completion, state = asyncio.run(env.rollout(client, "m", ROWS_PROMPT))
    assert [m["content"] for m in completion] == ["no", "again", "no", "again", "done"]
    assert state["completion"] is completion
    assert (state["turn"], state["env_turns"], state["stop_reason"]) == (3, 2, "completed")
    assert len(state["responses"]) == 3
    # each call saw the conversation as it was then, not as it grew afterwards
    assert [len(call["messages"]) for call in client.calls] == [1, 3, 5]


def test_multi_turn_stops_at_max_turns_without_a_last_env_reply(scripted_client):
    env = CountdownEnv(dataset=ROWS, max_turns=2)
    completion, state = asyncio.run(env.rollout(scripted_client(["no", "no"]), "m", ROWS_PROMPT))
    assert [m["content"] for m in completion] == ["no", "again", "no"]
    assert (state["turn"], state["stop_reason"]) == (2, StopReason.MAX_TURNS)


def test_multi_turn_stops_on_a_truncated_answer(scripted_client):
    env = CountdownEnv(dataset=ROWS, max_turns=5)
    client = scripted_client(["no", {"content": "don", "finish_reason": "length"}])
    completion, state = asyncio.run(env.rollout(client, "m", ROWS_PROMPT))
    assert completion[-1]["content"] == "don"
    assert (state["turn"], state["stop_reason"]) == (2, StopReason.LENGTH)


def test_rollout_does_not_mutate_the_dataset(scripted_client):
    env = CountdownEnv(dataset=ROWS, max_turns=3)
    example = env.get_dataset(1)[0]
    before = [dict(m) for m in example["prompt"]]
    asyncio.run(env.rollout(scripted_client(["no", "done"]), "m", example["prompt"]))
    assert example["prompt"] == before


def test_max_turns_must_be_positive():
    with pytest.raises(ValueError, match="max_turns"):
        CountdownEnv(max_turns=0)


def test_format_dataset_builds_prompts():
    few_shot = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    examples = format_dataset(ROWS[:1], system_prompt="be brief", few_shot=few_shot)
    assert examples == [
        {
            "prompt": [
                {"role": "system", "content": "be brief"},
                *few_shot,
                {"role": "user", "content": "q0"},
            ],
            "answer": "0",
            "task": "default",
            "info": {},
        }
    ]
    ready = {"prompt": [{"role": "user", "content": "x"}], "task": "t", "info": {"a": 1}}
    assert format_dataset([ready], system_prompt="ignored")[0]["prompt"] == ready["prompt"]
    with pytest.raises(ValueError, match="'prompt' or a 'question'"):
        format_dataset([{"answer": "1"}])


def test_hf_style_datasets_are_read_through_to_list():
    class FakeHFDataset:
        def to_list(self):
            return ROWS[:2]

    env = SingleTurnEnv(dataset=FakeHFDataset())
    assert [e["answer"] for e in env.get_dataset()] == ["0", "1"]


def test_get_dataset_sizes_and_seeds():
    env = SingleTurnEnv(dataset=ROWS)
    assert len(env.get_dataset()) == 10 and len(env.get_dataset(3)) == 3
    assert env.get_dataset(5, seed=1) == env.get_dataset(5, seed=1)
    assert env.get_dataset(seed=1) != env.get_dataset()
    assert sorted(e["answer"] for e in env.get_dataset(seed=1)) == [r["answer"] for r in ROWS]
    assert env.get_eval_dataset(2) == env.get_dataset(2)  # no eval set: the train set stands in
    with pytest.raises(ValueError, match="no training dataset"):
        SingleTurnEnv(eval_dataset=ROWS).get_dataset()


class SlowEchoClient:
    """Answers "qN" with "N" after yielding to the event loop; tracks calls in flight."""

    def __init__(self):
        self.in_flight = self.max_in_flight = 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, model, messages, **kwargs):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        message = SimpleNamespace(content=messages[-1]["content"][1:], tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")])


def test_evaluate_scores_every_rollout_within_max_concurrent():
    def exact(completion, answer):
        return float(completion[-1]["content"] == answer)

    env = SingleTurnEnv(eval_dataset=ROWS[:3], rubric=Rubric([exact]), max_concurrent=2)
    client = SlowEchoClient()
    results = asyncio.run(env.evaluate(client, "m", rollouts_per_example=2))
    assert [r.state["answer"] for r in results] == ["0", "0", "1", "1", "2", "2"]
    assert [r.score.reward for r in results] == [1.0] * 6
    assert client.max_in_flight == 2
