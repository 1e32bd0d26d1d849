"""The data stream: weighted, seeded, resumable; and a run resumed from its checkpoint."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from fake_trainer import FakeTrainer
from scripted_envs import right_or_wrong, say_env
from test_orchestrator_run import make_config, run

from tandem.orchestrator.resume_state import load_checkpoint, save_checkpoint
from tandem.orchestrator.orchestrator import Orchestrator
from tandem.orchestrator.task_sampler import TaskSampler
from tandem.transport.paths import rollouts_dir


def prompts(sampler: TaskSampler, n: int) -> list[tuple[str, str]]:
    return [(env.name, ex["prompt"][-1]["content"]) for env, ex in (sampler.next() for _ in range(n))]


def test_the_mix_follows_the_weights_and_each_epoch_sees_every_example_once():
    envs = [say_env("a", weight=3.0), say_env("b", weight=1.0)]
    drawn = prompts(TaskSampler(envs, seed=1), 400)
    share = Counter(name for name, _ in drawn)["a"] / len(drawn)
    assert 0.68 < share < 0.82
    first_epoch = [p for name, p in drawn if name == "b"][:16]
    assert sorted(first_epoch) == sorted(r["prompt"][-1]["content"] for r in envs[1].env.get_dataset())


def test_the_stream_is_a_function_of_seed_and_counters():
    envs = [say_env("a"), say_env("b")]
    full = prompts(TaskSampler(envs, seed=5), 40)
    assert prompts(TaskSampler(envs, seed=6), 40) != full
    first = TaskSampler(envs, seed=5)
    prompts(first, 25)
    resumed = TaskSampler(envs, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert prompts(resumed, 15) == full[25:]
    with pytest.raises(ValueError, match=r"environments \['c'\] that this run lacks"):
        resumed.load_state_dict({"num_draws": 1, "positions": {"c": 1}})


def test_the_newest_complete_checkpoint_wins(tmp_path):
    assert load_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 2, {"sampler": {"num_draws": 4}})
    save_checkpoint(tmp_path, 10, {"sampler": {"num_draws": 20}})
    (tmp_path / "checkpoints" / "step_12" / "orchestrator").mkdir(parents=True)  # incomplete: no state file
    assert load_checkpoint(tmp_path) == {"step": 10, "sampler": {"num_draws": 20}}
    assert load_checkpoint(tmp_path, 2) == {"step": 2, "sampler": {"num_draws": 4}}  # `ckpt.resume_step`
    assert load_checkpoint(tmp_path, 12) is None and load_checkpoint(tmp_path, 3) is None


def test_a_resumed_run_continues_after_its_checkpoint(tmp_path, tiny_model, tokenizer, fake_servers):
    servers = fake_servers(1, respond=right_or_wrong)
    url = servers[0][1]
    first = make_config(tmp_path, tiny_model, [url], max_steps=2, ckpt={"enabled": True, "interval": 2},
                        advantage={"filter_zero_groups": False})
    run(first, [say_env()], tokenizer)
    state = load_checkpoint(first.run_dir)
    assert state["step"] == 2 and state["sampler"]["num_draws"] >= 4
    seen = {json.loads(l)["prompt"][-1]["content"] for s in (1, 2)
            for l in (rollouts_dir(first.run_dir, s) / "samples.jsonl").read_text().splitlines()}

    backend = servers[0][0]
    num_updates = len(backend.updates)
    second = make_config(tmp_path, tiny_model, [url], max_steps=4, ckpt={"resume": True},
                         advantage={"filter_zero_groups": False})
    trainer = FakeTrainer(second.run_dir, 4, first_step=3)
    trainer.start()
    try:
        asyncio.run(asyncio.wait_for(Orchestrator(second, [say_env()], tokenizer).run(), 60))
    finally:
        trainer.stop()
    assert trainer.error is None and sorted(trainer.batches) == [3, 4]
    assert backend.updates[num_updates][1] == 2, "the resumed run first loads the newest policy"
    for step, (batch,) in trainer.batches.items():
        assert min(batch.policy_versions) >= 2
    resumed = [json.loads(l)["prompt"][-1]["content"] for l in (rollouts_dir(first.run_dir, 3) / "samples.jsonl").read_text().splitlines()]
    # 16 examples, 4 groups drawn before the checkpoint: the first groups after it are new tasks
    assert resumed[0] not in seen
