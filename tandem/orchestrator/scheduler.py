"""The async gate: which groups may be sampled now, and when a step's groups are complete.

Each group is started for one step s and only when the servers hold policy >= s-1-max_async_level
(ARCHITECTURE.md's bound); since the trainer cannot publish policy s before batch s exists, this
also caps the lookahead at max_async_level steps. Invariants:
- never more than `max_inflight_groups` groups in flight;
- a step never has more than `groups_per_step` groups kept or in flight; a filtered or failed group
  frees its place for a replacement, at most `max_replacements` per step;
- steps are yielded in order, each exactly once, when its groups are in (kept groups first, then
  filtered ones to fill the step once replacements are exhausted).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from tandem.orchestrator.policy import PolicyTracker
from tandem.orchestrator.rollout import GroupResult


@dataclass
class StepGroups:
    """The groups of one step as they come in."""

    step: int
    groups_per_step: int
    max_started: int
    filter_zero: bool
    kept: list[GroupResult] = field(default_factory=list)
    filtered: list[GroupResult] = field(default_factory=list)
    failed: list[GroupResult] = field(default_factory=list)
    num_started: int = 0
    num_inflight: int = 0

    def wants_group(self) -> bool:
        return (len(self.kept) + self.num_inflight < self.groups_per_step and self.num_started < self.max_started)

    def add(self, group: GroupResult) -> None:
        self.num_inflight -= 1
        if not group.succeeded:
            self.failed.append(group)
        elif self.filter_zero and group.is_zero_signal:
            self.filtered.append(group)
        else:
            self.kept.append(group)

    def is_done(self) -> bool:
        return self.num_inflight == 0 and not self.wants_group()

    @property
    def used(self) -> list[GroupResult]:
        """The groups the step trains on: kept ones, then filtered ones to fill up."""
        return self.kept + self.filtered[: max(0, self.groups_per_step - len(self.kept))]

    @property
    def discarded(self) -> list[GroupResult]:
        """Groups replaced or failed, kept for inspection."""
        return self.filtered[max(0, self.groups_per_step - len(self.kept)):] + self.failed


@dataclass
class FinishedStep:
    groups: StepGroups
    step_s: float
    """Seconds from the previous step's hand-off to this one's."""
    wait_trainer_s: float
    """Of those, seconds with nothing to sample because the gate waited on a newer policy."""
    num_rollouts_done: int
    """Rollouts that finished in that window, whatever step they belong to (for throughput)."""
    num_tokens_done: int
    """Tokens sampled by those rollouts."""


class GroupScheduler:
    def __init__(self, start_group: Callable[[int], Awaitable[GroupResult]], policy: PolicyTracker, *,
                 first_step: int, last_step: int, max_async_level: int, groups_per_step: int,
                 max_replacements: int, max_inflight_groups: int, filter_zero: bool,
                 wait_timeout_s: float | None = None):
        self.start_group = start_group
        """Draws the next task synchronously and returns the coroutine that runs its group."""
        self.policy = policy
        self.first_step, self.last_step = first_step, last_step
        self.max_async_level = max_async_level
        self.groups_per_step = groups_per_step
        self.max_replacements = max_replacements
        self.max_inflight_groups = max_inflight_groups
        self.filter_zero = filter_zero
        self.wait_timeout_s = wait_timeout_s
        self._steps: dict[int, StepGroups] = {}
        self._tasks: dict[asyncio.Task, int] = {}

    def may_sample(self, step: int) -> bool:
        return self.policy.version >= step - 1 - self.max_async_level

    async def steps(self) -> AsyncIterator[FinishedStep]:
        """Yield each step's groups in order; in-flight groups keep running while the caller works."""
        step = self.first_step
        step_start = time.monotonic()
        wait_trainer_s, rollouts_done, tokens_done = 0.0, 0, 0
        try:
            while step <= self.last_step:
                self._launch(step)
                current = self._steps.get(step)
                if current is not None and current.is_done():
                    yield FinishedStep(self._steps.pop(step), time.monotonic() - step_start, wait_trainer_s,
                                       rollouts_done, tokens_done)
                    step, step_start = step + 1, time.monotonic()
                    wait_trainer_s, rollouts_done, tokens_done = 0.0, 0, 0
                    continue
                if not self._tasks:  # the gate holds everything back: wait on the trainer
                    start = time.monotonic()
                    await self.policy.wait_newer_than(self.policy.version, self.wait_timeout_s)
                    wait_trainer_s += time.monotonic() - start
                    continue
                newer = asyncio.ensure_future(self.policy.wait_newer_than(self.policy.version))
                done, _ = await asyncio.wait([*self._tasks, newer], return_when=asyncio.FIRST_COMPLETED)
                if newer in done:
                    newer.result()  # re-raises a watcher failure
                else:
                    newer.cancel()
                for task in done - {newer}:
                    group = task.result()
                    self._steps[self._tasks.pop(task)].add(group)
                    rollouts_done += len(group.rollouts)
                    tokens_done += sum(r.num_completion_tokens for r in group.rollouts)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _launch(self, open_step: int) -> None:
        for step in range(open_step, min(open_step + self.max_async_level, self.last_step) + 1):
            if not self.may_sample(step):
                break
            groups = self._steps.setdefault(step, StepGroups(step, self.groups_per_step,
                                                             self.groups_per_step + self.max_replacements,
                                                             self.filter_zero))
            while groups.wants_group() and len(self._tasks) < self.max_inflight_groups:
                groups.num_started += 1
                groups.num_inflight += 1
                self._tasks[asyncio.ensure_future(self.start_group(step))] = step
