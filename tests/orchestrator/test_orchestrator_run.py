"""Whole orchestrator runs against fake inference servers and a fake trainer (real HTTP, real files)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_trainer import FakeTrainer
from scripted_envs import CountdownEnv, echo_or_short, right_or_wrong, say_env

from tandem.config.orchestrator import OrchestratorConfig
from tandem.monitor.metrics import read_metrics
from tandem.orchestrator.environments import LoadedEnv
from tandem.orchestrator.orchestrator import Orchestrator
from tandem.transport.paths import rollouts_dir


def make_config(tmp_path, tiny_model, urls, **overrides) -> OrchestratorConfig:
    base = dict(
        output_dir=tmp_path / "run", model={"name": str(tiny_model)}, seq_len=256, max_steps=3,
        batch_size=4, group_size=2, sampling={"max_tokens": 16},
        client={"base_urls": urls, "max_retries": 2, "backoff_s": 0.01},
        eval={"interval": 0}, weights={"poll_interval_s": 0.01, "wait_timeout_s": 30},
    )
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return OrchestratorConfig.model_validate(base)


def run(config, envs, tokenizer, trainer_delay_s=0.0) -> FakeTrainer:
    trainer = FakeTrainer(config.run_dir, config.max_steps, config.num_trainer_ranks, trainer_delay_s)
    trainer.start()
    try:
        asyncio.run(asyncio.wait_for(Orchestrator(config, envs, tokenizer).run(), 60))
    finally:
        trainer.stop()
    assert trainer.error is None
    return trainer


def samples_of(config, step) -> list[dict]:
    return [json.loads(line) for line in (rollouts_dir(config.run_dir, step) / "samples.jsonl").read_text().splitlines()]


def test_a_run_writes_every_batch_metrics_samples_and_evals(tmp_path, tiny_model, tokenizer, fake_servers):
    servers = fake_servers(2, respond=right_or_wrong)
    config = make_config(tmp_path, tiny_model, [u for _, u in servers], num_trainer_ranks=2,
                         eval={"interval": 2, "num_examples": 3, "rollouts_per_example": 2})
    trainer = run(config, [say_env()], tokenizer, trainer_delay_s=0.1)

    assert sorted(trainer.batches) == [1, 2, 3]
    for step, batches in trainer.batches.items():
        assert [b.rank for b in batches] == [0, 1] and len(batches[0].rows) == len(batches[1].rows)
        assert sum(sum(sum(r.loss_mask) for r in b.rows) for b in batches) == batches[0].num_loss_tokens > 0
        assert all(len(r.input_ids) <= config.seq_len for b in batches for r in b.rows)
        records = samples_of(config, step)
        trained = [r for r in records if r["status"] == "trained"]
        assert len(trained) == config.batch_size
        assert {r["reward"] for r in trained} <= {0.0, 1.0}
    lines = list(read_metrics(config.run_dir, "orchestrator"))
    steps = [m for m in lines if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for key in ["reward/std", "reward/say/mean", "seq_len/mean", "samples/num_truncated", "off_policy/mean",
                "off_policy/max", "off_policy/num_dropped", "throughput/rollouts_per_s", "throughput/tokens_per_s",
                "time/wait_inference_s", "time/wait_trainer_s", "metrics/exact_match", "groups/num_filtered"]:
        assert key in steps[0], key
    assert all(0.0 < m["time/rollout_inference_mean_s"] <= m["time/rollout_inference_max_s"] for m in steps)
    evals = [m for m in lines if "eval/reward_mean" in m]
    assert [m["step"] for m in evals] == [0, 2, 3]
    assert all(0.0 <= m["eval/pass@1"] <= m["eval/pass@2"] <= 1.0 for m in evals)
    assert evals[0]["eval/num_rollouts"] == 6
    eval_lines = (config.run_dir / "eval" / "step_0" / "samples.jsonl").read_text().splitlines()
    assert len(eval_lines) == 6 and all(json.loads(line)["status"] == "eval" for line in eval_lines)
    # every server got every policy
    assert [v for _, v in servers[0][0].updates] == [v for _, v in servers[1][0].updates] == [1, 2, 3]


@pytest.mark.alone  # the orchestrator must outrun a 0.3 s trainer step: another test computing beside it may not
@pytest.mark.parametrize("max_async_level", [0, 1, 2])
def test_no_batch_is_sampled_beyond_max_async_level(tmp_path, tiny_model, tokenizer, fake_servers, max_async_level):
    (backend, url), = fake_servers(respond=right_or_wrong, delay_s=0.01)
    config = make_config(tmp_path, tiny_model, [url], max_steps=5, max_async_level=max_async_level,
                         max_off_policy_steps=max_async_level)
    # At level 2 the orchestrator waits only before steps 4 and 5, and the slower its own steps, the less: the
    # trainer's step is long enough for that wait to stay well above the bound below on a loaded machine.
    trainer = run(config, [say_env()], tokenizer, trainer_delay_s=0.3)

    gaps = []
    for step, (batch,) in trainer.batches.items():
        assert trainer.policy_when_ready[step] >= step - 1 - max_async_level
        assert batch.policy_versions and min(batch.policy_versions) >= step - 1 - max_async_level
        gaps.extend(step - 1 - v for v in batch.policy_versions)
    # With a slow trainer the orchestrator runs exactly as far ahead as allowed.
    assert max(gaps) == max_async_level
    steps = [m for m in read_metrics(config.run_dir, "orchestrator")]
    assert max(m["off_policy/max"] for m in steps) == max_async_level
    assert sum(m["time/wait_trainer_s"] for m in steps) > 0.1


def test_each_step_logs_the_time_spent_loading_policies(tmp_path, tiny_model, tokenizer, fake_servers):
    """Synchronous: policy n is loaded in step n+1's window (between its batches), never in step 1's."""
    (backend, url), = fake_servers(respond=right_or_wrong)
    backend.update_delay_s = 0.2
    config = make_config(tmp_path, tiny_model, [url], max_steps=3, max_async_level=0)
    run(config, [say_env()], tokenizer)

    steps = [m for m in read_metrics(config.run_dir, "orchestrator")]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert steps[0]["time/update_weights_s"] == 0.0
    for m in steps[1:]:
        assert 0.2 <= m["time/update_weights_s"] <= m["time/wait_trainer_s"] <= m["time/step_s"]


def test_samples_older_than_max_off_policy_steps_are_dropped_and_counted(tmp_path, tiny_model, tokenizer, fake_servers):
    (fresh, url_a), (lagging, url_b) = fake_servers(2, respond=right_or_wrong)
    lagging.version_lag = 2  # reports weights two versions older than it holds
    config = make_config(tmp_path, tiny_model, [url_a, url_b], max_steps=5, batch_size=8, max_async_level=1,
                         max_off_policy_steps=1)
    trainer = run(config, [say_env()], tokenizer, trainer_delay_s=0.05)

    metrics = [m for m in read_metrics(config.run_dir, "orchestrator")]
    assert sum(m["off_policy/num_dropped"] for m in metrics) > 0
    for step, (batch,) in trainer.batches.items():
        assert all(v >= step - 2 for v in batch.policy_versions), "no stale sample reaches the trainer"
        records = samples_of(config, step)
        dropped = [r for r in records if r["status"] == "dropped"]
        assert metrics[step - 1]["off_policy/num_dropped"] == len(dropped)
        assert all(min(r["policy_versions"]) < step - 2 for r in dropped)


def test_a_failing_reward_function_scores_zero_and_is_reported(tmp_path, tiny_model, tokenizer, fake_servers):
    def broken(completion) -> float:
        raise RuntimeError("reward bug")

    (_, url), = fake_servers(respond=right_or_wrong)
    config = make_config(tmp_path, tiny_model, [url], max_steps=2)
    run(config, [say_env(extra_funcs=(broken,))], tokenizer)

    metrics = [m for m in read_metrics(config.run_dir, "orchestrator")]
    assert [m["reward/num_errors"] for m in metrics] == [config.batch_size] * 2
    record = samples_of(config, 1)[0]
    assert record["reward_errors"] == ["broken: RuntimeError: reward bug"] and record["metrics"]["broken"] == 0.0


def test_failed_rollouts_are_excluded_and_replaced(tmp_path, tiny_model, tokenizer, fake_servers):
    (backend, url), = fake_servers(respond=right_or_wrong)
    backend.fail_next = 3  # with max_retries = 0 these are three failed rollouts
    config = make_config(tmp_path, tiny_model, [url], max_steps=2, client={"max_retries": 0},
                         advantage={"filter_zero_groups": False})
    trainer = run(config, [say_env()], tokenizer)

    records = samples_of(config, 1) + samples_of(config, 2)  # step 2 may start before step 1 ends
    failed = [r for r in records if r["status"] == "failed"]
    assert len(failed) == 3 and all("HTTP 503" in r["error"] for r in failed)
    assert sorted(trainer.batches) == [1, 2]
    metrics = list(read_metrics(config.run_dir, "orchestrator"))
    assert sum(m["rollouts/num_failed"] for m in metrics) == 3 and sum(m["groups/num_replaced"] for m in metrics) >= 1
    for batch, in trainer.batches.values():  # failed rollouts never reach the trainer
        assert batch.num_loss_tokens > 0


def test_groups_without_signal_are_filtered_then_used_to_fill_the_step(tmp_path, tiny_model, tokenizer, fake_servers):
    (_, url), = fake_servers(respond=lambda prompt, rng: "same")  # every rollout scores 0
    config = make_config(tmp_path, tiny_model, [url], max_steps=2, advantage={"max_replacement_ratio": 1.0})
    trainer = run(config, [say_env()], tokenizer)

    first = next(read_metrics(config.run_dir, "orchestrator"))
    groups_per_step = config.batch_size // config.group_size
    assert first["groups/num_filtered"] == 2 * groups_per_step  # the originals and their replacements
    assert first["groups/num_replaced"] == groups_per_step
    statuses = [r["status"] for r in samples_of(config, 1)]
    assert statuses.count("trained") == config.batch_size and statuses.count("filtered") == config.batch_size
    assert all(a == 0.0 for r in trainer.batches[1][0].rows for a in r.advantages)


def test_multi_turn_rollouts_keep_every_turn_in_one_sample(tmp_path, tiny_model, tokenizer, fake_servers):
    (_, url), = fake_servers(respond=echo_or_short)
    config = make_config(tmp_path, tiny_model, [url], max_steps=1, advantage={"filter_zero_groups": False})
    trainer = run(config, [LoadedEnv("countdown", CountdownEnv())], tokenizer)

    (batch,) = trainer.batches[1]
    records = samples_of(config, 1)
    assert all(r["num_samples"] == 1 and len(r["policy_versions"]) == 3 for r in records)
    assert [m["content"] for m in records[0]["completion"] if m["role"] == "user"] == ["left 2", "left 1"]
    for row in batch.rows:
        starts = [t for t, p in enumerate(row.position_ids) if p == 0] + [len(row.input_ids)]
        for a, b in zip(starts, starts[1:]):
            mask = row.loss_mask[a:b]
            segments = sum(1 for t in range(1, len(mask)) if mask[t] and not mask[t - 1])
            assert segments == 3  # three model turns, separated by environment tokens
            text = tokenizer.decode(row.input_ids[a:b])
            assert text.count("user\nleft 2") == 1 and text.count("user\nleft 1") == 1
