"""`samples.jsonl`: every rollout of a step (or an eval), one JSON object per line, for people.

`status` says what became of the rollout: `trained`, `dropped` (too far off-policy at packing
time), `filtered` (its group had no learning signal and was replaced), `failed` (`error` says
why), or `eval`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.orchestrator.rollout import RolloutResult
from tandem.transport.files import atomic_write_text


def rollout_record(rollout: RolloutResult, status: str) -> dict[str, Any]:
    example = rollout.example
    return {
        "env": rollout.env,
        "status": status,
        "reward": rollout.reward,
        "advantage": rollout.advantage,
        "metrics": rollout.metrics,
        "reward_errors": rollout.reward_errors,
        "error": rollout.error,
        "stop_reason": rollout.stop_reason,
        "task": example["task"],
        "answer": example["answer"],
        "prompt": example["prompt"],
        "completion": rollout.completion,
        "policy_versions": [t.version for t in rollout.turns],
        "completion_tokens": rollout.num_completion_tokens,
        "num_samples": len(rollout.samples),
    }


def write_samples(path: Path, records: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in records))
