"""`tandem orchestrator` from the command line: config, built-in env by id, tokenizer, a whole run."""

from __future__ import annotations

import pytest
from fake_trainer import FakeTrainer

from tandem.cli import main as tandem_main
from tandem.config.loader import ConfigError, parse_args
from tandem.config.orchestrator import OrchestratorConfig
from tandem.monitor.metrics import read_metrics
from tandem.transport.paths import rollout_file
from tandem.transport.types import decode_batch


def test_the_command_runs_a_builtin_environment_to_the_end(tmp_path, tiny_model, fake_servers):
    (backend, url), = fake_servers(respond=lambda prompt, rng: rng.choice(["<reversed_text>ab</reversed_text>", "x"]))
    run_dir = tmp_path / "run"
    trainer = FakeTrainer(run_dir, 2, delay_s=0.05)
    trainer.start()
    code = tandem_main(["orchestrator", "--model.name", str(tiny_model), "--output_dir", str(run_dir),
                        "--client.base_urls", f'["{url}"]', "--max_steps", "2", "--batch_size", "4",
                        "--group_size", "2", "--sampling.max_tokens", "24", "--eval.interval", "0",
                        "--weights.poll_interval_s", "0.01",
                        "--envs", '[{id = "reverse_text", args = {num_train_examples = 20, num_eval_examples = 4}}]'])
    trainer.stop()
    assert code == 0 and trainer.error is None
    batch = decode_batch(rollout_file(run_dir, 2, 0).read_bytes())
    assert batch.step == 2 and batch.num_loss_tokens > 0
    metrics = [m for m in read_metrics(run_dir, "orchestrator")]
    assert [m["step"] for m in metrics] == [1, 2] and "reward/reverse_text/mean" in metrics[0]


@pytest.mark.parametrize("args, message", [
    (["--batch_size", "6", "--group_size", "4"], "`batch_size` = 6 must be a positive multiple of `group_size` = 4"),
    (["--max_async_level", "3", "--max_off_policy_steps", "2"], "`max_off_policy_steps` = 2 is below `max_async_level` = 3"),
    (["--sampling.temperature", "0"], "training needs a temperature > 0"),
    (["--client.base_urls", "[]"], "`client.base_urls` is empty"),
    (["--client.base_urls", '["localhost:8000"]'], "must start with http://"),
    (["--envs", "[]"], "`envs` is empty"),
    (["--envs", '[{id = "a"}, {id = "a"}]'], "`envs[1]`: the label 'a' appears twice"),
    (["--envs", '[{id = "a", weight = 0}]'], "`envs[0].weight` must be > 0"),
    (["--eval.rollouts_per_example", "0"], "`eval.rollouts_per_example` must be >= 1"),
    (["--num_trainer_ranks", "0"], "`num_trainer_ranks` must be >= 1"),
])
def test_bad_configs_name_the_key(args, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_args(OrchestratorConfig, args, environ={})


def test_the_launcher_keys_exist():
    config = parse_args(OrchestratorConfig, ["--client.api_key", "k", "--eval.num_examples", "3", "--ckpt.resume"],
                        environ={})
    for key in ["client.base_urls", "client.api_key", "batch_size", "group_size", "max_async_level",
                "max_off_policy_steps", "num_trainer_ranks", "envs", "sampling.temperature", "sampling.max_tokens",
                "eval.interval", "eval.num_examples", "ckpt.enabled", "ckpt.interval", "ckpt.resume"]:
        node = config
        for part in key.split("."):
            node = getattr(node, part)
    assert config.client.api_key == "k" and config.ckpt.resume is True
