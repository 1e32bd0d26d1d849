"""A real `verifiers` SingleTurnEnv (inline dataset) through the orchestrator (the [verifiers] extra)."""

from __future__ import annotations

import asyncio

import pytest
from test_orchestrator_run import make_config, run, samples_of

from tandem.orchestrator.environments import LoadedEnv, adapt_env
from tandem.orchestrator.verifiers_env import VerifiersEnv

vf = pytest.importorskip("verifiers")
datasets = pytest.importorskip("datasets")


def make_vf_env():
    rows = [{"question": f"Say {w}.", "answer": w} for w in ["apple", "river", "stone", "cloud", "ember", "maple"]]

    def exact(completion, answer) -> float:
        return float(completion[-1]["content"].strip() == answer)

    parser = vf.Parser()
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), eval_dataset=datasets.Dataset.from_list(rows[:3]),
                            system_prompt="Repeat the word.", parser=parser, rubric=vf.Rubric(funcs=[exact], parser=parser))


def say_the_word(prompt: str, rng) -> str:
    word = prompt.rsplit("Say ", 1)[-1].split(".", 1)[0]
    return word if rng.random() < 0.5 else "no"


def test_a_verifiers_environment_trains_through_the_orchestrator(tmp_path, tiny_model, tokenizer, fake_servers):
    env = adapt_env(make_vf_env())
    assert isinstance(env, VerifiersEnv)
    (backend, url), = fake_servers(respond=say_the_word)
    config = make_config(tmp_path, tiny_model, [url], max_steps=2, eval={"interval": 2, "num_examples": 3})
    trainer = run(config, [LoadedEnv("vf_say", env)], tokenizer)

    rewards = set()
    for step, (batch,) in trainer.batches.items():
        records = [r for r in samples_of(config, step) if r["status"] == "trained"]
        assert len(records) == config.batch_size
        assert all(r["completion"][-1]["role"] == "assistant" and r["metrics"]["exact"] == r["reward"] for r in records)
        assert batch.num_loss_tokens == sum(r["completion_tokens"] for r in records)
        rewards |= {r["reward"] for r in records}
    assert rewards == {0.0, 1.0}  # the verifiers rubric scored right and wrong answers
    prompt = tokenizer.decode(backend.requests[0]["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system\nRepeat the word.<|im_end|>\n<|im_start|>user\nSay ")


def test_the_verifiers_client_carries_tokens_and_sampling_args(fake_servers, tokenizer):
    from tandem.config.orchestrator import ClientConfig
    from tandem.orchestrator.chat_client import TokenChatClient
    from tandem.orchestrator.inference_pool import InferencePool

    (backend, url), = fake_servers(respond=say_the_word)
    env = VerifiersEnv(make_vf_env())
    example = env.get_dataset()[0]

    async def body():
        pool = InferencePool(ClientConfig(base_urls=[url]))
        client = TokenChatClient(pool, tokenizer, 0, 512)
        try:
            completion, state = await env.rollout(client, "m", example["prompt"], example["answer"],
                                                  sampling_args={"temperature": 0.7, "max_tokens": 9})
            return client, completion, state
        finally:
            await pool.aclose()

    client, completion, state = asyncio.run(body())
    assert backend.requests[0]["temperature"] == 0.7 and backend.requests[0]["max_tokens"] == 9
    (turn,) = client.turns
    step = state["trajectory"][0]
    assert step["tokens"]["completion_ids"] == turn.completion_ids
    assert step["tokens"]["prompt_ids"] == turn.prompt_ids
    assert completion[-1]["role"] == "assistant" and state["stop_reason"] == "max_turns_reached"
