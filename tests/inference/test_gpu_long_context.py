"""128k-token contexts in the engine on the GPU: a prompt of 131,072 - 32 tokens on the Qwen3-0.6B shape with
YaRN (factor 4 over 32,768 positions, as Qwen3 reaches 128k), prefilled in chunks through the paged cache and
the Triton kernel, then decoded through the CUDA graphs, gives the logprobs of one teacher-forced pass over the
whole sequence by tandem's model with the trainer's attention (`DocumentCausalAttention`: cuDNN/flash). Two blocks
(the property is the positions, not the depth), random weights, bf16: fp32 at this length is minutes of IEEE
dots in the engine and an unfused SDPA in the reference (the YaRN arithmetic itself is checked in fp32 against
transformers on the CPU, tests/inference/test_long_context.py); the bf16 bound is the MoE parity test's."""

import random

import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.attention import DocumentCausalAttention
from tandem.models.loading import load_causal_lm
from tandem.models.presets import PRESETS, shape_config, write_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ORIGINAL = 32_768
CONTEXT = 4 * ORIGINAL
NEW_TOKENS = 32


def test_a_128k_context_prefilled_in_chunks_matches_a_teacher_forced_pass(tmp_path):
    rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)
    shape = dict(PRESETS["qwen3-0.6b"], num_hidden_layers=2, rope_parameters=rope, max_position_embeddings=CONTEXT)
    folder = write_model(shape_config(shape), tmp_path / "yarn-128k")
    engine = build_engine(ModelConfig(name=str(folder), dtype="bfloat16"), EngineConfig(
        device="cuda", max_num_seqs=4, max_model_len=CONTEXT, max_num_batched_tokens=8192, memory_fraction=0.5), seed=0)
    rng = random.Random(0)
    prompt = [rng.randrange(shape["vocab_size"]) for _ in range(CONTEXT - NEW_TOKENS)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=0, ignore_eos=True))
    ids, logprobs = [], []
    while engine.has_unfinished:
        for out in engine.step():
            ids += out.token_ids
            logprobs += out.logprobs
    assert len(ids) == NEW_TOKENS and len(prompt) + len(ids) == CONTEXT
    del engine
    torch.cuda.empty_cache()

    model = load_causal_lm(str(folder), "cuda", "bfloat16")
    sequence = torch.tensor([prompt + ids], device="cuda")
    attention = DocumentCausalAttention([[CONTEXT]], torch.device("cuda"), ["cudnn", "flash", "efficient"])
    with torch.no_grad():
        hidden = model(sequence, torch.arange(CONTEXT, device="cuda")[None], attention)[0, len(prompt) - 1:-1]
        expected = model.lm_head(hidden).float().log_softmax(-1).gather(-1, torch.tensor(ids, device="cuda")[:, None])[:, 0]
    got = torch.tensor(logprobs)
    r = expected.cpu() - got
    k3 = (r.exp() - 1 - r).mean().item()
    assert k3 < 1e-3, (k3, r.abs().max().item())
    torch.testing.assert_close(got, expected.cpu(), atol=0.1, rtol=0)
