"""`tandem rl` with W&B in offline mode: what the launcher mirrors, read back from the W&B run it wrote.

The `wandb_run` fixture (conftest.py): two short runs on CPU from a random tiny model (no warm-up: the mirror is
the point), 4 steps, then `--resume` to 6 from the checkpoint at step 4; one W&B run holds both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tandem.monitor.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "monitor"))
import wandb_records  # noqa: E402  (tests/monitor: reads offline W&B runs)

pytestmark = pytest.mark.slow


def test_a_run_and_its_resume_log_every_figure_into_one_wandb_run(wandb_run):
    out = wandb_run.out
    for result in (wandb_run.first, wandb_run.resumed):
        assert result.returncode == 0, result.stderr[-3000:]

    logged = wandb_records.history(out)
    assert [r["trainer/step"] for r in logged if "trainer/loss" in r] == list(range(1, 7))
    losses = [r["loss"] for r in read_metrics(out, "trainer")]
    assert [r["trainer/loss"] for r in logged if "trainer/loss" in r] == losses
    rewards = [(r["step"], r["reward/mean"]) for r in read_metrics(out, "orchestrator") if "reward/mean" in r]
    assert [(r["orchestrator/step"], r["orchestrator/reward/mean"]) for r in logged if "orchestrator/reward/mean" in r] == rewards
    assert [r["orchestrator/step"] for r in logged if "orchestrator/samples/_type" in r] == [2, 4, 6]
    assert len(wandb_records.run_ids(out)) == 1 and len(wandb_records.offline_runs(out)) == 2
    assert wandb_records.summary(out)["run/steps"] == 6
