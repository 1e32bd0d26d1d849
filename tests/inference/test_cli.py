"""`tandem inference` as a user runs it: a process that serves until stopped."""

import os
import signal
import subprocess
import sys
import time

import httpx
from local_servers import tandem_inference

from tandem.config.inference import ServerConfig
from tandem.inference.server import set_switch_interval


def test_tandem_inference_serves_from_the_command_line(tiny_dir, tmp_path):
    log = tmp_path / "inference.log"
    with tandem_inference(tiny_dir, log, "--engine.num-blocks", "64", "--engine.max-model-len", "512",
                          "--server.switch-interval-ms", "0.5") as (url, proc):
        body = httpx.post(f"{url}/v1/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 3}).json()
        # SIGUSR1: every thread's stack into the log (docs/rl.md), and the server goes on serving
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "async_engine.py" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}/health").status_code == 200
    assert len(body["choices"][0]["token_ids"]) <= 3
    stacks = log.read_text()
    assert "Thread 0x" in stacks and "(most recent call first)" in stacks
    assert "tandem/inference/engine/async_engine.py" in stacks  # the engine thread, waiting for work
    assert "interpreter lock switch interval: 0.5 ms" in stacks


def test_the_switch_interval_is_pythons_unless_set():
    before = sys.getswitchinterval()
    try:
        set_switch_interval(ServerConfig())
        assert sys.getswitchinterval() == before
        set_switch_interval(ServerConfig(switch_interval_ms=0.25))
        assert sys.getswitchinterval() == 0.00025
    finally:
        sys.setswitchinterval(before)


def test_a_cache_too_small_for_one_sequence_is_a_config_error(tiny_dir):
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(tiny_dir),
         "--engine.num-blocks", "4", "--engine.max-model-len", "512"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "`engine.num_blocks` * `engine.block_size` = 64 tokens cannot hold one sequence of `engine.max_model_len` = 512" in result.stderr
