"""Fixtures of the launch tests that more than one file reads."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from short_runs import API_KEY, rl_command, run

from tandem.models.presets import init_model
from tandem.transport.files import atomic_write_bytes

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
    runs serves both, since a run's start costs more than its steps. Under pytest-xdist the two modules may run
    on both workers: the first to ask makes the runs, the other waits for them and reads what they printed."""
    session = tmp_path_factory.getbasetemp()
    shared = session.parent if "PYTEST_XDIST_WORKER" in os.environ else session  # workers' folders are in it
    with open(shared / "wandb_run.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = shared / "wandb_run.json"
        if not record.exists():
            made = make_wandb_run(tmp_path_factory)
            printed = {"out": str(made.out), "first": vars(made.first), "resumed": vars(made.resumed)}
            atomic_write_bytes(record, json.dumps(printed).encode())
    printed = json.loads(record.read_text())
    return WandbRun(Path(printed["out"]), *(subprocess.CompletedProcess(**printed[key]) for key in ("first", "resumed")))


def make_wandb_run(tmp_path_factory) -> WandbRun:
    model = init_model("tiny", tmp_path_factory.mktemp("model"), seed=0)
    out = tmp_path_factory.mktemp("wandb") / "run"
    key = ("--inference.server.api-key", API_KEY)
    first = run(rl_command(model, out, 4, *key, *WANDB))
    resumed = run(rl_command(model, out, 6, "--resume", *key, *WANDB)) if first.returncode == 0 else first
    return WandbRun(out, first, resumed)
