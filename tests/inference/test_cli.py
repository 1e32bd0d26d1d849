"""`tandem inference` as a user runs it: a process that serves until stopped."""

import subprocess
import sys

import httpx
from local_servers import tandem_inference


def test_tandem_inference_serves_from_the_command_line(tiny_dir, tmp_path):
    with tandem_inference(tiny_dir, tmp_path / "inference.log", "--engine.num-blocks", "64", "--engine.max-model-len", "512") as url:
        body = httpx.post(f"{url}/v1/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 3}).json()
    assert len(body["choices"][0]["token_ids"]) <= 3


def test_a_cache_too_small_for_one_sequence_is_a_config_error(tiny_dir):
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(tiny_dir),
         "--engine.num-blocks", "4", "--engine.max-model-len", "512"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "`engine.num_blocks` * `engine.block_size` = 64 tokens cannot hold one sequence of `engine.max_model_len` = 512" in result.stderr
