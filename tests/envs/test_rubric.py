import asyncio

import pytest

from tandem.envs import Parser, Rubric, RubricGroup

PROMPT = [{"role": "user", "content": "q"}]
COMPLETION = [{"role": "assistant", "content": "a"}]


def score(rubric: Rubric, answer: str = "a", state: dict | None = None):
    return asyncio.run(
        rubric.score_rollout(PROMPT, COMPLETION, answer, state or {}, task="t", info={"k": 1})
    )


def test_functions_get_only_the_arguments_they_name():
    seen = {}

    def names_two(completion, answer):
        seen["names_two"] = (completion, answer)
        return 1.0

    def names_keyword_only(*, task, info, parser):
        seen["names_keyword_only"] = (task, info, parser)
        return 1.0

    def takes_all(**kwargs):
        seen["takes_all"] = sorted(kwargs)
        return 1.0

    parser = Parser()
    result = score(Rubric([names_two, names_keyword_only, takes_all], parser=parser))
    assert result.errors == []
    assert seen["names_two"] == (COMPLETION, "a")
    assert seen["names_keyword_only"] == ("t", {"k": 1}, parser)
    assert seen["takes_all"] == [
        "answer",
        "completion",
        "info",
        "parser",
        "prompt",
        "state",
        "task",
    ]


def test_weighted_sum_and_zero_weight_metrics():
    def exact(completion, answer):
        return float(completion[-1]["content"] == answer)

    def length(completion):
        return 7.0

    def always_half():
        return 0.5

    result = score(Rubric([exact, length, always_half], weights=[2.0, 0.0, 1.0]))
    assert result.reward == pytest.approx(2.5)
    assert result.metrics == {"exact": 1.0, "length": 7.0, "always_half": 0.5}


def test_async_functions_are_awaited():
    async def slow_match(completion, answer):
        await asyncio.sleep(0)
        return 1.0 if completion[-1]["content"] == answer else 0.0

    assert score(Rubric([slow_match]), answer="a").reward == 1.0
    assert score(Rubric([slow_match]), answer="b").reward == 0.0


def test_failing_function_scores_zero_and_is_reported():
    def ok():
        return 1.0

    def broken(answer):
        raise RuntimeError(f"cannot score {answer}")

    def not_a_number():
        return float("nan")

    result = score(Rubric([ok, broken, not_a_number], weights=[1.0, 5.0, 1.0]))
    assert result.reward == 1.0
    assert result.metrics == {"ok": 1.0, "broken": 0.0, "not_a_number": 0.0}
    assert result.errors[0] == "broken: RuntimeError: cannot score a"
    assert result.errors[1].startswith("not_a_number: returned non-finite value")


def test_bad_construction_is_refused():
    def f():
        return 1.0

    with pytest.raises(ValueError, match="2 funcs but 1 weights"):
        Rubric([f, lambda: 0.0], weights=[1.0])
    with pytest.raises(ValueError, match="already has a reward function named 'f'"):
        Rubric([f, f])


def test_empty_rubric_scores_zero():
    assert score(Rubric()).reward == 0.0


def test_rubric_group_adds_rewards_and_metrics():
    def shared():
        return 1.0

    def only_second():
        return 3.0

    group = RubricGroup([Rubric([shared], weights=[0.5]), Rubric([shared, only_second])])
    result = score(group)
    assert result.reward == pytest.approx(0.5 + 1.0 + 3.0)
    assert result.metrics == {"shared": 2.0, "only_second": 3.0}
    assert group.get_reward_func_names() == ["shared", "only_second"]
