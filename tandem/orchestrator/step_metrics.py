"""The per-step line of `metrics.jsonl` for the orchestrator.

Rewards describe the rollouts trained on; counts (failed, filtered) cover every rollout the step
ran, replaced ones included. Throughput counts what finished during the step's window, whichever
step it belongs to (with async lookahead, step N+1's rollouts run while step N completes). Off-policy gaps are `(step - 1) - version`: how many
policies behind the one being trained a sample's oldest turn is.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from tandem.orchestrator.packing import PackingStats
from tandem.orchestrator.rollout import RolloutResult
from tandem.orchestrator.samples import Sample
from tandem.orchestrator.scheduler import FinishedStep


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: list[float]) -> float:
    m = _mean(values)
    return math.sqrt(_mean([(v - m) ** 2 for v in values]))


def speculative_metrics(rollouts: list[RolloutResult]) -> dict[str, float]:
    """The drafts' record over `rollouts` when their servers speculated: tokens drafted, accepted, the accepted
    share, and accepted tokens per generated token (the share of tokens that came without a forward of their own);
    nothing when no server counted drafts."""
    counted = [r.drafts for r in rollouts if r.drafts is not None]
    if not counted:
        return {}
    drafted, accepted = sum(d for d, _ in counted), sum(a for _, a in counted)
    generated = sum(r.num_completion_tokens for r in rollouts if r.drafts is not None)
    return {"speculative/draft_tokens": drafted, "speculative/accepted_tokens": accepted,
            "speculative/acceptance": accepted / drafted if drafted else 0.0,
            "speculative/accepted_per_token": accepted / generated if generated else 0.0}


def step_metrics(step: int, finished: FinishedStep, samples: list[Sample], num_dropped: int, stats: PackingStats,
                 pack_s: float, policy_version: int, num_retries: int, update_weights_s: float) -> dict[str, Any]:
    """`update_weights_s`: seconds spent loading policies into the servers since the previous step was logged."""
    groups = finished.groups
    trained = [r for g in groups.used for r in g.succeeded]
    every = [r for g in groups.used + groups.discarded for r in g.rollouts]
    rewards = [r.reward for r in trained]
    out: dict[str, Any] = {
        "reward/mean": _mean(rewards),
        "reward/std": _std(rewards),
        "reward/num_errors": sum(len(r.reward_errors) for r in trained),
        "advantage/abs_mean": _mean([abs(r.advantage) for r in trained]),
    }
    for env in sorted({r.env for r in trained}):
        out[f"reward/{env}/mean"] = _mean([r.reward for r in trained if r.env == env])
    for name in sorted({k for r in trained for k in r.metrics}):
        out[f"metrics/{name}"] = _mean([r.metrics[name] for r in trained if name in r.metrics])
    for reason, count in sorted(Counter(str(r.stop_reason) for r in trained).items()):
        out[f"stop/{reason}"] = count
    out.update(speculative_metrics(trained))
    lengths = [len(s) for s in samples]
    gaps = [step - 1 - s.oldest_version for s in samples]
    step_s = max(finished.step_s, 1e-9)
    out.update({
        "rollouts/num": len(every),
        "rollouts/num_failed": sum(r.failed for r in every),
        "groups/num_filtered": len(groups.filtered),
        "groups/num_failed": len(groups.failed),
        "groups/num_replaced": groups.num_started - groups.groups_per_step,
        "samples/num": len(samples),
        "samples/num_truncated": stats.num_truncated,
        "samples/truncated_frac": stats.num_truncated / len(samples) if samples else 0.0,
        "seq_len/mean": _mean(lengths),
        "seq_len/max": max(lengths, default=0),
        "off_policy/mean": _mean(gaps),
        "off_policy/max": max(gaps, default=0),
        "off_policy/num_dropped": num_dropped,
        "throughput/rollouts_per_s": finished.num_rollouts_done / step_s,
        "throughput/tokens_per_s": finished.num_tokens_done / step_s,
        "time/step_s": finished.step_s,
        "time/wait_trainer_s": finished.wait_trainer_s,
        "time/wait_inference_s": finished.step_s - finished.wait_trainer_s,
        "time/pack_s": pack_s,
        # Each rollout's time waiting on the servers: against `time/wait_inference_s` it tells the servers' latency
        # from the orchestrator's own work (environments, tokenizing, scheduling).
        "time/rollout_inference_mean_s": _mean([r.inference_s for r in trained]),
        "time/rollout_inference_max_s": max((r.inference_s for r in trained), default=0.0),
        "time/update_weights_s": update_weights_s,
        "batch/num_rows": stats.num_rows,
        "batch/num_padding_rows": stats.num_padding_rows,
        "batch/num_loss_tokens": stats.num_loss_tokens,
        "batch/rank_tokens_max": max(stats.tokens_per_rank),
        "batch/rank_tokens_min": min(stats.tokens_per_rank),
        "policy/version": policy_version,
        "client/num_retries": num_retries,
    })
    return out
