"""The CUDA fast path end to end: the engine (CUDA graphs, the attention kernels, the sampling kernel) against a
teacher-forced pass. The kernels alone are checked against their references in tests/kernels/."""

import random

import pytest
import torch
from inference_helpers import check_close_to_unquantized, check_teacher_forced, generate, teacher_forced_logprobs

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.loading import load_causal_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_engine_decodes_long_contexts_through_split_kv_graphs(tiny_dir):
    """fp32: contexts of one chunk (512 keys) and of several, some crossing a chunk's end while decoding; steps
    replay graphs of both context bounds (512 once the long ones finish, and max_model_len) and combine
    chunks; logprobs match a teacher-forced pass."""
    engine = build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=8, max_model_len=1400, max_num_batched_tokens=512), seed=0)
    assert engine.runner.graphs is not None and engine.runner.graphs.context_bounds == [512, 1400]
    model = load_causal_lm(str(tiny_dir))
    rng = random.Random(1)
    lengths = {"0": (300, 60), "1": (500, 24), "2": (505, 24), "3": (1100, 8), "4": (1350, 8)}  # prompt, output
    prompts = {i: [rng.randrange(256) for _ in range(prompt_len)] for i, (prompt_len, _) in lengths.items()}
    for request_id, prompt in prompts.items():
        params = SamplingParams(max_tokens=lengths[request_id][1], temperature=1.0, ignore_eos=True)
        engine.add_request(request_id, prompt, params, n=1, incremental=False)
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    assert len(outputs) == 5
    for out in outputs:
        expected = teacher_forced_logprobs(model, prompts[out.request_id], out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seeded", [True, False], ids=["torch-sampler", "sampling-kernel"])
def test_engine_with_cuda_graphs_matches_a_teacher_forced_pass(tiny_dir, seeded):
    """fp32 on CUDA: prefill chunks through the kernel, decodes through the graphs, mixed lengths;
    seeded requests sample through the torch path, the others through the sampling kernel."""
    engine = build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=24, max_model_len=256, max_num_batched_tokens=96), seed=0)
    assert engine.runner.graphs is not None
    model = load_causal_lm(str(tiny_dir))
    rng = random.Random(0)
    requests = {}
    for i in range(12):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 120))]
        params = SamplingParams(max_tokens=40, temperature=[0.0, 0.7, 1.0][i % 3], seed=i if seeded else None,
                                ignore_eos=True)
        requests[str(i)] = (prompt, params)
        engine.add_request(str(i), prompt, params, n=2, incremental=False)
    check_teacher_forced(engine, model, requests, 24)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="an FP8 KV cache needs compute capability 8.9 or newer")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_an_fp8_kv_cache_and_cuda_graphs_stays_close_to_the_unquantized_model(tiny_dir, dtype):
    """`engine.kv_cache_dtype = "fp8"` on the kernel path: the cache write quantizes, prefill chunks and graph-replayed
    decodes (one and several chunks of context) read FP8 with its scales; logprobs within the bound of 2 FP8
    factors per block (`inference_helpers.fp8_rho`, as on the CPU: `tests/inference/test_fp8_kv_cache.py`) of the
    unquantized model's in the same dtype, through paging, n = 2 and preemption."""
    engine = build_engine(ModelConfig(name=str(tiny_dir), dtype=dtype),
                          EngineConfig(device="cuda", max_num_seqs=16, max_model_len=1400, max_num_batched_tokens=256,
                                       num_blocks=100, kv_cache_dtype="fp8"), seed=0)
    assert engine.runner.graphs is not None and engine.runner.cache.fp8
    model = load_causal_lm(str(tiny_dir), "cuda", dtype)
    check_close_to_unquantized(generate(engine, num_requests=8, max_tokens=600, n=2), model, "cuda", 2)
    assert engine.scheduler.num_preemptions > 0
