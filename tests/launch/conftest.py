"""Fixtures of the launch tests that more than one file reads."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from short_runs import API_KEY, rl_command, run

from tandem.models.presets import init_model

WANDB = ("--wandb.project", "tandem-test", "--wandb.mode", "offline", "--wandb.samples-interval", "2")


@dataclass
class WandbRun:
    out: Path
    first: subprocess.CompletedProcess
    resumed: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def wandb_run(tmp_path_factory) -> WandbRun:
    """A short run on CPU from a random tiny model (no warm-up), mirrored to W&B in offline mode and given the
    server's API key on the command line: 4 steps, then `--resume` to 6 from the checkpoint at step 4, in one
    folder. test_wandb_run reads the W&B run back, test_secrets looks for the key in every file: one pair of
    runs serves both, since a run's start costs more than its steps."""
    model = init_model("tiny", tmp_path_factory.mktemp("model"), seed=0)
    out = tmp_path_factory.mktemp("wandb") / "run"
    key = ("--inference.server.api-key", API_KEY)
    first = run(rl_command(model, out, 4, *key, *WANDB))
    resumed = run(rl_command(model, out, 6, "--resume", *key, *WANDB)) if first.returncode == 0 else first
    return WandbRun(out, first, resumed)
