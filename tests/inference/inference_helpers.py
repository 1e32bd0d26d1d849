"""Helpers of the inference tests: real servers on loopback ports, teacher-forced logprobs."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import torch
import uvicorn

from tandem.config.inference import InferenceConfig
from tandem.inference.app import build_app
from tandem.inference.server import build_served
from tandem.inference.serving import Served

ENGINE = {"num_blocks": 512, "block_size": 16, "max_model_len": 1024, "max_num_seqs": 64, "max_num_batched_tokens": 1024}
"""Engine settings of the test servers: an 8k-token cache, small enough to allocate in no time."""


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token, from one forward pass over the whole sequence."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model.lm_head(model(ids, torch.arange(ids.shape[1])[None])).float()[0]
    scaled = logits / (temperature if temperature > 0 else 1.0)
    rows = scaled[len(prompt) - 1:-1].log_softmax(-1)
    return rows.gather(-1, torch.tensor(completion)[:, None])[:, 0]


class RunningServer:
    """A real uvicorn server in a thread, on a free loopback port, over a freshly built engine."""

    def __init__(self, config: InferenceConfig):
        self.served: Served = build_served(config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        app = build_app(self.served, config.server.api_key)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def make_config(model_dir: Path, **engine) -> InferenceConfig:
    return InferenceConfig.model_validate({"model": {"name": str(model_dir)}, "engine": {**ENGINE, **engine}})
