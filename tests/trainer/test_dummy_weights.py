"""`model.load_format = "dummy"`: each trainer rank draws its shards of the same random weights the
engine and `tandem model init` make, from a folder that holds no weights."""

from __future__ import annotations

import torch

from tandem.config.base import ModelConfig
from tandem.config.trainer import ParallelConfig
from tandem.models.loading import load_causal_lm
from tandem.models.presets import init_model
from tandem.trainer.model import build_policy
from tandem.trainer.parallel.dims import close_parallel, init_parallel


def test_dummy_weights_are_the_weights_init_writes(tmp_path):
    written = load_causal_lm(str(init_model("tiny-moe", tmp_path / "w", seed=0))).state_dict()
    config_only = init_model("tiny-moe", tmp_path / "d", weights=False)
    dims = init_parallel("cpu")
    try:
        policy, _ = build_policy(ModelConfig(name=str(config_only), load_format="dummy"), ParallelConfig(), dims, chunk_size=4)
        for name, param in policy.hf_named_parameters():
            assert torch.equal(param.detach(), written[name]), name
    finally:
        close_parallel()
