"""Log-probabilities and entropies of target tokens, without the full logits.

`token_logprobs` is the one function through which the trainer turns hidden states into the
logprobs it trains on; a fused LM-head kernel with its own backward replaces its body later.
Today it walks the tokens in chunks and checkpoints each chunk: the forward keeps only the chunk's
inputs, and the backward recomputes one chunk's logits at a time, so the fp32 [tokens x vocab]
logits never exist at once, in forward or in backward.

Temperature is applied as the inference server's sampler applies it: log_softmax(logits / T)
over the full vocabulary, no top-k or top-p renormalization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                   temperatures: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], targets and temperatures [N] -> (logprob of each target, entropy) [N], fp32.

    The entropy (of the tempered distribution) is for logging and carries no gradient.
    """
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        lp, ent = checkpoint(_chunk, hidden[start:end], weight, bias, targets[start:end], temperatures[start:end], use_reentrant=False)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float() / temperatures.float()[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy
