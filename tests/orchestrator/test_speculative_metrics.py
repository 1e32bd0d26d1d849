"""A step's record of speculative decoding, from the answers' `usage.completion_tokens_details` to the step line."""

from __future__ import annotations

import pytest

from tandem.orchestrator.chat_client import drafts_of
from tandem.orchestrator.rollout import RolloutResult
from tandem.orchestrator.samples import Turn
from tandem.orchestrator.step_metrics import speculative_metrics


def rollout(*turns: tuple[int, tuple[int, int] | None]) -> RolloutResult:
    """A rollout of turns given as (completion length, drafts)."""
    return RolloutResult(env="e", example={}, samples=[],
                         turns=[Turn([1], [2] * length, [0.0] * length, 0, 1.0, drafts=drafts) for length, drafts in turns])


def test_an_answers_details_give_drafted_and_accepted_tokens_and_other_answers_none():
    details = {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 2}
    assert drafts_of({"prompt_tokens": 4, "completion_tokens": 9, "completion_tokens_details": details}) == (5, 3)
    assert drafts_of({"completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}) == (0, 0)
    assert drafts_of({"completion_tokens_details": {"reasoning_tokens": 7}}) is None  # a server that drafts nothing
    assert drafts_of({"prompt_tokens": 4, "completion_tokens": 9}) is None
    assert drafts_of(None) is None  # vLLM's token route answers without usage


def test_the_step_counts_drafts_over_the_rollouts_whose_servers_counted_them():
    counted = rollout((30, (10, 4)), (10, (6, 6)))
    assert counted.drafts == (16, 10)
    assert rollout((20, None)).drafts is None
    metrics = speculative_metrics([counted, rollout((20, None))])
    assert metrics == {"speculative/draft_tokens": 16, "speculative/accepted_tokens": 10,
                       "speculative/acceptance": pytest.approx(10 / 16), "speculative/accepted_per_token": pytest.approx(10 / 40)}
    assert speculative_metrics([rollout((20, None)), rollout()]) == {}  # no speculation: no such metrics
    assert speculative_metrics([rollout((5, (0, 0)))])["speculative/acceptance"] == 0.0  # nothing drafted this step
