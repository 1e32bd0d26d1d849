"""The CUDA fast path against the references: the Triton paged-attention kernel against dense
attention, and the engine (CUDA graphs, kernel, GPU sampler) against a teacher-forced pass."""

import random

import pytest
import torch
from attention_cases import DECODES, MIXED, dense_reference, mixed_step
from inference_helpers import teacher_forced_logprobs

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.attention_kernel import paged_attention
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.loading import load_causal_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (40, 8)], ids=["qwen3-0.6b", "group-of-5"])
def test_kernel_equals_dense_attention(dtype, tolerance, shapes, heads, kv_heads):
    for seed in range(2):
        q, k, v, k_cache, v_cache, meta = mixed_step("cuda", dtype, heads=heads, kv_heads=kv_heads, head_dim=128,
                                                     block_size=16, seed=seed, shapes=shapes)
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start, meta.tiles, meta.block_q)
        ref = dense_reference(q, k_cache, v_cache, meta)
        assert (out.double().cpu() - ref).abs().max().item() < tolerance


def test_engine_with_cuda_graphs_matches_a_teacher_forced_pass(tiny_dir):
    """fp32 on CUDA: prefill chunks through the kernel, decodes through the graphs, mixed lengths."""
    engine = build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=24, max_model_len=256, max_num_batched_tokens=96), seed=0)
    assert engine.runner.graphs is not None
    model = load_causal_lm(str(tiny_dir))
    rng = random.Random(0)
    requests = {}
    for i in range(12):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 120))]
        params = SamplingParams(max_tokens=40, temperature=[0.0, 0.7, 1.0][i % 3], seed=i, ignore_eos=True)
        requests[str(i)] = (prompt, params)
        engine.add_request(str(i), prompt, params, n=2, incremental=False)
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    assert len(outputs) == 24
    for out in outputs:
        prompt, params = requests[out.request_id]
        expected = teacher_forced_logprobs(model, prompt, out.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
