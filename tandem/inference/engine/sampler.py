"""Pick the next token of each sequence and report its logprob.

The reported logprob is log_softmax(logits / T) over the full vocabulary at the sampled token:
the temperature-scaled distribution before top-k / top-p / min-p, which is what the trainer
recomputes (it divides its logits by the same T). Filters only decide which tokens may be drawn.
Greedy rows (T = 0) take the argmax and report the T = 1 logprob.

Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which draws exactly from p and
lets each seeded sequence draw its noise from its own generator, so a seeded request gives the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.inference.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    """Per row, the `num_top_logprobs` most likely (token, logprob) pairs; empty when not asked."""


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf what top-k ([B], <= 0 off), top-p and min-p ([B]) exclude; the top token always stays."""
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1).any())
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    if use_k:
        k = torch.where(top_k > 0, top_k, logits.shape[-1])
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None] >= k[:, None], float("-inf"))
    if use_p:
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        sorted_logits = sorted_logits.masked_fill(before > top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        """Draws the noise of sequences without a seed of their own."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits [B, V] float32, one row per sequence."""
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        greedy = temps == 0
        logprobs = (logits / torch.where(greedy, 1.0, temps)[:, None]).log_softmax(-1)
        tokens = logits.argmax(-1)
        if not bool(greedy.all()):
            tokens = torch.where(greedy, tokens, self._draw(logprobs, seqs))
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
        top = self._top_logprobs(logprobs, seqs)
        return SampleResult(tokens.tolist(), chosen.tolist(), top)

    def _draw(self, logprobs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        if any(p.needs_filtering for p in params):
            logprobs = filter_logits(
                logprobs,
                torch.tensor([p.top_k if p.needs_filtering else -1 for p in params], device=logprobs.device),
                torch.tensor([p.top_p if p.needs_filtering else 1.0 for p in params], device=logprobs.device),
                torch.tensor([p.min_p if p.needs_filtering else 0.0 for p in params], device=logprobs.device),
            )
        probs = logprobs.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[i].exponential_(generator=seq.generator)
        return (probs / noise).argmax(-1)

    def _top_logprobs(self, logprobs: torch.Tensor, seqs: list[Sequence]) -> list[list[tuple[int, float]]]:
        k = max(s.params.num_top_logprobs for s in seqs)
        if k == 0:
            return [[] for _ in seqs]
        values, ids = logprobs.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        return [list(zip(ids[i][:s.params.num_top_logprobs], values[i][:s.params.num_top_logprobs])) for i, s in enumerate(seqs)]
