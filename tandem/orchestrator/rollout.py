"""Running one rollout, or one group of rollouts of the same task, and scoring them.

Invariant: `run_rollout` never raises for a failure of the environment, the rubric or the
inference servers (only for cancellation): it returns a `RolloutResult` with `error` set, and
the caller excludes it. A rollout counts as failed too when it made no model turn, since it has
nothing to train on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from tandem.config.orchestrator import AdvantageConfig
from tandem.orchestrator.advantages import group_advantages, is_zero_signal
from tandem.orchestrator.chat_client import TokenChatClient
from tandem.orchestrator.environments import LoadedEnv
from tandem.orchestrator.inference_pool import InferencePool
from tandem.orchestrator.samples import Sample, Turn, build_samples

log = logging.getLogger("tandem.orchestrator")


@dataclass
class RolloutContext:
    """What every rollout of a run shares."""

    pool: InferencePool
    tokenizer: Any
    model: str
    """Model name sent to the servers (they serve one model and ignore it)."""
    seq_len: int
    """Longest episode, prompt and completions: a training row's `seq_len`, or the servers' context when
    shorter (`episode_limit`); a turn that would pass it is cut, the episode ends as `length`."""
    return_routed_experts: bool = False
    """Ask the servers for each sampled token's experts (`sampling.return_routed_experts`)."""


@dataclass
class RolloutResult:
    env: str
    example: dict[str, Any]
    turns: list[Turn]
    samples: list[Sample]
    completion: list[dict[str, Any]] | None = None
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    reward_errors: list[str] = field(default_factory=list)
    """Reward functions that raised (they scored 0)."""
    stop_reason: str | None = None
    error: str | None = None
    """Why the rollout failed; None when it succeeded."""
    advantage: float = 0.0
    inference_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def drafts(self) -> tuple[int, int] | None:
        """(drafted, accepted) over the turns whose server counted them (speculative decoding); None if none did."""
        counted = [t.drafts for t in self.turns if t.drafts is not None]
        return (sum(d for d, _ in counted), sum(a for _, a in counted)) if counted else None


@dataclass
class GroupResult:
    env: str
    step: int
    rollouts: list[RolloutResult]

    @property
    def succeeded(self) -> list[RolloutResult]:
        return [r for r in self.rollouts if not r.failed]

    @property
    def is_zero_signal(self) -> bool:
        return is_zero_signal([r.advantage for r in self.succeeded])


async def episode_limit(pool: InferencePool, seq_len: int) -> int:
    """`seq_len`, or the servers' `max_model_len` when it is shorter: an episode must fit both a training
    row and the server's context, which refuses a longer request (HTTP 400) and would fail the rollout."""
    served = await pool.max_model_len()
    if served is None or served >= seq_len:
        return seq_len
    log.warning("`seq_len` = %d is longer than the inference servers' context (max_model_len %d, by default the "
                "model's max_position_embeddings): episodes end at %d tokens", seq_len, served, served)
    return served


async def run_rollout(ctx: RolloutContext, env: LoadedEnv, example: dict[str, Any], server: int,
                      sampling_args: dict[str, Any]) -> RolloutResult:
    client = TokenChatClient(ctx.pool, ctx.tokenizer, server, ctx.seq_len, ctx.return_routed_experts)
    result = RolloutResult(env=env.name, example=example, turns=client.turns, samples=[])
    prompt, answer, task, info = example["prompt"], example["answer"], example["task"], example["info"]
    try:
        completion, state = await env.env.rollout(client, ctx.model, prompt, answer, task, info, dict(sampling_args))
        score = await env.env.rubric.score_rollout(prompt, completion, answer, state, task, info)
    except asyncio.CancelledError:
        raise
    except Exception as err:  # a broken rollout is recorded and excluded, never the end of the run
        log.warning("rollout of %s failed: %s: %s", env.name, type(err).__name__, err,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        result.error = f"{type(err).__name__}: {err}"
        result.inference_s = client.inference_s
        return result
    result.inference_s = client.inference_s
    result.completion = completion
    result.reward = float(score.reward)
    result.metrics = dict(score.metrics)
    result.reward_errors = list(getattr(score, "errors", []))
    result.stop_reason = state.get("stop_reason") if isinstance(state, dict) else None
    if not client.turns:
        result.error = "no model turn completed (is the prompt longer than `seq_len`?)"
        return result
    result.samples = build_samples(client.turns)
    return result


async def run_group(ctx: RolloutContext, env: LoadedEnv, example: dict[str, Any], step: int, group_size: int,
                    sampling_args: dict[str, Any], advantage: AdvantageConfig, max_tokens: int,
                    seeds: list[int] | None = None) -> GroupResult:
    """`group_size` rollouts of `example` on one server (they share the prompt's prefix cache),
    with advantages set on the rollouts that succeeded; rollout j samples with `seeds[j]` when given."""
    server = ctx.pool.next_server()
    args = [sampling_args if seeds is None else {**sampling_args, "seed": seeds[j]} for j in range(group_size)]
    rollouts = await asyncio.gather(*(run_rollout(ctx, env, example, server, args[j]) for j in range(group_size)))
    group = GroupResult(env=env.name, step=step, rollouts=list(rollouts))
    ok = group.succeeded
    advantages = group_advantages([r.reward for r in ok], [r.num_completion_tokens for r in ok], advantage, max_tokens)
    for rollout, value in zip(ok, advantages):
        rollout.advantage = value
        for sample in rollout.samples:
            sample.advantage = value
    return group
