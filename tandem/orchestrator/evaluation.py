"""Evaluation on the environments' eval splits: reward mean and pass@k.

pass@k is the unbiased estimator of Chen et al. (2021): with n rollouts of an example of which
c pass, pass@k = 1 - C(n-c, k) / C(n, k), averaged over examples. k runs over 1, 2, 4, ... up to
n = `rollouts_per_example` (and n itself). Failed rollouts (server errors) are left out and
counted, so an outage reads as `num_failed`, not as a bad model.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable

from tandem.config.orchestrator import EvalSettings, SamplingConfig
from tandem.orchestrator.environments import LoadedEnv, as_examples
from tandem.orchestrator.rollout import RolloutContext, RolloutResult, run_rollout

log = logging.getLogger("tandem.orchestrator")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k rollouts drawn from n (c passing) passes."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} rollouts, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else ks + [n]


def eval_sampling_args(sampling: SamplingConfig, settings: EvalSettings) -> dict[str, Any]:
    args = sampling.request_args()
    if settings.temperature is not None:
        args["temperature"] = settings.temperature
    return args


async def evaluate(ctx: RolloutContext, envs: list[LoadedEnv], settings: EvalSettings, sampling: SamplingConfig,
                   seed: int, max_concurrent: int, on_progress: Callable[[int, int], None] | None = None,
                   ) -> tuple[dict[str, float], list[RolloutResult]]:
    """Metrics (`eval/...` keys) and every rollout, in example order. `on_progress(done, total)` is
    called as each rollout ends (`tandem eval`'s progress bar)."""
    start = time.monotonic()
    semaphore = asyncio.Semaphore(max_concurrent)
    args = eval_sampling_args(sampling, settings)
    env_examples = []
    for env in envs:
        examples = as_examples(env.env.get_eval_dataset(n=settings.num_examples, seed=seed), env.name)
        if settings.num_examples > len(examples):
            log.warning("eval: environment %s has %d eval examples, fewer than eval.num_examples = %d; evaluating those %d",
                        env.name, len(examples), settings.num_examples, len(examples))
        env_examples.append((env, examples))
    total = sum(len(examples) for _, examples in env_examples) * settings.rollouts_per_example
    done = 0

    async def bounded(env: LoadedEnv, example: dict[str, Any], server: int, rollout_seed: int) -> RolloutResult:
        nonlocal done
        async with semaphore:
            result = await run_rollout(ctx, env, example, server, {**args, "seed": rollout_seed} if settings.seeded else args)
        done += 1
        if on_progress is not None:
            on_progress(done, total)
        return result

    metrics: dict[str, float] = {}
    results: list[RolloutResult] = []
    per_example: list[list[RolloutResult]] = []
    rollout_index = 0  # over all envs: rollout k of the eval samples with seed (seed * 1_000_003 + k) mod 2^31
    for env, examples in env_examples:
        jobs = []
        for example in examples:
            server = ctx.pool.next_server()
            first = rollout_index
            rollout_index += settings.rollouts_per_example
            jobs.append(asyncio.gather(*(bounded(env, example, server, (seed * 1_000_003 + first + j) % 2**31)
                                         for j in range(settings.rollouts_per_example))))
        env_groups = [list(g) for g in await asyncio.gather(*jobs)]
        metrics.update(_summary(env_groups, settings, f"eval/{env.name}/"))
        per_example.extend(env_groups)
        results.extend(r for g in env_groups for r in g)
    metrics.update(_summary(per_example, settings, "eval/"))
    metrics["eval/time_s"] = time.monotonic() - start
    return metrics, results


def _summary(groups: list[list[RolloutResult]], settings: EvalSettings, prefix: str) -> dict[str, float]:
    ok = [r for g in groups for r in g if not r.failed]
    out: dict[str, float] = {
        f"{prefix}num_rollouts": sum(len(g) for g in groups),
        f"{prefix}num_failed": sum(r.failed for g in groups for r in g),
    }
    if not ok:
        return out
    rewards = [r.reward for r in ok]
    mean = sum(rewards) / len(rewards)
    out[f"{prefix}reward_mean"] = mean
    out[f"{prefix}reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
    out[f"{prefix}completion_tokens_mean"] = sum(r.num_completion_tokens for r in ok) / len(ok)
    for k in k_values(settings.rollouts_per_example):
        scores = []
        for group in groups:
            passed = [r.reward >= settings.pass_threshold for r in group if not r.failed]
            if len(passed) >= k:
                scores.append(pass_at_k(len(passed), sum(passed), k))
        if scores:
            out[f"{prefix}pass@{k}"] = sum(scores) / len(scores)
    return out
