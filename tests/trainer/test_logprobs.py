"""Logprobs: chunked == full logits, packed == separate sequences, native and transformers fallback."""

from __future__ import annotations

import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.config.trainer import ParallelConfig
from tandem.trainer.logprobs import add_product, token_logprobs
from tandem.trainer.model import build_policy
from tandem.trainer.parallel.dims import close_parallel, init_parallel


def full_logits_reference(hidden, weight, targets, temperatures, bias=None):
    logits = hidden @ weight.T + (0 if bias is None else bias)
    logp = torch.log_softmax(logits.double() / temperatures.double()[:, None], dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_logprobs_equal_full_logits_in_value_and_gradient(chunk_size):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(300, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(300, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (50,), generator=gen)
    temperatures = torch.rand(50, generator=gen, dtype=torch.float64) + 0.5
    upstream = torch.randn(50, generator=gen, dtype=torch.float64)

    lp, ent = token_logprobs(hidden, weight, bias, targets, temperatures, chunk_size)
    grads = torch.autograd.grad((lp * upstream).sum(), [hidden, weight, bias])
    ref_lp, ref_ent = full_logits_reference(hidden, weight, targets, temperatures, bias)
    ref_grads = torch.autograd.grad((ref_lp * upstream).sum(), [hidden, weight, bias])

    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_head_grad_is_the_fp32_heads_on_cuda():
    """A bf16 head's weight gradient, its 8 chunks summed in fp32, is the fp32 head's within bf16 noise: rounding
    hidden states and weights to bf16 moves the logits, hence the softmax, so the whole gradient is off by about 1%
    (0.99-1.00% on an H100, with either way of summing the chunks; the largest entry's error 1.2% of the largest)."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = (torch.randn(*shape, generator=gen).cuda() for shape in ((512, 64), (1000, 64)))
    targets = torch.randint(0, 1000, (512,), generator=gen).cuda()
    temperatures, upstream = torch.ones(512, device="cuda"), torch.randn(512, generator=gen).cuda()
    grads = []
    for dtype in (torch.bfloat16, torch.float32):
        w = weight.to(dtype).requires_grad_()
        lp, _ = token_logprobs(hidden.to(dtype), w, None, targets, temperatures, chunk_size=64)
        grads.append(torch.autograd.grad((lp * upstream).sum(), w)[0].float())
    bf16, fp32 = grads
    assert (bf16 - fp32).norm() < 3e-2 * fp32.norm()
    assert (bf16 - fp32).abs().max() < 3e-2 * fp32.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_head_weight_gradient_sums_each_chunk_in_fp32_on_cuda():
    """`add_product` sums bf16 products into an fp32 total unrounded: closer to the exact sum than adding each
    product rounded to bf16, and equal to the fp32 product of the bf16 inputs."""
    gen = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(256, 512, generator=gen).bfloat16().cuda(), torch.randn(512, 128, generator=gen).bfloat16().cuda())
              for _ in range(8)]
    exact = sum(a.double() @ b.double() for a, b in chunks)
    fused, rounded = (torch.zeros(256, 128, device="cuda") for _ in range(2))
    for a, b in chunks:
        add_product(fused, a, b)
        rounded += a @ b
    assert (fused.double() - exact).abs().max() < (rounded.double() - exact).abs().max() / 10
    torch.testing.assert_close(fused, sum(a.float() @ b.float() for a, b in chunks), rtol=1e-5, atol=1e-4)


def test_compiled_head_equals_the_eager_one(monkeypatch):
    """The compiled chunk kernels, traced with `aot_eager` (Dynamo and AOTAutograd, no code generation)."""
    from tandem.trainer import dynamic_compile

    monkeypatch.setattr(dynamic_compile, "BACKEND", "aot_eager")
    dynamic_compile.compiled.cache_clear()
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(300, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (40,), generator=gen)
    temperatures = torch.rand(40, generator=gen, dtype=torch.float64) + 0.5
    results = []
    for compile in (False, True):
        lp, ent = token_logprobs(hidden, weight, None, targets, temperatures, 16, compile=compile)
        results.append((lp, ent, *torch.autograd.grad(lp.sum(), [hidden, weight])))
    dynamic_compile.compiled.cache_clear()
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=1e-10, atol=1e-10)


def test_chunks_checkpoint_the_logits():
    """The forward keeps no [tokens x vocab] tensor alive: only inputs are saved per chunk."""
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_logprobs(hidden, weight, None, torch.zeros(64, dtype=torch.long), torch.ones(64), chunk_size=16)
    assert max(saved) < 16 * 1000  # the largest saved tensor is smaller than one chunk's logits
    lp.sum().backward()
    assert hidden.grad is not None and weight.grad is not None


@pytest.fixture
def world_of_one():
    dims = init_parallel("cpu")
    yield dims
    close_parallel()


@pytest.mark.parametrize("model_fixture", ["tiny_model", "llama_model"])
def test_packed_rows_give_the_logprobs_of_separate_sequences(model_fixture, request, world_of_one):
    folder = request.getfixturevalue(model_fixture)
    policy, hf_config = build_policy(ModelConfig(name=str(folder)), ParallelConfig(), world_of_one, chunk_size=5)
    vocab = hf_config["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    lengths = [9, 4, 12]
    seqs = [torch.randint(0, vocab, (1, n), generator=gen) for n in lengths]
    temps = [torch.full((1, n), t) for n, t in zip(lengths, [1.0, 0.5, 1.3])]

    def run(ids, temperatures):
        pos = torch.cat([torch.arange(n) for n in [s.shape[1] for s in ids]])[None]
        cat_ids = torch.cat(ids, dim=1)
        mask = torch.ones_like(cat_ids, dtype=torch.bool)
        mask[0, pos[0] == 0] = False
        with torch.no_grad():
            return policy(cat_ids, pos, torch.cat(temperatures, dim=1), mask)

    packed = run(seqs, temps)
    offset = 0
    for seq, temp in zip(seqs, temps):
        alone = run([seq], [temp])
        n = seq.shape[1]
        torch.testing.assert_close(packed.logprobs[:, offset:offset + n], alone.logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.entropy[:, offset:offset + n], alone.entropy, rtol=1e-5, atol=1e-5)
        offset += n
    assert (packed.logprobs[0, 1:9] < 0).all() and packed.logprobs[0, 0] == 0 and packed.logprobs[0, 9] == 0


def test_logprobs_match_transformers_logits(tiny_model, world_of_one):
    """The trainer's logprob of token t is log_softmax(logits[t-1] / T)[token t], as the sampler reports it."""
    from transformers import AutoModelForCausalLM

    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), world_of_one, chunk_size=3)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.randint(0, 260, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0, :-1] / 0.8, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[0, 0] = False
        out = policy(ids, torch.arange(12)[None], torch.full((1, 12), 0.8), mask)
    torch.testing.assert_close(out.logprobs[0, 1:], ref, rtol=1e-5, atol=1e-5)


def test_temperatures_reach_the_head_in_fp32_under_bf16_compute(tiny_model, world_of_one, monkeypatch):
    """FSDP must not cast the root's inputs to the compute dtype: 0.7 in bf16 is 0.69921875."""
    import tandem.trainer.model as model_module

    seen = []

    def spy(hidden, weight, bias, targets, temperatures, *args):
        seen.append(temperatures)
        return token_logprobs(hidden, weight, bias, targets, temperatures, *args)

    monkeypatch.setattr(model_module, "token_logprobs", spy)
    policy, _ = build_policy(ModelConfig(name=str(tiny_model), dtype="bfloat16"), ParallelConfig(), world_of_one, chunk_size=4)
    ids = torch.randint(0, 260, (1, 6))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 0] = False
    with torch.no_grad():
        policy(ids, torch.arange(6)[None], torch.full((1, 6), 0.7), mask)
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], torch.full((5,), 0.7))


@pytest.mark.parametrize("samples", [[(3, 5), (2, 9)], [(6, 0)]], ids=["packed", "no-loss-tokens"])
def test_host_positions_select_what_the_loss_mask_selects_without_a_sync(tiny_model, world_of_one, samples):
    """`MicroBatch.predicting_positions` (from the host's loss mask) gives bitwise the logprobs, entropies and
    gradients of the positions the model finds on the device from `loss_mask`."""
    from trainer_helpers import random_row

    from tandem.trainer.micro_batch import MicroBatch

    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), world_of_one, chunk_size=4)
    mb = MicroBatch.from_row(random_row(torch.Generator().manual_seed(3), samples), world_of_one.device)
    expected = [t for t in range(mb.num_tokens - 1) if mb.loss_mask[0, t + 1]] or [0]
    assert mb.predicting_positions.tolist() == expected

    def run(positions):
        policy.zero_grad(set_to_none=True)
        out = policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask, mb.row_document_lengths, None, positions)
        (out.logprobs * torch.linspace(-1, 1, mb.num_tokens)).sum().backward()
        grads = {name: p.grad.clone() for name, p in policy.hf_named_parameters()}
        return out.logprobs.detach(), out.entropy, grads

    host, device = run(mb.predicting_positions), run(None)
    assert torch.equal(host[0], device[0]) and torch.equal(host[1], device[1])
    assert all(torch.equal(host[2][name], device[2][name]) for name in host[2])
    computed = torch.zeros_like(mb.loss_mask)  # the loss tokens, or token 1 alone (every parameter in backward)
    computed[0, [t + 1 for t in expected]] = True
    assert torch.equal(host[0] != 0, computed)
