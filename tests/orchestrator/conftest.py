"""Shared fixtures: a tiny model folder (tokenizer + weights) built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.models.presets import init_model

    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture
def fake_servers(tokenizer):
    """`start(n=1, **backend_kwargs) -> [(backend, url)]`: fake inference servers on loopback."""
    from fake_inference_server import FakeBackend, ServerThread, make_app

    running = []

    def start(n: int = 1, **kwargs):
        out = []
        for _ in range(n):
            backend = FakeBackend(tokenizer, **kwargs)
            server = ServerThread(make_app(backend)).__enter__()
            running.append(server)
            out.append((backend, server.url))
        return out

    yield start
    for server in running:
        server.__exit__(None, None, None)
