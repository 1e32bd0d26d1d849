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

from tandem.kernels import sampling as sampling_kernel
from tandem.inference.engine.host_copies import HostRead, to_device
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.sequence import Sequence
from tandem.models.exact import exact_log_softmax


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]]
    """Per row, the `num_top_logprobs` most likely (token, logprob) pairs; empty when not asked."""
    accepted_drafts: list[list[tuple[int, float, tuple[tuple[int, float], ...]]]] | None = None
    """Steps that verify drafts: per row, the drafted tokens the policy accepted, which come before
    `token_ids[row]`, as (token, logprob, top logprobs)."""


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Set to -inf what top-k (<= 0 off), top-p and min-p exclude, per row; the top token always stays.

    The settings are host lists, so deciding which filters run needs no device sync.
    """
    device = logits.device
    if any(m > 0 for m in min_p):
        probs = logits.softmax(-1)
        floor = to_device(min_p, torch.float32, device)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    use_k, use_p = any(k > 0 for k in top_k), any(p < 1 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    if use_k:
        k = to_device([k if k > 0 else logits.shape[-1] for k in top_k], torch.long, device)
        ranks = torch.arange(logits.shape[-1], device=device)
        sorted_logits = sorted_logits.masked_fill(ranks[None] >= k[:, None], float("-inf"))
    if use_p:
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        sorted_logits = sorted_logits.masked_fill(before > to_device(top_p, torch.float32, device)[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def temperature_scales(temps: list[float], device: torch.device) -> torch.Tensor:
    """What each row's logits are divided by: its temperature, 1 for greedy rows (T = 0), [B] fp32."""
    return to_device([t if t > 0 else 1.0 for t in temps], torch.float32, device)


class PendingSample:
    """A step's draws: `tokens` [S] (int64) stays on the device, where the next step reads its input ids;
    the ids, logprobs and top logprobs travel to the host meanwhile and `result()` waits for them."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None,
                 num_top: list[int]):
        self.tokens = tokens
        # float64 holds every token id exactly, so ids and logprobs share one copy.
        self._read = HostRead([torch.stack([tokens.double(), logprobs.double()]), *(top or ())])
        self._num_top = num_top

    def result(self) -> SampleResult:
        host = self._read.values()
        token_ids, values = host[0].tolist()
        # Tuples: the empty one is shared, so the usual case allocates nothing per token for the collector to scan.
        top: list[tuple[tuple[int, float], ...]] = [()] * len(self._num_top)
        if len(host) == 3:
            top_values, top_ids = host[1].tolist(), host[2].tolist()
            top = [tuple(zip(top_ids[i][:k], top_values[i][:k])) for i, k in enumerate(self._num_top)]
        return SampleResult([int(t) for t in token_ids], values, top)


class Sampler:
    """Sampling on the device, never waiting for it; the host reads the step's results in one transfer.

    On CUDA, batches whose rows need no filter, own seed or top logprobs (the RL case) go through
    one Triton kernel (`tandem/kernels/sampling.py`); the others through the torch path below.
    """

    def __init__(self, device: torch.device, seed: int, exact: bool = False):
        """`exact`: the reported logprobs through `tandem.models.exact.exact_log_softmax`, the trainer's function in
        exact mode (the fused kernel may still draw the tokens: which token is drawn needs no parity)."""
        self.device = device
        self.exact = exact
        self.generator = torch.Generator(device=device).manual_seed(seed)
        """Draws the noise of sequences without a seed of their own."""
        self.kernel_seeds = random.Random(seed)
        """One Philox seed per step of the kernel path, drawn on the host (no device sync)."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """logits [B, V] (float32, or the model's dtype), one row per sequence."""
        temps = [s.params.temperature for s in seqs]
        num_top = [s.params.num_top_logprobs for s in seqs]
        if sampling_kernel.is_available(logits) and all(
                s.generator is None and not s.params.needs_filtering and k == 0 for s, k in zip(seqs, num_top)):
            inv_temp, noise = sampling_kernel.sampling_inputs(temps)
            tokens, chosen = sampling_kernel.sample(logits, to_device(inv_temp, torch.float32, logits.device),
                                                    to_device(noise, torch.int8, logits.device), self.kernel_seeds.getrandbits(31))
            if self.exact:
                chosen = self._exact_logprobs(logits, temps).gather(-1, tokens[:, None])[:, 0]
            return PendingSample(tokens, chosen, None, num_top)
        logits = logits.float()
        num_greedy = sum(t == 0 for t in temps)
        logprobs = self.reported_logprobs(logits, temps)
        if num_greedy == len(seqs):
            tokens = logits.argmax(-1)
        else:
            tokens = self._draw(logprobs, seqs)
            if num_greedy:
                greedy = to_device([t == 0 for t in temps], torch.bool, logits.device)
                tokens = torch.where(greedy, logits.argmax(-1), tokens)
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
        top = logprobs.topk(max(num_top), dim=-1) if max(num_top) > 0 else None
        return PendingSample(tokens, chosen, top, num_top)

    def reported_logprobs(self, logits: torch.Tensor, temps: list[float]) -> torch.Tensor:
        """log_softmax(logits / T) [B, V] fp32 of float32 logits: what each row reports (greedy rows at T = 1)."""
        if self.exact:
            return self._exact_logprobs(logits, temps)
        if any(t not in (0, 1) for t in temps):
            return (logits / temperature_scales(temps, logits.device)[:, None]).log_softmax(-1)
        return logits.log_softmax(-1)

    def _exact_logprobs(self, logits: torch.Tensor, temps: list[float]) -> torch.Tensor:
        """log_softmax(logits / T) [B, V] fp32 as the exact trainer computes it (greedy rows at T = 1)."""
        return exact_log_softmax(logits, temperature_scales(temps, logits.device))

    def _draw(self, logprobs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        noise = torch.empty_like(logprobs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[i].exponential_(generator=seq.generator)
        return race(filter_logprobs(logprobs, [s.params for s in seqs]), noise)


def filter_logprobs(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The rows' top-k / top-p / min-p applied (-inf where cut), unnormalized; rows that filter nothing unchanged."""
    if not any(p.needs_filtering for p in params):
        return logprobs
    return filter_logits(
        logprobs,
        [p.top_k if p.needs_filtering else -1 for p in params],
        [p.top_p if p.needs_filtering else 1.0 for p in params],
        [p.min_p if p.needs_filtering else 0.0 for p in params],
    )


def race(logprobs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per row, the token of the exponential race: argmax of p / E, a draw from p for E ~ Exp(1) ([B] int64).

    The race only compares p / E within a row, so `logprobs` need not be normalized (a filtered row's
    leftover mass, a residual distribution)."""
    return (logprobs.exp() / noise).argmax(-1)
