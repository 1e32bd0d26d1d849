"""The sampling kernel (`tandem.kernels.sampling`) on CUDA: its draws follow softmax(logits / T), the law the
sampler's torch path draws from (`tests/inference/test_sampler.py`), it reports each drawn token's logprob
under that softmax, and greedy rows take the argmax with the T = 1 logprob, as the torch path does."""

import pytest
import torch

from tandem.kernels import sampling as sampling_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def kernel_sample(logits: torch.Tensor, temperatures: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's tokens and logprobs of rows at these temperatures (inputs made by `sampling_inputs`)."""
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
