"""Group-relative advantages: a rollout is judged against the other rollouts of its task.

advantage_i = shaped_i - mean(shaped), shaped_i = reward_i - length_penalty * tokens_i / max_tokens,
optionally divided by the group's standard deviation. A group where every advantage is zero
gives no gradient; the orchestrator filters it (`advantage.filter_zero_groups`).
"""

from __future__ import annotations

import math

from tandem.config.orchestrator import AdvantageConfig

ZERO_TOLERANCE = 1e-8
"""Advantages smaller than this in magnitude count as zero (float noise of equal rewards)."""


def group_advantages(rewards: list[float], completion_tokens: list[int], config: AdvantageConfig,
                     max_tokens: int) -> list[float]:
    """One advantage per rollout of a group, in order."""
    if not rewards:
        return []
    shaped = [r - config.length_penalty * n / max_tokens for r, n in zip(rewards, completion_tokens, strict=True)]
    mean = sum(shaped) / len(shaped)
    advantages = [s - mean for s in shaped]
    if config.std_normalize:
        std = math.sqrt(sum(a * a for a in advantages) / len(advantages))
        if std > ZERO_TOLERANCE:
            advantages = [a / std for a in advantages]
    return advantages


def is_zero_signal(advantages: list[float]) -> bool:
    """True when no rollout of the group would be pushed up or down."""
    return all(abs(a) < ZERO_TOLERANCE for a in advantages)
