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

import random
from dataclasses import dataclass

import torch

from tandem.inference.engine import sampling_kernel
from tandem.inference.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    """Per row, the `num_top_logprobs` most likely (token, logprob) pairs; empty when not asked."""


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Set to -inf what top-k (<= 0 off), top-p and min-p exclude, per row; the top token always stays.

    The settings are host lists, so deciding which filters run needs no device sync.
    """
    device = logits.device
    if any(m > 0 for m in min_p):
        probs = logits.softmax(-1)
        floor = torch.tensor(min_p, device=device)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    use_k, use_p = any(k > 0 for k in top_k), any(p < 1 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    if use_k:
        k = torch.tensor([k if k > 0 else logits.shape[-1] for k in top_k], device=device)
        ranks = torch.arange(logits.shape[-1], device=device)
        sorted_logits = sorted_logits.masked_fill(ranks[None] >= k[:, None], float("-inf"))
    if use_p:
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        sorted_logits = sorted_logits.masked_fill(before > torch.tensor(top_p, device=device)[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs as host lists, in one transfer (float64 holds every id exactly)."""
    token_ids, values = torch.stack([tokens.double(), logprobs.double()]).tolist()
    return [int(t) for t in token_ids], values


class Sampler:
    """Sampling on the device; the host reads the step's tokens and logprobs in one transfer.

    On CUDA, batches whose rows need no filter, own seed or top logprobs (the RL case) go through
    one Triton kernel (`sampling_kernel.py`); the others through the torch path below.
    """

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        """Draws the noise of sequences without a seed of their own."""
        self.kernel_seeds = random.Random(seed)
        """One Philox seed per step of the kernel path, drawn on the host (no device sync)."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits [B, V] (float32, or the model's dtype), one row per sequence."""
        temps = [s.params.temperature for s in seqs]
        if sampling_kernel.is_available(logits) and all(
                s.generator is None and not s.params.needs_filtering and s.params.num_top_logprobs == 0 for s in seqs):
            tokens, chosen = sampling_kernel.sample(logits, temps, self.kernel_seeds.getrandbits(31))
            return SampleResult(*_to_host(tokens, chosen), [[] for _ in seqs])
        logits = logits.float()
        num_greedy = sum(t == 0 for t in temps)
        if any(t not in (0, 1) for t in temps):
            scale = torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits.device)
            logprobs = (logits / scale[:, None]).log_softmax(-1)
        else:
            logprobs = logits.log_softmax(-1)
        if num_greedy == len(seqs):
            tokens = logits.argmax(-1)
        else:
            tokens = self._draw(logprobs, seqs)
            if num_greedy:
                greedy = torch.tensor([t == 0 for t in temps], device=logits.device)
                tokens = torch.where(greedy, logits.argmax(-1), tokens)
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
        return SampleResult(*_to_host(tokens, chosen), self._top_logprobs(logprobs, seqs))

    def _draw(self, logprobs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        if any(p.needs_filtering for p in params):
            logprobs = filter_logits(
                logprobs,
                [p.top_k if p.needs_filtering else -1 for p in params],
                [p.top_p if p.needs_filtering else 1.0 for p in params],
                [p.min_p if p.needs_filtering else 0.0 for p in params],
            )
        # The race only compares p / E within a row, so the filtered mass needs no renormalizing.
        probs = logprobs.exp()
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
