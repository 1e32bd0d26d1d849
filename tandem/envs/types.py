"""Shapes shared by environments, parsers and rubrics.

Messages are plain OpenAI chat dicts (`{"role": ..., "content": ...}`, plus `tool_calls` on
assistant turns and `tool_call_id` on tool turns) so they go to any OpenAI-shaped client
unchanged.
"""

from dataclasses import dataclass, field
from typing import Any, TypedDict

ChatMessage = dict[str, Any]
Messages = list[ChatMessage]
Info = dict[str, Any]

State = dict[str, Any]
"""Per-rollout record. Always holds `prompt`, `completion`, `answer`, `task`, `info`,
`turn` (model calls made), `responses` (the raw client response of each turn, in order) and
`stop_reason` (see `StopReason`); environments add their own keys."""


class StopReason:
    """Values of `state["stop_reason"]`."""

    COMPLETED = "completed"
    """The environment's `is_completed` returned True."""
    MAX_TURNS = "max_turns"
    """The model was called `max_turns` times."""
    LENGTH = "length"
    """The model's last answer was cut by its token limit (`finish_reason == "length"`)."""


class Example(TypedDict):
    """One dataset row, ready for `Environment.rollout`."""

    prompt: Messages
    answer: str
    task: str
    info: Info


@dataclass
class RolloutScore:
    """What a rubric says about one rollout."""

    reward: float
    """Weighted sum of the reward functions."""
    metrics: dict[str, float]
    """Every reward function's unweighted score, by function name (zero-weight ones included)."""
    errors: list[str] = field(default_factory=list)
    """`"<function name>: <ExceptionType>: <message>"` per function that failed (it scored 0)."""
