"""End to end against the real tandem inference server with the tiny model: a well-formed batch.

The server runs as `tandem inference` in its own process; a fake trainer publishes real weight
folders (copies of the model), which the server loads through `POST /update_weights`.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from fake_trainer import FakeTrainer
from local_servers import tandem_inference
from test_orchestrator_run import make_config, samples_of

from tandem.config.orchestrator import EnvConfig
from tandem.monitor.metrics import read_metrics
from tandem.orchestrator.environments import load_envs
from tandem.orchestrator.orchestrator import Orchestrator

pytestmark = pytest.mark.slow


@pytest.fixture
def tandem_server(tiny_model, tmp_path):
    with tandem_inference(tiny_model, tmp_path / "inference.log", "--seq_len", "512") as (url, _):
        yield url


def test_the_real_server_yields_a_well_formed_batch(tmp_path, tiny_model, tokenizer, tandem_server):
    from tandem.trainer.data import check_batch  # the trainer's own reader rules

    config = make_config(tmp_path, tiny_model, [tandem_server], max_steps=2, batch_size=8, group_size=4,
                         seq_len=512, sampling={"max_tokens": 24}, num_trainer_ranks=2,
                         advantage={"filter_zero_groups": False}, client={"timeout_s": 120})
    envs = load_envs([EnvConfig(id="reverse_text", args={"num_train_examples": 20, "num_eval_examples": 4})])
    trainer = FakeTrainer(config.run_dir, config.max_steps, num_ranks=2, weights_from=tiny_model)
    trainer.start()
    try:
        asyncio.run(asyncio.wait_for(Orchestrator(config, envs, tokenizer).run(), 120))
    finally:
        trainer.stop()
    assert trainer.error is None and sorted(trainer.batches) == [1, 2]

    for step, batches in trainer.batches.items():
        assert len(batches[0].rows) == len(batches[1].rows)
        total = 0
        for batch in batches:
            check_batch(batch, config.seq_len, len(tokenizer), f"step {step} rank {batch.rank}")
            for row in batch.rows:
                for m, lp, t in zip(row.loss_mask, row.logprobs, row.temperatures):
                    assert (lp < 0 and math.isfinite(lp) and t == 1.0) if m else lp == 0.0
                total += sum(row.loss_mask)
        assert total == batches[0].num_loss_tokens > 0
        records = [r for r in samples_of(config, step) if r["status"] == "trained"]
        assert len(records) == config.batch_size
        assert sum(r["completion_tokens"] for r in records) == total
        assert all(v >= step - 2 for r in records for v in r["policy_versions"])
    metrics = [m for m in read_metrics(config.run_dir, "orchestrator")]
    assert [m["step"] for m in metrics] == [1, 2]
    # The run ended once the server held the last policy.
    reply = httpx.post(f"{tandem_server}/v1/generate", json={"prompt_token_ids": [1, 2, 3], "max_tokens": 2}).json()
    assert reply["weight_version"] == config.max_steps


def test_seeded_evals_score_a_policy_the_same_however_the_server_batches(tiny_model, tokenizer, tandem_server):
    """At T = 1, the completions of one rollout at a time and of all at once are the same."""
    from tandem.config.orchestrator import ClientConfig, EvalSettings, SamplingConfig
    from tandem.orchestrator.evaluation import evaluate
    from tandem.orchestrator.inference_pool import InferencePool
    from tandem.orchestrator.rollout import RolloutContext

    envs = load_envs([EnvConfig(id="reverse_text", args={"num_train_examples": 4, "num_eval_examples": 12})])
    sampling = SamplingConfig(temperature=1.0, max_tokens=24)

    async def completions(settings: EvalSettings, max_concurrent: int) -> list[list[int]]:
        pool = InferencePool(ClientConfig(base_urls=[tandem_server], timeout_s=120))
        try:
            ctx = RolloutContext(pool, tokenizer, str(tiny_model), 512)
            _, results = await evaluate(ctx, envs, settings, sampling, seed=3, max_concurrent=max_concurrent)
        finally:
            await pool.aclose()
        return [[t for turn in r.turns for t in turn.completion_ids] for r in results]

    settings = EvalSettings(num_examples=12, rollouts_per_example=2)
    alone = asyncio.run(completions(settings, 1))
    together = asyncio.run(completions(settings, 24))
    assert alone == together
    assert len({tuple(c) for c in alone[0::2]}) > 1 and alone[0::2] != alone[1::2]  # sampled: the 2 rollouts of an example differ


def test_episodes_end_at_the_servers_context_when_it_is_shorter_than_seq_len(tiny_model, tokenizer, tmp_path):
    """A server whose context (`engine.max_model_len` 160) is shorter than `seq_len` (512): the rollout's
    request is cut to fit, where an uncut one is refused (HTTP 400, a failed rollout)."""
    from tandem.config.orchestrator import ClientConfig
    from tandem.orchestrator.inference_pool import InferencePool
    from tandem.orchestrator.rollout import RolloutContext, episode_limit, run_rollout

    env = load_envs([EnvConfig(id="reverse_text", args={"num_train_examples": 2, "num_eval_examples": 0})])[0]

    async def rollout(url: str, limit_to_server: bool):
        pool = InferencePool(ClientConfig(base_urls=[url], timeout_s=120))
        try:
            seq_len = await episode_limit(pool, 512) if limit_to_server else 512
            ctx = RolloutContext(pool, tokenizer, str(tiny_model), seq_len)
            example = env.env.get_dataset()[0]
            return seq_len, await run_rollout(ctx, env, example, 0, {"temperature": 1.0, "max_tokens": 400, "seed": 1})
        finally:
            await pool.aclose()

    with tandem_inference(tiny_model, tmp_path / "inference.log", "--seq_len", "512", "--engine.max-model-len", "160") as (url, _):
        seq_len, fitted = asyncio.run(rollout(url, limit_to_server=True))
        _, uncut = asyncio.run(rollout(url, limit_to_server=False))
    assert seq_len == 160
    assert fitted.error is None and len(fitted.turns) == 1
    turn = fitted.turns[0]
    assert len(turn.prompt_ids) < 160 and len(turn.prompt_ids) + len(turn.completion_ids) <= 160
    assert uncut.error is not None and "maximum context length" in uncut.error
