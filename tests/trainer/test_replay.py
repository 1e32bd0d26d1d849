"""`tandem replay`: a step of a CPU run recomputed offline equals what the run logged, bitwise; another loss
on the same tokens; the retention that keeps replayable weights."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.cli import main as cli_main
from tandem.config.loader import ConfigError
from tandem.config.replay import parse_replay_args
from tandem.trainer.publish import prune_weights
from tandem.transport.files import atomic_write_text
from tandem.transport.paths import STABLE, weights_dir

from trainer_helpers import metrics, random_row, run_trainer, write_rollouts


@pytest.fixture(scope="module")
def short_run(tiny_model, tmp_path_factory):
    """Three steps of an RL trainer on rollout files (policy versions recorded), weights of every step kept."""
    run_dir = tmp_path_factory.mktemp("run")
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2, 3):
        rows = [random_row(gen, [(5, 6), (3, 9)]), random_row(gen, [(4, 12)])]
        for row in rows:  # the second sample of each row is one policy older: off-policy tokens too
            row.policy_versions = [step - 1 if t < 11 else step - 2 for t in range(len(row.input_ids))]
        write_rollouts(run_dir, step, rows)
    assert run_trainer("--model.name", str(tiny_model), "--max-steps", "3", "--output-dir", str(run_dir), "--seq-len", "64",
                       "--optim.lr", "1e-2", "--optim.max-grad-norm", "0.5", "--data.wait-timeout-s", "5",
                       "--weights.keep", "2", "--weights.keep-every", "1") == 0
    return run_dir


@pytest.mark.parametrize("step", [1, 3])
def test_replay_reproduces_the_logged_step_bitwise(short_run, step, capsys):
    assert cli_main(["replay", str(short_run), "--step", str(step)]) == 0
    result = json.loads((short_run / "replay" / f"step_{step}.json").read_text())
    logged = metrics(short_run)[step - 1]
    # One rank, fp32 weights published in fp32: the same operations on the same values.
    for key in ("loss", "grad_norm", "mismatch_kl", "off_policy_kl", "on_policy_fraction", "entropy", "clipped_fraction"):
        assert result["run"][key] == logged[key], key
    assert result["logged"]["loss"] == logged["loss"]
    assert "equal the logged values bitwise" in capsys.readouterr().out


def test_another_loss_on_the_same_tokens(short_run):
    assert cli_main(["replay", str(short_run), "--step", "2", "--loss.type", "ppo_clip", "--loss.clip-high", "0.01",
                     "--loss.clip-low", "0.01"]) == 0
    result = json.loads((short_run / "replay" / "step_2.json").read_text())
    run, alt = result["run"], result["alternative"]
    assert run["loss_type"] == "aipo" and alt["loss_type"] == "ppo_clip"
    assert run["loss"] == metrics(short_run)[1]["loss"]
    # The same weights and tokens: the mismatch KL is the loss's business no more than the ratios are.
    assert alt["mismatch_kl"] == run["mismatch_kl"] and alt["entropy"] == run["entropy"]
    assert 0 < alt["clipped_fraction"] <= 1 and alt["loss"] != run["loss"] and alt["grad_norm"] != run["grad_norm"]
    ratios = result["ratios"]
    assert ratios["ratio_min"] <= ratios["ratio_mean"] <= ratios["ratio_max"]
    assert run["clip_coef"] == pytest.approx(min(1.0, 0.5 / run["grad_norm"]))


def test_loss_overrides_keep_the_runs_type(short_run):
    config = parse_replay_args([str(short_run), "--step", "2", "--loss.delta", "2.0"])
    assert config.loss.type == "aipo" and config.loss.delta == 2.0
    fresh = parse_replay_args([str(short_run), "--step", "2", "--loss.type", "dppo_kl"])
    assert fresh.loss.type == "dppo_kl" and fresh.loss.delta == 0.2


def test_a_pruned_policy_is_named_with_the_setting_that_keeps_it(short_run, tmp_path, caplog):
    run_dir = tmp_path / "copy"
    (run_dir / "configs").mkdir(parents=True)
    atomic_write_text(run_dir / "configs" / "trainer.toml", (short_run / "configs" / "trainer.toml").read_text())
    write_rollouts(run_dir, 2, [random_row(torch.Generator().manual_seed(1), [(4, 4)])])
    assert cli_main(["replay", str(run_dir), "--step", "2"]) == 1
    assert "weights/step_1 is missing" in caplog.text and "weights.keep_every" in caplog.text
    with pytest.raises(ConfigError, match="configs/trainer.toml not found"):
        parse_replay_args([str(tmp_path / "nothing"), "--step", "1", "--loss.delta", "2"])


def test_keep_every_spares_its_multiples(tmp_path):
    for step in range(1, 8):
        weights_dir(tmp_path, step).mkdir(parents=True)
        (weights_dir(tmp_path, step) / STABLE).touch()
    assert prune_weights(tmp_path, 2, keep_every=3) == [1, 2, 4, 5]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_3", "step_6", "step_7"]
