"""Multi-turn rollouts against the real tandem server, with a chat template that rewrites earlier
turns (it drops their reasoning, as Qwen3's does): every trained token must be one the engine
sampled, with the logprob it sampled it at, and a turn whose prompt does not extend the sample so
far must start a new sample.

The template opens every generation inside `<think>`, so all of a tiny random model's output is
reasoning, and every earlier assistant turn is re-rendered empty: each turn breaks the prefix.
The same rollouts under the stock template are the control, where a prefix breaks only when the
sampled bytes do not round-trip through the chat message.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from scripted_envs import CountdownEnv
from test_real_server import tandem_server  # noqa: F401 (a fixture)

from tandem.config.orchestrator import ClientConfig
from tandem.models.loading import load_causal_lm
from tandem.orchestrator.environments import LoadedEnv
from tandem.orchestrator.inference_pool import InferencePool
from tandem.orchestrator.rollout import RolloutContext, run_rollout
from tandem.trainer.logprobs import token_logprobs

pytestmark = pytest.mark.slow

THINK_DROPPING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{{ message.content.split('</think>')[-1].strip() if '</think>' in message.content else '' }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Half the byte values end a turn: turns of a few tokens, and rollouts that reach their 3 turns.
SAMPLING = {"temperature": 1.0, "max_tokens": 12, "stop_token_ids": list(range(0, 256, 2)), "seed": 0}


def rollouts(tandem_server, tokenizer, model: str, num_rollouts: int):
    """(rollout, [(prompt ids sent, raw server response)] of its turns) for each rollout."""
    async def main():
        pool = InferencePool(ClientConfig(base_urls=[tandem_server], timeout_s=120))
        sent: list[tuple[list[int], dict]] = []
        generate = pool.generate

        async def recording(payload, server):
            response = await generate(payload, server)
            sent.append((list(payload["prompt_token_ids"]), response))
            return response

        pool.generate = recording
        ctx = RolloutContext(pool, tokenizer, model, 512)
        env = LoadedEnv("countdown", CountdownEnv())
        results = []
        try:
            for example in env.env.get_dataset(num_rollouts):
                start = len(sent)
                result = await run_rollout(ctx, env, example, 0, dict(SAMPLING, seed=len(results)))
                results.append((result, sent[start:]))
        finally:
            await pool.aclose()
        return results

    return asyncio.run(main())


def check_samples(result, sent, model) -> int:
    """Assert the samples train exactly the sampled tokens at their logprobs; return how many
    turns started a new sample."""
    assert result.error is None, result.error
    turns = [(prompt, response["choices"][0]) for prompt, response in sent]
    assert len(turns) == len(result.turns) == 3
    # Which turns must open a sample follows from the prompts the server received alone.
    starts = [0] + [k for k in range(1, 3) if not _extends(turns[k][0], turns[:k])]
    assert len(result.samples) == len(starts)
    for sample, begin, end in zip(result.samples, starts, starts[1:] + [3]):
        trained = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
        sampled = [t for _, choice in turns[begin:end] for t in choice["token_ids"]]
        assert trained == sampled
        trained_logprobs = [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m]
        assert trained_logprobs == [float(lp) for _, choice in turns[begin:end] for lp in choice["logprobs"]]
        assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
        assert sample.token_ids[: len(turns[begin][0])] == turns[begin][0]  # context as the engine saw it
        # The trainer's own logprobs of the sample's tokens, in the sample's context, are the engine's.
        ids = torch.tensor([sample.token_ids])
        with torch.no_grad():
            hidden = model(ids, torch.arange(ids.shape[1])[None])[0]
            recomputed, _ = token_logprobs(hidden[:-1], model.lm_head.weight, model.lm_head.bias, ids[0, 1:],
                                           torch.tensor(sample.temperatures[1:]), chunk_size=256)
        mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        torch.testing.assert_close(recomputed[mask], torch.tensor(sample.logprobs[1:])[mask], atol=1e-4, rtol=0)
    return len(starts)


def _extends(prompt: list[int], earlier: list[tuple[list[int], dict]]) -> bool:
    """Whether `prompt` starts with the whole conversation so far as the engine saw and wrote it."""
    last_prompt, last_choice = earlier[-1]
    so_far = last_prompt + list(last_choice["token_ids"])
    return prompt[: len(so_far)] == so_far


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_rewritten_earlier_turns_start_new_samples_and_only_sampled_tokens_are_trained(
    tiny_model, tokenizer, tandem_server  # noqa: F811
):
    model = load_causal_lm(str(tiny_model), device="cpu", dtype="float32").eval()
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = THINK_DROPPING_TEMPLATE
    for result, sent in rollouts(tandem_server, rewriting, str(tiny_model), 4):
        assert check_samples(result, sent, model) == 3  # every earlier turn was rewritten
        emptied = rewriting.encode("<|im_start|>assistant\n<|im_end|>", add_special_tokens=False)
        assert _contains(sent[2][0], emptied)  # the earlier turns were re-rendered without their tokens
    control = [check_samples(result, sent, model) for result, sent in rollouts(tandem_server, tokenizer, str(tiny_model), 12)]
    assert all(1 <= n <= 3 for n in control)
    assert min(control) < 3, f"no rollout kept its prefix ({control}): the joining path went untested"
