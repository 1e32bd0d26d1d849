"""Failure injection into `tandem rl` (issue 24): a process killed with SIGKILL, the launcher killed too,
an inference server that hangs (SIGSTOP) instead of dying, a write into the run folder that fails.

Stated bound: the run ends within END_S of the death (of `hang_timeout_s` + END_S for a hang), names the
process at fault, leaves no process running, and leaves nothing half-written that a resume would trust (weights marked STABLE are whole,
checkpoints marked complete are, every rollout file decodes).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from short_runs import rl_command, run_pids, start, wait_for_trainer_step

from tandem.launch.process import group_alive
from tandem.launch.resume import resume_step
from tandem.models.presets import init_model
from tandem.transport.paths import STABLE
from tandem.transport.types import decode_batch

END_S = 30
"""Each process gets SIGTERM, then SIGKILL after 10 s: three processes take at most 30 s to stop."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("model"), seed=0)


def check_nothing_half_written(out: Path) -> None:
    for folder in (out / "weights").glob("step_*"):
        if (folder / STABLE).exists():
            assert any(folder.glob("*.safetensors")) and (folder / "config.json").is_file(), folder
    for file in (out / "rollouts").glob("step_*/rank_*.msgpack"):
        decode_batch(file.read_bytes())  # a torn file would not decode
    step = resume_step(out)
    if step:
        assert any((out / "checkpoints" / f"step_{step}" / "trainer").glob("*.distcp"))


def inject(model: Path, out: Path, fault, *extra: str) -> tuple[str, float]:
    """Start a long run, apply `fault(pids)` after its first trainer step; the run's stderr and how long it
    took to end after the fault. The run must have failed and left no process and nothing half-written."""
    proc = start(rl_command(model, out, 50, *extra))
    pids: dict[str, int] = {}
    try:
        wait_for_trainer_step(proc, out, 1)
        pids = run_pids(out)
        fault(pids)
        faulted_at = time.monotonic()
        _, stderr = proc.communicate(timeout=300)
        ended_s = time.monotonic() - faulted_at
    finally:
        if proc.poll() is None:
            proc.kill()
        survivors = kill_survivors(pids)
    assert proc.returncode != 0
    assert not survivors
    check_nothing_half_written(out)
    return stderr, ended_s


def kill_survivors(pids: dict[str, int]) -> list[str]:
    """The processes of the run still alive, killed (a stopped one too) so that they do not outlive the test."""
    survivors = [name for name, pid in pids.items() if group_alive(pid)]
    for name in survivors:
        os.killpg(pids[name], signal.SIGKILL)
    return survivors


@pytest.mark.parametrize("victim", ["inference", "orchestrator", "trainer"])
def test_a_killed_process_ends_the_run_naming_it(model, tmp_path, victim):
    stderr, ended_s = inject(model, tmp_path / "run", lambda pids: os.kill(pids[victim], signal.SIGKILL))
    assert ended_s < END_S and f"the {victim} process failed" in stderr, (ended_s, stderr[-3000:])


def test_a_failed_write_in_the_run_folder_ends_the_run_naming_the_writer(model, tmp_path):
    """Without a small file system to fill, a write fails where a folder should go: a file is there."""
    out = tmp_path / "run"

    def block_next_batches(pids):
        for step in range(5, 51):
            (out / "rollouts" / f"step_{step}").write_text("not a folder")

    stderr, _ = inject(model, out, block_next_batches)
    assert "the orchestrator process failed" in stderr and "step_5" in stderr, stderr[-3000:]


def test_a_hung_inference_server_ends_the_run_naming_it(model, tmp_path):
    hang_timeout_s = 5
    # SIGSTOP: alive, holding its port, answering nothing.
    stderr, ended_s = inject(model, tmp_path / "run", lambda pids: os.killpg(pids["inference"], signal.SIGSTOP),
                             "--hang-timeout-s", str(hang_timeout_s))
    assert ended_s < hang_timeout_s + END_S, ended_s
    assert "the inference server is hung: alive, but no answer to" in stderr, stderr[-3000:]


def test_a_killed_launcher_takes_every_process_with_it(model, tmp_path):
    out = tmp_path / "run"
    proc = start(rl_command(model, out, 50))
    pids: dict[str, int] = {}
    try:
        wait_for_trainer_step(proc, out, 1)
        pids = run_pids(out)
        proc.kill()  # SIGKILL: the launcher cleans nothing up; its children must go by themselves
        proc.wait()
        deadline = time.monotonic() + END_S
        while [pid for pid in pids.values() if group_alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        survivors = kill_survivors(pids)
    assert not survivors
    check_nothing_half_written(out)
