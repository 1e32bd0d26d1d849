"""From the model turns of one rollout to training samples, keeping the exact sampled tokens.

Invariant: a sample is one token sequence in which every model turn's completion appears exactly
as sampled (loss tokens) and every other token (prompts, environment replies, chat-template
glue) is context (no loss). Turn k+1 joins the sample of turn k when its prompt starts with that
sample's tokens (the re-rendered conversation reproduced them); otherwise it starts a new sample,
because training on a re-tokenized copy of the model's output would train on tokens it never
sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field


NO_EXPERTS: tuple = ()
"""A token's routed experts where none are known: one shared immutable object, not a new list per token (a list
for every token of every rollout is a share of the orchestrator's CPU:
`benchmarks/results/rl-loop-h100-2026-12-05.json`). Encoded like an empty list."""


@dataclass
class Turn:
    """One model call as the inference server answered it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    """Oldest policy version that sampled any of the completion's tokens."""
    temperature: float
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    """Per completion token, [MoE layer][k] the experts that sampled it; empty when not asked."""
    drafts: tuple[int, int] | None = None
    """(drafted, accepted): the tokens a speculating server drafted for this completion and those the policy
    accepted; None when the server does not say (no speculation, or a backend that does not count per request)."""


@dataclass
class Sample:
    """One training sequence; position t describes token `token_ids[t]` (see transport/types.py)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Policy version of each model turn in this sample."""
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    """Per token t, the experts of the forward at t that sampled token t + 1 (`NO_EXPERTS` where unknown)."""
    advantage: float = 0.0
    """The rollout's advantage, given to every loss token."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def oldest_version(self) -> int:
        return min(self.versions)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def _extend(self, ids: list[int], is_loss: bool, logprobs: list[float] | None, temperature: float) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([int(is_loss)] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.temperatures.extend([temperature] * len(ids))
        self.routed_experts.extend([NO_EXPERTS] * len(ids))

    @property
    def has_routed_experts(self) -> bool:
        return any(self.routed_experts)


def build_samples(turns: list[Turn]) -> list[Sample]:
    """Merge consecutive turns into samples while each prompt extends the previous sample."""
    samples: list[Sample] = []
    for turn in turns:
        if len(turn.logprobs) != len(turn.completion_ids):
            raise ValueError(
                f"server returned {len(turn.logprobs)} logprobs for {len(turn.completion_ids)} completion tokens"
            )
        current = samples[-1] if samples else None
        if current is None or turn.prompt_ids[: len(current)] != current.token_ids:
            current = Sample()
            samples.append(current)
        current._extend(turn.prompt_ids[len(current):], False, None, turn.temperature)
        start = len(current)
        current._extend(turn.completion_ids, True, turn.logprobs, turn.temperature)
        # Completion token j was sampled by the forward at the position before it.
        current.routed_experts[start - 1:start - 1 + len(turn.routed_experts)] = turn.routed_experts
        current.versions.append(turn.version)
    return samples
