"""Log-probabilities and entropies of target tokens, without the full logits.

`token_logprobs` is the one function through which the trainer turns hidden states into the
logprobs it trains on. It is one autograd function with its own backward that walks the tokens
in chunks of `chunk_size`:
- forward: per chunk, the logits (a matmul in the compute dtype), then in fp32 the log-sum-exp,
  the target's logprob and the entropy; it keeps only the inputs and one fp32 log-sum-exp per
  token;
- backward: per chunk, the logits again, then d logprob / d logits = (onehot(target) - softmax)
  / T, cast to the compute dtype for the two matmuls (grad of hidden, grad of the weight, the
  latter accumulated over chunks in fp32 by the matmul itself: `add_product`).
So no [tokens x vocab] tensor outlives its chunk, in forward or backward, and a chunk holds its
logits once in the compute dtype plus, without compilation, a few fp32 copies. With
`compile`, each chunk's fp32 work is one fused kernel (`tandem.trainer.dynamic_compile`) that reads
the logits once or twice instead of a dozen eager passes over [chunk x vocab] fp32 tensors.

Temperature is applied as the inference server's sampler applies it: log_softmax(logits / T)
over the full vocabulary, no top-k or top-p renormalization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.trainer.dynamic_compile import compiled, mark_dynamic


def chunk_statistics(logits: torch.Tensor, inv_temperature: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [C, V] -> (logprob of each target, entropy, log-sum-exp) [C], fp32, of logits / T."""
    z = logits.float() * inv_temperature[:, None]
    lse = torch.logsumexp(z, dim=-1)
    logp = z - lse[:, None]
    picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(torch.exp(logp) * logp).sum(-1)
    return picked, entropy, lse


def chunk_logit_grad(logits: torch.Tensor, inv_temperature: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                     grad_logprob: torch.Tensor) -> torch.Tensor:
    """d loss / d logits [C, V] in the logits' dtype, from d loss / d logprob [C]."""
    z = logits.float() * inv_temperature[:, None]
    probs = torch.exp(z - lse[:, None])
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
    return ((onehot.float() - probs) * (grad_logprob * inv_temperature)[:, None]).to(logits.dtype)


def add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b. A bf16 product summed into an fp32 total on CUDA is one matmul that accumulates in fp32
    and adds the total in its epilogue: no rounded [V, H] product, no separate pass over the fp32 total, whose
    adds cost a long step a percent or two (`benchmarks/results/trainer-h100-2026-12-05-guard-addmm.json`).
    Elsewhere (no such matmul on a CPU; one dtype) a product, then an add."""
    if total.is_cuda and total.dtype != a.dtype:
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total += a @ b


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temperature, chunk_size, compile):
        stats = compiled(chunk_statistics) if compile else chunk_statistics
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            chunk = (F.linear(hidden[start:end], weight, bias), inv_temperature[start:end], targets[start:end])
            if compile:
                mark_dynamic(0, *chunk)
            logprobs[start:end], entropy[start:end], lse[start:end] = stats(*chunk)
        ctx.save_for_backward(hidden, weight, bias, targets, inv_temperature, lse)
        ctx.chunk_size, ctx.compile = chunk_size, compile
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, bias, targets, inv_temperature, lse = ctx.saved_tensors
        grad = compiled(chunk_logit_grad) if ctx.compile else chunk_logit_grad
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        accumulate = torch.promote_types(weight.dtype, torch.float32)  # a bf16 weight's grad sums in fp32
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if need_bias else None
        grad_logprobs = grad_logprobs.float()
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            chunk = (F.linear(h, weight, bias), inv_temperature[start:end], targets[start:end], lse[start:end],
                     grad_logprobs[start:end])
            if ctx.compile:
                mark_dynamic(0, *chunk)
            d_logits = grad(*chunk)
            if need_hidden:
                torch.mm(d_logits, weight, out=grad_hidden[start:end])
            if need_weight:
                add_product(grad_weight, d_logits.t(), h)
            if need_bias:
                grad_bias += d_logits.sum(0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                   temperatures: torch.Tensor, chunk_size: int, compile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], targets and temperatures [N] -> (logprob of each target, entropy) [N], fp32.

    The entropy (of the tempered distribution) is for logging and carries no gradient.
    """
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    inv_temperature = temperatures.float().reciprocal()
    return _ChunkedLogprobs.apply(hidden, weight, bias, targets, inv_temperature, chunk_size, compile)
