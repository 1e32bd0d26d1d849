"""Rubrics score a finished rollout with weighted reward functions.

A reward function receives only the keyword arguments it names among `prompt`, `completion`,
`answer`, `state`, `task`, `info` and `parser` (all of them if it takes `**kwargs`), may be
sync or async, and returns a number. Invariant: scoring never raises because of a reward
function; a function that raises, or returns something that is not a finite number, scores 0
and is reported in `RolloutScore.errors`.
"""

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tandem.envs.callables import function_name, maybe_await, select_kwargs
from tandem.envs.parsers import Parser
from tandem.envs.types import Info, Messages, RolloutScore, State

RewardFunc = Callable[..., float | Awaitable[float]]


class Rubric:
    """Reward = sum of weight * score; zero-weight functions are metrics only.

    Every function's unweighted score is reported in `metrics` under its name, so names must
    be unique (two lambdas would collide: give them `def` names).
    """

    def __init__(
        self,
        funcs: Sequence[RewardFunc] | None = None,
        weights: Sequence[float] | None = None,
        parser: Parser | None = None,
    ):
        funcs = list(funcs or [])
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(funcs):
            raise ValueError(f"Rubric got {len(funcs)} funcs but {len(weights)} weights")
        self.parser = parser or Parser()
        self.funcs: list[RewardFunc] = []
        self.weights: list[float] = []
        for func, weight in zip(funcs, weights, strict=True):
            self.add_reward_func(func, weight)

    def add_reward_func(self, func: RewardFunc, weight: float = 1.0) -> None:
        name = function_name(func)
        if name in self.get_reward_func_names():
            raise ValueError(f"Rubric already has a reward function named {name!r}")
        self.funcs.append(func)
        self.weights.append(float(weight))

    def get_reward_func_names(self) -> list[str]:
        return [function_name(func) for func in self.funcs]

    async def score_rollout(
        self,
        prompt: Messages,
        completion: Messages,
        answer: str,
        state: State,
        task: str = "default",
        info: Info | None = None,
    ) -> RolloutScore:
        available = {
            "prompt": prompt,
            "completion": completion,
            "answer": answer,
            "state": state,
            "task": task,
            "info": info or {},
            "parser": self.parser,
        }
        results = await asyncio.gather(*(_call_reward(func, available) for func in self.funcs))
        scores = [score for score, _ in results]
        metrics = dict(zip(self.get_reward_func_names(), scores, strict=True))
        reward = sum(weight * score for weight, score in zip(self.weights, scores, strict=True))
        errors = [error for _, error in results if error is not None]
        return RolloutScore(reward=reward, metrics=metrics, errors=errors)


async def _call_reward(func: RewardFunc, available: dict) -> tuple[float, str | None]:
    """(score, None), or (0.0, error line) when the function fails."""
    name = function_name(func)
    try:
        score = float(await maybe_await(func(**select_kwargs(func, available))))
    except Exception as error:  # a broken reward function must not end the run
        return 0.0, f"{name}: {type(error).__name__}: {error}"
    if not math.isfinite(score):
        return 0.0, f"{name}: returned non-finite value {score}"
    return score, None


class RubricGroup(Rubric):
    """Several rubrics as one: rewards add up, metrics merge (same-named ones add up), errors
    concatenate."""

    def __init__(self, rubrics: Sequence[Rubric]):
        if not rubrics:
            raise ValueError("RubricGroup needs at least one rubric")
        self.rubrics = list(rubrics)
        super().__init__(parser=self.rubrics[0].parser)

    def get_reward_func_names(self) -> list[str]:
        names = [name for rubric in self.rubrics for name in rubric.get_reward_func_names()]
        return list(dict.fromkeys(names))

    def add_reward_func(self, func: RewardFunc, weight: float = 1.0) -> None:
        self.rubrics[0].add_reward_func(func, weight)

    async def score_rollout(self, *args: Any, **kwargs: Any) -> RolloutScore:
        """Each rubric scores the rollout from `Rubric.score_rollout`'s arguments, passed on as given."""
        scores = await asyncio.gather(*(r.score_rollout(*args, **kwargs) for r in self.rubrics))
        metrics: dict[str, float] = {}
        for score in scores:
            for name, value in score.metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value
        return RolloutScore(
            reward=sum(score.reward for score in scores),
            metrics=metrics,
            errors=[error for score in scores for error in score.errors],
        )
