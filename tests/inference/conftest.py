"""Fixtures of the inference tests: tiny model folders, the shared server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inference_helpers import RunningServer, make_config

from tandem.models.loading import load_causal_lm
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict, save_state_dict

@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_other_dir(tmp_path_factory) -> Path:
    """The tiny shape with other random weights: outputs visibly differ from `tiny_dir`'s."""
    return init_model("tiny", tmp_path_factory.mktemp("tiny_other"), seed=1)


@pytest.fixture(scope="session")
def sharp_dir(tmp_path_factory) -> Path:
    """The tiny model with its final norm scaled 30x: peaked logits, so greedy argmaxes are clear.

    A randomly initialized model has near-ties between its top tokens; float rounding, which
    differs with batch shapes, could flip them. Trained models have clear winners; this mimics that.
    """
    folder = init_model("tiny", tmp_path_factory.mktemp("sharp"), seed=2)
    state = load_state_dict(folder)
    state["model.norm.weight"] = state["model.norm.weight"] * 30
    save_state_dict(state, folder, tied_embeddings=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tiny_dir) -> torch.nn.Module:
    return load_causal_lm(str(tiny_dir))


@pytest.fixture(scope="session")
def server(tiny_dir):
    """The shared server over the tiny model; tests that change its weights use their own."""
    running = RunningServer(make_config(tiny_dir))
    yield running
    running.stop()
