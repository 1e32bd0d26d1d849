"""RoPE scaling: tandem's Qwen3 with YaRN equals transformers' Qwen3ForCausalLM on the same folder (fp32
logprobs within 1e-5, positions far past the original context), whichever way config.json spells it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.models.loading import load_causal_lm
from tandem.models.presets import PRESETS, preset_config, shape_config, write_model

ORIGINAL = 256
"""original_max_position_embeddings of the test configs; the test row is 4 x longer."""


def logprobs_of_both(folder) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs of one 1024-token row from both models; checks that YaRN changes them."""
    ours = load_causal_lm(str(folder), "cpu", "float32")
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, ours.args.vocab_size, (1, 4 * ORIGINAL), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(4 * ORIGINAL)[None]

    def logprobs(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]

    with torch.no_grad():
        expected = logprobs(theirs(input_ids=ids, position_ids=positions, use_cache=False).logits)
        got = logprobs(ours.lm_head(ours(ids, positions)))
        ours.args.rope_scaling = None
        plain = logprobs(ours.lm_head(ours(ids, positions)))
    assert (got - plain).abs().max() > 1e-3  # YaRN matters here: a model ignoring it would fail
    return got, expected


@pytest.mark.parametrize("yarn", [
    dict(factor=4.0),
    dict(factor=8.0, beta_fast=16.0, beta_slow=2.0, mscale=0.707, mscale_all_dim=1.0),  # DeepSeek's attention factor
    dict(factor=4.0, attention_factor=1.3, truncate=False),
])
def test_yarn_equals_transformers(yarn, tmp_path):
    rope = dict(rope_type="yarn", original_max_position_embeddings=ORIGINAL, **yarn)
    shape = dict(PRESETS["tiny"], rope_parameters=rope, max_position_embeddings=int(ORIGINAL * yarn["factor"]))
    folder = write_model(shape_config(shape), tmp_path / "m")
    got, expected = logprobs_of_both(folder)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_yarn_in_the_4x_rope_scaling_spelling_equals_transformers(tmp_path):
    """Qwen3's model cards: `rope_scaling` {"type": "yarn", ...} next to a top-level `rope_theta`."""
    folder = write_model(shape_config(dict(PRESETS["tiny"], max_position_embeddings=4 * ORIGINAL)), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    (folder / "config.json").write_text(json.dumps(config))
    assert load_causal_lm(str(folder)).args.rope_scaling.factor == 4.0
    got, expected = logprobs_of_both(folder)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_other_rope_types_name_the_field(tmp_path):
    rope = dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL, factor=4.0,
                short_factor=[1.0] * 16, long_factor=[1.0] * 16)
    folder = write_model(shape_config(dict(PRESETS["tiny"], rope_parameters=rope)), tmp_path / "m", weights=False)
    with pytest.raises(ValueError, match=f"{folder / 'config.json'}: `rope_type` = 'longrope' is not supported"):
        load_causal_lm(str(folder))


def test_model_init_extends_a_preset_to_128k_with_yarn(tmp_path):
    """`tandem model init --max-position-embeddings 131072`: Qwen3-0.6B's 40,960 positions through YaRN
    factor 3.2, read back by tandem and by transformers; a shorter context changes no RoPE."""
    from tandem.models.cli import main
    from tandem.models.loading import build_native, read_hf_config

    assert main(["init", "--preset", "qwen3-0.6b", "--num-layers", "1", "--config-only", "--max-position-embeddings",
                 "131072", "--out", str(tmp_path / "m")]) == 0
    config = read_hf_config(tmp_path / "m")
    assert config["max_position_embeddings"] == 131072
    assert config["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 3.2,
                                         "original_max_position_embeddings": 40960}
    yarn = build_native(config, "meta").args.rope_scaling
    assert (yarn.factor, yarn.original_max_position_embeddings) == (3.2, 40960)
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(3.2) + 1)
    short = preset_config("qwen3-0.6b", max_position_embeddings=8192)
    assert short["max_position_embeddings"] == 8192 and short["rope_parameters"]["rope_type"] == "default"
