"""Inference servers that die mid-run: rollouts fail over; a run with no live server stops clearly."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from local_servers import serving
from fake_trainer import FakeTrainer
from scripted_envs import CountdownEnv, echo_or_short, right_or_wrong, say_env
from test_orchestrator_run import make_config, run

from tandem.config.resolve import free_port
from tandem.monitor.metrics import read_metrics
from tandem.orchestrator.environments import LoadedEnv
from tandem.orchestrator.orchestrator import Orchestrator

HERE = Path(__file__).parent


@pytest.fixture
def doomed_server(tiny_model, tmp_path):
    """A fake server in its own process, so the test can kill it with SIGKILL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, str(HERE / "fake_inference_server.py"), "--model", str(tiny_model), "--port", str(port),
            "--delay-s", "0.05"]
    with serving("doomed", argv, url, tmp_path / "doomed.log", start_timeout_s=30) as proc:
        yield proc, url


def test_a_server_killed_mid_rollout_is_failed_over(tmp_path, tiny_model, tokenizer, fake_servers, doomed_server):
    proc, doomed_url = doomed_server
    (survivor, survivor_url), = fake_servers(respond=echo_or_short, delay_s=0.05)
    config = make_config(tmp_path, tiny_model, [doomed_url, survivor_url], max_steps=3, batch_size=8,
                         advantage={"filter_zero_groups": False})
    killed_at: list[float] = []

    def kill_soon():
        time.sleep(0.4)  # multi-turn rollouts on both servers are under way by then
        os.kill(proc.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_soon)
    killer.start()
    trainer = run(config, [LoadedEnv("countdown", CountdownEnv())], tokenizer)
    killer.join()

    assert sorted(trainer.batches) == [1, 2, 3]
    metrics = list(read_metrics(config.run_dir, "orchestrator"))
    assert sum(m["rollouts/num_failed"] for m in metrics) == 0
    assert sum(m["client/num_retries"] for m in metrics) > 0
    assert any(r["time"] > killed_at[0] for r in survivor.requests), "the survivor took over"


def test_a_run_whose_servers_all_fail_stops_with_a_clear_error(tmp_path, tiny_model, tokenizer, fake_servers):
    (backend, url), = fake_servers(respond=right_or_wrong)
    backend.fail_next = 10**6
    config = make_config(tmp_path, tiny_model, [url], max_steps=2, client={"max_retries": 1})
    trainer = FakeTrainer(config.run_dir, config.max_steps)
    trainer.start()
    with pytest.raises(RuntimeError, match=r"step 1: all 4 groups failed; last error: .*HTTP 503"):
        asyncio.run(asyncio.wait_for(Orchestrator(config, [say_env()], tokenizer).run(), 30))
    trainer.stop()
