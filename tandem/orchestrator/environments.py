"""Loading the run's environments and reading their datasets as plain examples.

An environment is anything with tandem's environment shape (`tandem/envs`): `get_dataset`,
`get_eval_dataset`, `rollout(client, model, prompt, answer, task, info, sampling_args)` and
`rubric.score_rollout(...)`. Classic `verifiers` environments have that shape already; those of
the newer trajectory API (verifiers 0.2-0.3) are wrapped by `tandem.orchestrator.verifiers_env`.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any

from tandem.config.orchestrator import EnvConfig


@dataclass
class LoadedEnv:
    name: str
    """Label in metrics and sample files."""
    env: Any
    weight: float = 1.0


def load_envs(configs: list[EnvConfig]) -> list[LoadedEnv]:
    from tandem.envs import load_environment

    return [LoadedEnv(c.label, adapt_env(load_environment(c.id, **c.args)), c.weight) for c in configs]


def adapt_env(env: Any) -> Any:
    """`env` itself, or the adapter of a verifiers environment whose rollout takes a `RolloutInput`."""
    is_verifiers = any(cls.__module__.split(".")[0] == "verifiers" for cls in type(env).__mro__)
    if is_verifiers and next(iter(inspect.signature(env.rollout).parameters), None) == "input":
        from tandem.orchestrator.verifiers_env import VerifiersEnv

        return VerifiersEnv(env)
    return env


def as_examples(rows: Any, env_name: str) -> list[dict[str, Any]]:
    """Dataset rows (a list of dicts or an HF `Dataset`) as `{prompt, answer, task, info}` dicts."""
    records = rows.to_list() if hasattr(rows, "to_list") else list(rows)
    if not records:
        raise ValueError(f"environment {env_name!r} returned an empty dataset")
    examples = []
    for i, row in enumerate(records):
        if "prompt" not in row:
            raise ValueError(f"environment {env_name!r}: dataset row {i} has no 'prompt' (keys: {sorted(row)})")
        info = row.get("info") or {}
        examples.append({
            "prompt": row["prompt"],
            "answer": str(row.get("answer") or ""),
            "task": str(row.get("task") or "default"),
            "info": json.loads(info) if isinstance(info, str) else dict(info),
        })
    return examples
