"""`tandem inference` as a user runs it: a process that serves until stopped."""

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tandem_inference_serves_from_the_command_line(tiny_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(tiny_dir), "--server.port", str(port),
         "--engine.num-blocks", "64", "--engine.max-model-len", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        body = httpx.post(f"http://127.0.0.1:{port}/v1/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 3}).json()
        assert len(body["choices"][0]["token_ids"]) <= 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_cache_too_small_for_one_sequence_is_a_config_error(tiny_dir):
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(tiny_dir),
         "--engine.num-blocks", "4", "--engine.max-model-len", "512"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "`engine.num_blocks` * `engine.block_size` = 64 tokens cannot hold one sequence of `engine.max_model_len` = 512" in result.stderr
