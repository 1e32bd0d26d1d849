"""The engine past a model's original context through YaRN: a long prompt, prefilled in chunks over a paged
cache, gives the logprobs of a teacher-forced pass of transformers' own model on the same folder."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.presets import PRESETS, shape_config, write_model

ORIGINAL = 64
"""The test model's original context; its YaRN factor 8 takes it to 512 tokens."""


def test_long_prompt_past_the_original_context_matches_transformers(tmp_path):
    rope = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIGINAL)
    folder = write_model(shape_config(dict(PRESETS["tiny"], rope_parameters=rope, max_position_embeddings=8 * ORIGINAL)),
                         tmp_path / "yarn")
    engine = build_engine(ModelConfig(name=str(folder)), EngineConfig(
        device="cpu", num_blocks=40, block_size=16, max_model_len=8 * ORIGINAL, max_num_batched_tokens=48), seed=0)
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(6 * ORIGINAL)]  # 8 chunks of prefill
    engine.add_request("long", prompt, SamplingParams(max_tokens=32, temperature=1.0, seed=0, ignore_eos=True))
    ids, logprobs = [], []
    while engine.has_unfinished:
        for out in engine.step():
            ids += out.token_ids
            logprobs += out.logprobs
    assert len(ids) == 32

    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    sequence = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = theirs(input_ids=sequence, position_ids=torch.arange(sequence.shape[1])[None], use_cache=False).logits[0]
    expected = logits[len(prompt) - 1:-1].log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)
