"""Fixtures of the inference tests: tiny model folders, the shared server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from counting_head import give_counting_head
from inference_helpers import make_config

from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm
from tandem.models.presets import init_model

@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_other_dir(tmp_path_factory) -> Path:
    """The tiny shape with other random weights: outputs visibly differ from `tiny_dir`'s."""
    return init_model("tiny", tmp_path_factory.mktemp("tiny_other"), seed=1)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """Qwen3-MoE with 8 experts, 2 per token: the model code the engine shares with the trainer."""
    return init_model("tiny-moe", tmp_path_factory.mktemp("tiny_moe"), seed=0)


@pytest.fixture(scope="session")
def tiny_glm_dir(tmp_path_factory) -> Path:
    """GLM-4.5's block: partial rotary, q/k/v biases, a dense first block, group-limited routing."""
    return init_model("tiny-glm4-moe", tmp_path_factory.mktemp("tiny_glm"), seed=0)


@pytest.fixture(scope="session")
def sharp_dir(tmp_path_factory) -> Path:
    """A tiny model whose greedy choices are clear and varied: a "counting" LM head (`counting_head.py`)."""
    return give_counting_head(init_model("tiny", tmp_path_factory.mktemp("sharp"), seed=2))


@pytest.fixture(scope="session")
def tiny_model(tiny_dir) -> torch.nn.Module:
    return load_causal_lm(str(tiny_dir))


@pytest.fixture(scope="session")
def server(tiny_dir):
    """The shared server over the tiny model; tests that change its weights use their own."""
    running = BackgroundServer(make_config(tiny_dir))
    yield running
    running.stop()
