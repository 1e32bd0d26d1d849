"""The gate and the group bookkeeping, with scripted groups and a scripted trainer."""

from __future__ import annotations

import asyncio

import pytest

from tandem.orchestrator.policy import PolicyTracker
from tandem.orchestrator.rollout import GroupResult, RolloutResult
from tandem.orchestrator.scheduler import GroupScheduler


def group(step: int, rewards: list[float], failed: bool = False) -> GroupResult:
    rollouts = [RolloutResult(env="e", example={}, turns=[], samples=[], reward=r, error="boom" if failed else None)
                for r in rewards]
    for r in rollouts:
        r.advantage = r.reward - sum(rewards) / len(rewards)
    return GroupResult("e", step, rollouts)


@pytest.mark.parametrize("max_async_level", [0, 1, 3])
def test_groups_start_only_within_the_bound_and_never_beyond_the_concurrency_cap(max_async_level):
    started: list[tuple[int, int]] = []
    in_flight = [0, 0]

    async def main():
        policy = PolicyTracker(0)

        def start(step):
            started.append((step, policy.version))

            async def body():
                in_flight[0] += 1
                in_flight[1] = max(in_flight)
                await asyncio.sleep(0.001)
                in_flight[0] -= 1
                return group(step, [0.0, 1.0])
            return body()

        scheduler = GroupScheduler(start, policy, first_step=1, last_step=6, max_async_level=max_async_level,
                                   groups_per_step=3, max_replacements=0, max_inflight_groups=4, filter_zero=True)
        finished = []
        async for done in scheduler.steps():
            finished.append(done.groups.step)
            assert len(done.groups.used) == 3
            await asyncio.sleep(0.005)  # the trainer trains, then publishes this step's policy
            await policy.set(done.groups.step)
        return finished

    assert asyncio.run(main()) == [1, 2, 3, 4, 5, 6]
    assert all(version >= step - 1 - max_async_level for step, version in started)
    assert in_flight[1] <= 4
    assert len(started) == 18


def test_zero_signal_and_failed_groups_are_replaced_up_to_the_budget_then_fill_the_step():
    script = iter([group(1, [1.0, 1.0]), group(1, [0.0, 0.0], failed=True), group(1, [0.5, 0.5]), group(1, [0.0, 1.0])])

    async def main():
        policy = PolicyTracker(0)

        def start(step):
            async def body():
                return next(script)
            return body()

        scheduler = GroupScheduler(start, policy, first_step=1, last_step=1, max_async_level=0, groups_per_step=2,
                                   max_replacements=2, max_inflight_groups=1, filter_zero=True)
        return [done async for done in scheduler.steps()]

    (done,) = asyncio.run(main())
    groups = done.groups
    assert groups.num_started == 4 and len(groups.kept) == 1 and len(groups.filtered) == 2 and len(groups.failed) == 1
    assert len(groups.used) == 2 and groups.used[0] is groups.kept[0] and groups.used[1] is groups.filtered[0]
    assert groups.discarded == [groups.filtered[1], groups.failed[0]]


def test_a_gate_that_never_opens_times_out_with_a_clear_error():
    async def main():
        scheduler = GroupScheduler(lambda step: None, PolicyTracker(0), first_step=3, last_step=3, max_async_level=0,
                                   groups_per_step=1, max_replacements=0, max_inflight_groups=1, filter_zero=True,
                                   wait_timeout_s=0.05)
        async for _ in scheduler.steps():
            pass

    with pytest.raises(TimeoutError, match="no policy newer than 0 was published within 0s"):
        asyncio.run(main())
