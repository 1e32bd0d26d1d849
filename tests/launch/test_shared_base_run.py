"""`tandem rl` with `trainer.lora.share_base` on the CPU: the trainer starts first and shares its base, the server maps
it, the run trains and ends (the trainer holding the base until the orchestrator's last eval is done), and nothing
of the shared memory is left behind; a trainer that dies ends the run, named."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from short_runs import rl_command, run, run_pids, start, wait_for_trainer_step

from tandem.launch.process import group_alive
from tandem.models.presets import init_model
from tandem.monitor.metrics import read_metrics
from tandem.transport.paths import shared_base_file, shared_base_released_file

pytestmark = pytest.mark.slow

SHARE = ("--trainer.lora.enabled", "true", "--trainer.lora.share_base", "true", "--weight-transport.type", "filesystem")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("model"), seed=0)


def leftover_buffers(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"tandem-shared-base-{pid}-")]


def test_a_run_on_a_shared_base_trains_and_ends_cleanly(model, tmp_path):
    out = tmp_path / "run"
    result = run(rl_command(model, out, 3, *SHARE))
    assert result.returncode == 0, result.stderr[-3000:]
    trainer = [r for r in read_metrics(out, "trainer") if "loss" in r]
    assert [r["step"] for r in trainer] == [1, 2, 3]
    # the server samples with the trainer's own tensors plus the adapters: fp32 logprobs agree to rounding
    assert max(r["mismatch_kl"] for r in trainer if r.get("mismatch_kl") is not None) < 1e-9
    assert shared_base_file(out).is_file() and shared_base_released_file(out).is_file()
    log = (out / "logs" / "trainer.log").read_text()
    assert "frozen base shared with the inference servers" in log and "stopped by SIGTERM" in log
    if Path("/dev/shm").is_dir():
        assert not leftover_buffers(run_pids(out)["trainer"])


def test_a_killed_trainer_ends_a_shared_run_naming_it(model, tmp_path):
    out = tmp_path / "run"
    proc = start(rl_command(model, out, 50, *SHARE))
    pids: dict[str, int] = {}
    try:
        wait_for_trainer_step(proc, out, 1)
        pids = run_pids(out)
        os.kill(pids["trainer"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids.values():
            if group_alive(pid):
                os.killpg(pid, signal.SIGKILL)
    assert proc.returncode != 0 and "the trainer process failed" in stderr, stderr[-3000:]
    assert not any(group_alive(pid) for pid in pids.values())
    if Path("/dev/shm").is_dir():  # the trainer ran no clean-up of its own: the launcher's removed the file
        assert not leftover_buffers(pids["trainer"])
