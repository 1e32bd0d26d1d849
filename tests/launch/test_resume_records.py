"""A run stopped after its checkpoint and resumed leaves the records of a run that never stopped (issue 24).

Three short `tandem rl` runs on CPU from a random tiny model (no SFT warm-up: the records are the point, not
learning): 4 steps straight; 4 steps with the trainer killed once it logged step 3 (checkpoints every 2 steps,
so the orchestrator had gone on to step 3 or 4); the same command again, refused (the folder holds a run); then
`--resume` to step 4. Metrics rows, rollouts and
samples, weights, evals, checkpoints, the summary and the console must match the straight run step by step.
"""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from short_runs import rl_command, run, run_pids, start, wait_for_trainer_step

from tandem.models.presets import init_model
from tandem.monitor.metrics import read_metrics
from tandem.monitor.report import summarize

MAX_STEPS = 4
PARTS = ("rollouts", "weights", "eval", "checkpoints")
EVERY_CHECKPOINT = ("--orchestrator.eval.interval", "2")
"""Evals at the checkpoints' steps too: the stopped run evaluates policy 2 before its trainer logs step 3, and the
resumed run must not evaluate it again (it did, logging a second eval row of step 2)."""

pytestmark = pytest.mark.slow


def records(run: Path) -> dict:
    """What a run leaves, without what differs between any two runs (times, sampled values, and the
    `stop/<reason>` keys, one per stop reason that some rollout of the step happened to meet)."""
    rows = sorted((r["process"], r["step"], tuple(sorted(k for k in r if not k.startswith("stop/")))) for r in read_metrics(run))
    folders = {part: sorted(p.name for p in (run / part).iterdir()) for part in PARTS if (run / part).is_dir()}
    samples = {p.parent.name: len(p.read_text().splitlines()) for p in sorted(run.glob("rollouts/step_*/samples.jsonl"))}
    files = sorted(str(p.relative_to(run)) for part in PARTS for p in (run / part).rglob("*") if p.is_file())
    summary = {k: v for k, v in summarize(run).items() if k in ("steps", "eval_steps")}
    return {"rows": rows, "folders": folders, "samples": samples, "files": files, "summary": summary}


def printed_steps(stdout: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step\s+(\d+)/", stdout, re.MULTILINE)]


def test_a_resumed_run_leaves_the_records_of_a_run_that_never_stopped(tmp_path):
    model = init_model("tiny", tmp_path / "model", seed=0)
    out = tmp_path / "stopped"
    with ThreadPoolExecutor() as pool:  # the straight run beside the one to stop: each leaves a CI core idle at times
        straight_run = pool.submit(run, rl_command(model, tmp_path / "straight", MAX_STEPS, *EVERY_CHECKPOINT))
        proc = start(rl_command(model, out, MAX_STEPS, *EVERY_CHECKPOINT))
        try:
            wait_for_trainer_step(proc, out, 3)
            os.kill(run_pids(out)["trainer"], signal.SIGKILL)
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        straight = straight_run.result()
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert proc.returncode != 0
    stopped_rows = list(read_metrics(out))
    stale = [r for r in stopped_rows if r["step"] > 2]
    assert stale, "the stopped run left no record after its checkpoint: nothing to test"
    assert any(r["step"] == 2 and "eval/reward_mean" in r for r in read_metrics(out, "orchestrator")), \
        "the stopped run had not evaluated policy 2: the second-eval case is not tested"

    refused = run(rl_command(model, out, MAX_STEPS, *EVERY_CHECKPOINT))  # neither --resume nor --clean
    assert refused.returncode != 0 and "already holds a run" in refused.stderr and "--resume" in refused.stderr
    assert list(read_metrics(out)) == stopped_rows, "a refused run touched the folder"

    resumed = run(rl_command(model, out, MAX_STEPS, *EVERY_CHECKPOINT, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step 2; removed the stopped run's later records" in resumed.stderr
    left, expected = records(out), records(tmp_path / "straight")
    for key in expected:
        assert left[key] == expected[key], key
    assert not any(r in list(read_metrics(out)) for r in stale)  # superseded, not kept beside the new rows
    assert printed_steps(resumed.stdout) == printed_steps(straight.stdout) == list(range(1, MAX_STEPS + 1))
