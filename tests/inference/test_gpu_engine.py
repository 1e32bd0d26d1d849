"""The CUDA fast path against the references: the Triton paged-attention kernel against dense
attention, and the engine (CUDA graphs, kernel, GPU sampler) against a teacher-forced pass."""

import random

import pytest
import torch
from attention_cases import DECODES, MIXED, check_split_decode, dense_reference, mixed_step
from inference_helpers import teacher_forced_logprobs

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.kernels import sampling as sampling_kernel
from tandem.kernels.attention import paged_attention
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


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (40, 8)], ids=["qwen3-0.6b", "group-of-5"])
def test_split_decode_equals_dense_attention_and_is_batch_invariant(dtype, tolerance, heads, kv_heads):
    for seed in range(2):
        check_split_decode("cuda", dtype, heads, kv_heads, 128, tolerance, seed)


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
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    assert len(outputs) == 24
    for out in outputs:
        prompt, params = requests[out.request_id]
        expected = teacher_forced_logprobs(model, prompt, out.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def kernel_sample(logits: torch.Tensor, temperatures: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_temp, noise = sampling_kernel.sampling_inputs(temperatures)
    return sampling_kernel.sample(logits, torch.tensor(inv_temp, device=logits.device),
                                  torch.tensor(noise, dtype=torch.int8, device=logits.device), seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_kernel_draws_from_the_scaled_softmax_and_reports_its_logprob(dtype):
    vocab, rows, temperature = 3000, 40000, 0.7
    head = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    logits = torch.full((vocab,), -6.0)
    logits[:6] = head
    logits = logits.to(dtype).cuda()
    batch = logits.repeat(rows, 1)
    tokens, logprobs = kernel_sample(batch, [temperature] * rows, seed=123)
    full = (logits.float() / temperature).log_softmax(-1)
    torch.testing.assert_close(logprobs, full[tokens.long()], atol=2e-6, rtol=0)
    counts = torch.bincount(tokens.long(), minlength=vocab).float() / rows
    expected = full.exp()
    assert (counts[:6] - expected[:6]).abs().max().item() < 0.01
    assert abs(counts[6:].sum().item() - expected[6:].sum().item()) < 0.01  # the tail is drawn too
    again, _ = kernel_sample(batch, [temperature] * rows, seed=123)
    other, _ = kernel_sample(batch, [temperature] * rows, seed=124)
    assert torch.equal(tokens, again) and not torch.equal(tokens, other)


def test_sampling_kernel_greedy_rows_take_the_argmax_with_the_t1_logprob():
    logits = torch.randn(8, 151936, device="cuda")
    temps = [0.0, 1.0] * 4
    tokens, logprobs = kernel_sample(logits, temps, seed=0)
    greedy = logits.argmax(-1)
    assert torch.equal(tokens[0::2].long(), greedy[0::2])
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(-1, tokens.long()[:, None])[:, 0], atol=1e-5, rtol=0)
