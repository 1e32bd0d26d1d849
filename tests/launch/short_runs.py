"""Short `tandem rl` runs on CPU from a random tiny model, for tests about the run's records and failures.

No SFT warm-up: these tests look at what a run leaves and how it ends, not at learning. Batches of two
groups of four short rollouts keep a step to seconds; the preflight (tests/launch/test_preflight.py) is off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tandem.monitor.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-tandem-7e1f0c2a"
"""The server's key in the runs that look for where a secret goes (test_secrets.py)."""


def rl_command(model: Path, out: Path, max_steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", "rl", "@", str(REPO / "examples" / "reverse_text" / "rl.toml"),
            "--model.name", str(model), "--output-dir", str(out), "--max-steps", str(max_steps), "--seq-len", "256",
            "--ckpt.interval", "2", "--orchestrator.batch-size", "8", "--orchestrator.group-size", "4",
            "--orchestrator.sampling.max-tokens", "8", "--orchestrator.eval.interval", "100",
            "--orchestrator.eval.num-examples", "4", "--preflight.enabled", "false", *extra]


def env() -> dict[str, str]:
    """The environment of a user's shell (no TANDEM_* variable of the test session's), with one torch thread per
    process: a run's server and trainer compute at once, and at torch's default of a thread per core each, their
    threads outnumber the cores, so every small op of one waits for the other's threads to get a core back."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")} | {"OMP_NUM_THREADS": "1"}


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_trainer_step(proc: subprocess.Popen, out: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in read_metrics(out, "trainer")):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no trainer step {step} within {timeout_s} s"
        time.sleep(0.1)


def run_pids(out: Path) -> dict[str, int]:
    return json.loads((out / "logs" / "pids.json").read_text())
