"""The `Environment` base: datasets, parser, rubric and sampling defaults of one task.

Subclasses implement `rollout`: talk to an OpenAI-shaped client until the episode ends and
return `(completion_messages, state)`. Scoring goes through `self.rubric`, so rollouts and
scores stay separate steps (the orchestrator batches and times them on its own).
"""

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tandem.envs.dataset import format_dataset, take_examples
from tandem.envs.parsers import Parser
from tandem.envs.rubric import Rubric
from tandem.envs.types import Example, Info, Messages, RolloutScore, State


@dataclass
class ScoredRollout:
    """A rollout and its score, as `run_rollout` and `evaluate` return them."""

    completion: Messages
    state: State
    score: RolloutScore


class Environment(ABC):
    """Extra keyword arguments become attributes, as in verifiers, so subclasses can take
    their own settings without redeclaring `__init__`."""

    def __init__(
        self,
        dataset: Any = None,
        eval_dataset: Any = None,
        system_prompt: str | None = None,
        few_shot: Messages | None = None,
        parser: Parser | None = None,
        rubric: Rubric | None = None,
        sampling_args: dict[str, Any] | None = None,
        max_concurrent: int = 32,
        **kwargs: Any,
    ):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.system_prompt = system_prompt
        self.few_shot = few_shot
        self.dataset = None if dataset is None else format_dataset(dataset, system_prompt, few_shot)
        self.eval_dataset = (
            None if eval_dataset is None else format_dataset(eval_dataset, system_prompt, few_shot)
        )
        self.parser = parser or Parser()
        self.rubric = rubric or Rubric(parser=self.parser)
        # Defaults for every model call; per-call `sampling_args` override them key by key.
        self.sampling_args = dict(sampling_args or {})
        # How many rollouts `evaluate` runs at once.
        self.max_concurrent = max_concurrent
        # OpenAI tool schemas sent as `tools=` on each model call (`ToolEnv` sets them).
        self.oai_tools: list[dict[str, Any]] | None = None
        for key, value in kwargs.items():
            setattr(self, key, value)

    def get_dataset(self, n: int = -1, seed: int | None = None) -> list[Example]:
        """`n` training examples (all if `n < 0`), shuffled by `seed` when given."""
        if self.dataset is None:
            raise ValueError(f"{type(self).__name__} has no training dataset")
        return take_examples(self.dataset, n, seed)

    def get_eval_dataset(self, n: int = -1, seed: int | None = None) -> list[Example]:
        """`n` eval examples; the training set stands in when there is no eval set."""
        if self.eval_dataset is None:
            return self.get_dataset(n, seed)
        return take_examples(self.eval_dataset, n, seed)

    @abstractmethod
    async def rollout(
        self,
        client: Any,
        model: str,
        prompt: Messages,
        answer: str = "",
        task: str = "default",
        info: Info | None = None,
        sampling_args: dict[str, Any] | None = None,
    ) -> tuple[Messages, State]:
        """Run one episode; return the messages after the prompt and the final state."""

    async def run_rollout(
        self,
        client: Any,
        model: str,
        example: Example,
        sampling_args: dict[str, Any] | None = None,
    ) -> ScoredRollout:
        """Roll out one example and score it with the rubric."""
        prompt, answer = example["prompt"], example["answer"]
        task, info = example["task"], example["info"]
        completion, state = await self.rollout(
            client, model, prompt, answer, task, info, sampling_args
        )
        score = await self.rubric.score_rollout(prompt, completion, answer, state, task, info)
        return ScoredRollout(completion=completion, state=state, score=score)

    async def evaluate(
        self,
        client: Any,
        model: str,
        num_examples: int = -1,
        rollouts_per_example: int = 1,
        sampling_args: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> list[ScoredRollout]:
        """Score `rollouts_per_example` rollouts of each eval example, at most
        `max_concurrent` at a time; results follow example order."""
        semaphore = asyncio.Semaphore(self.max_concurrent)

        async def bounded(example: Example) -> ScoredRollout:
            async with semaphore:
                return await self.run_rollout(client, model, example, sampling_args)

        examples = self.get_eval_dataset(num_examples, seed)
        return await asyncio.gather(
            *(bounded(example) for example in examples for _ in range(rollouts_per_example))
        )
