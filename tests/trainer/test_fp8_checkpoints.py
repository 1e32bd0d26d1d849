"""The trainer on a released block-FP8 checkpoint (Qwen3-*-FP8's layout, GLM-5-FP8's and DeepSeek-V3's): it trains the
values the checkpoint stands for, each FP8 weight dequantized by its block scales into the trainer's dtype."""

import json

import pytest
import torch
from fp8_release import DECODER_RELEASE, LATENT_RELEASE, write_fp8_release

from tandem.config.base import ModelConfig
from tandem.config.trainer import ParallelConfig
from tandem.kernels.fp8 import FP8
from tandem.models.fp8 import dequantize_weight
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict
from tandem.trainer.model import build_policy
from tandem.trainer.publish import write_weights_folder
from tandem.trainer.parallel.dims import close_parallel, init_parallel


@pytest.fixture
def dims():
    d = init_parallel("cpu")
    yield d
    close_parallel()


@pytest.mark.parametrize("preset, release", [("tiny", DECODER_RELEASE), ("tiny-glm5", LATENT_RELEASE),
                                             ("tiny-deepseek-v3", LATENT_RELEASE)], ids=["qwen3", "glm5", "deepseek-v3"])
def test_the_trainer_loads_an_fp8_checkpoint_dequantized(preset, release, dims, tmp_path):
    """Every parameter is the checkpoint's tensor, or for an FP8 one its dequantized value (no FP8 value taken for
    its number, which would drop the scales); the policy's forward runs on them."""
    folder = write_fp8_release(init_model(preset, tmp_path / "bf16", seed=0), tmp_path / "fp8", release)
    on_disk = load_state_dict(folder)  # in-memory names: experts (and their scales) stacked
    num_fp8 = sum(t.dtype == FP8 for t in on_disk.values())
    assert num_fp8 > 0
    policy, hf_config = build_policy(ModelConfig(name=str(folder)), ParallelConfig(), dims, chunk_size=4)
    assert hf_config["quantization_config"]["quant_method"] == "fp8"
    checked = 0
    for name, param in policy.hf_named_parameters():
        stored = on_disk[name]
        if stored.dtype == FP8:
            parts = 2 if name.endswith("experts.gate_up_proj") else 1
            stored = dequantize_weight(stored, on_disk[name + "_scale_inv"], param.dtype, parts)
            checked += 1
        assert param.dtype == torch.float32 and torch.equal(param.detach(), stored.to(param.dtype)), name
    assert checked == num_fp8
    ids = torch.arange(1, 9)[None]
    logits = policy.lm.lm_head(policy.lm(ids, torch.arange(8)[None]))
    assert torch.isfinite(logits).all()


def test_a_policy_trained_from_an_fp8_checkpoint_publishes_an_unquantized_folder(dims, tmp_path):
    """The trainer publishes its weights unquantized: the step folder's config.json must not keep the checkpoint's
    `quantization_config` (readers would look for block scales it does not hold), and the folder must load back to
    the policy's values, with every other config field and side file as the checkpoint's."""
    folder = write_fp8_release(init_model("tiny-glm5", tmp_path / "bf16", seed=0), tmp_path / "fp8", LATENT_RELEASE)
    policy, hf_config = build_policy(ModelConfig(name=str(folder)), ParallelConfig(), dims, chunk_size=4)
    state = {name: param.detach().clone() for name, param in policy.hf_named_parameters()}
    published = write_weights_folder(tmp_path / "run", 1, state, folder, hf_config)
    config = json.loads((published / "config.json").read_text())
    assert "quantization_config" not in config
    assert config == {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k != "quantization_config"}
    assert (published / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    reloaded = load_state_dict(published)
    assert not any(t.dtype == FP8 for t in reloaded.values())
    for name, value in state.items():
        assert torch.equal(reloaded[name].to(value.dtype), value), name
