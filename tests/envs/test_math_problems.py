import asyncio
import re

import pytest

from tandem.envs import math_problems


def reward(content: str, answer: str) -> float:
    return math_problems.boxed_answer_reward([{"role": "assistant", "content": content}], answer)


@pytest.mark.parametrize(
    "content, answer",
    [
        ("So \\boxed{42}.", "42"),
        ("\\boxed{42.0}", "42"),
        ("\\boxed{ -3 }", "-3"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{7} then \\boxed{42}", "42"),
        ("<think>maybe \\boxed{41}</think> \\boxed{42}", "42"),
    ],
)
def test_right_answers_score_one(content, answer):
    assert reward(content, answer) == 1.0


@pytest.mark.parametrize(
    "content",
    [
        "\\boxed{41}",  # wrong
        "\\boxed{42.5}",
        "\\boxed{42} then \\boxed{41}",  # only the last box counts
        "\\boxed{42 apples}",  # malformed
        "\\boxed{x = 42}",
        "\\boxed{1,00}",
        "\\boxed{forty-two}",
        "\\boxed{42",
        "42",
        "<think>\\boxed{42}",  # still thinking
        "\\boxed{}",  # empty
        "",
    ],
)
def test_other_answers_score_zero(content):
    assert reward(content, "42") == 0.0


def test_last_boxed_handles_nested_braces():
    assert math_problems.last_boxed("\\boxed{\\frac{1}{2}} and \\boxed{{3}}") == "{3}"
    assert math_problems.last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert math_problems.last_boxed("none") is None


def test_rubric_reward_through_the_environment():
    env = math_problems.load_environment(num_train_examples=5, num_eval_examples=5)
    completion = [{"role": "assistant", "content": "\\boxed{12}"}]
    score = asyncio.run(env.rubric.score_rollout([], completion, "12", {}))
    assert score.reward == 1.0 and score.metrics == {"boxed_answer_reward": 1.0}
    assert asyncio.run(env.rubric.score_rollout([], [], "12", {})).reward == 0.0


def test_every_template_yields_consistent_integer_answers():
    env = math_problems.load_environment(num_train_examples=500, num_eval_examples=50, difficulty=3)
    for example in env.get_dataset():
        question = example["prompt"][-1]["content"]
        assert re.fullmatch(r"-?\d+", example["answer"])
        assert question.endswith("?") and example["task"] == "math"
        numbers = [int(n) for n in re.findall(r"-?\d+", question)]
        if "equally among" in question:
            assert numbers[0] == int(example["answer"]) * numbers[1]
        if "change" in question:
            assert numbers[2] - numbers[0] * numbers[1] == int(example["answer"]) >= 0
    starts = {example["prompt"][-1]["content"].split(" ")[1] for example in env.get_dataset()}
    assert {"has", "had", "shares", "buys", "reads"} <= starts


def addition_operands(difficulty: int) -> list[int]:
    env = math_problems.load_environment(
        num_train_examples=300, num_eval_examples=10, difficulty=difficulty
    )
    questions = [e["prompt"][-1]["content"] for e in env.get_dataset()]
    return [int(n) for q in questions if "gets" in q for n in re.findall(r"\d+", q)]


def test_difficulty_sets_operand_size():
    assert max(addition_operands(1)) <= 10
    assert max(addition_operands(3)) > 100
    with pytest.raises(ValueError, match="difficulty"):
        math_problems.load_environment(difficulty=0)


def test_splits_are_disjoint_and_seeded():
    env = math_problems.load_environment(num_train_examples=500, num_eval_examples=100, seed=9)
    train = {e["prompt"][-1]["content"] for e in env.get_dataset()}
    evals = {e["prompt"][-1]["content"] for e in env.get_eval_dataset()}
    assert len(train) == 500 and len(evals) == 100 and not train & evals
    again = math_problems.load_environment(num_train_examples=500, num_eval_examples=100, seed=9)
    assert again.get_dataset() == env.get_dataset()


def test_sft_examples_answer_training_questions_in_a_box():
    env = math_problems.load_environment(num_train_examples=100, num_eval_examples=50, seed=6, difficulty=1)
    evals = {e["prompt"][-1]["content"] for e in env.get_eval_dataset()}
    rows = math_problems.sft_examples(100, seed=6, num_eval_examples=50, difficulty=1)
    assert math_problems.sft_examples(10, seed=6, num_eval_examples=50, difficulty=1) == rows[:10]
    for row, example in zip(rows, env.get_dataset(), strict=True):
        system, user, assistant = row["messages"]
        assert [system, user] == example["prompt"] and user["content"] not in evals
        assert assistant["content"] == f"\\boxed{{{example['answer']}}}"
        assert reward(assistant["content"], example["answer"]) == 1.0


def test_templates_choose_the_kinds_of_problem():
    env = math_problems.load_environment(
        num_train_examples=200, num_eval_examples=20, difficulty=1, templates=["add", "take_away"]
    )
    questions = [e["prompt"][-1]["content"] for e in env.get_dataset() + env.get_eval_dataset()]
    assert all(" more. " in q or " away. " in q for q in questions)
    assert any(" more. " in q for q in questions) and any(" away. " in q for q in questions)
    every_kind = math_problems.load_environment(num_train_examples=200, num_eval_examples=20)
    assert every_kind.get_dataset() == math_problems.load_environment(
        num_train_examples=200, num_eval_examples=20, templates=list(math_problems.TEMPLATES)
    ).get_dataset()
    with pytest.raises(ValueError, match="templates"):
        math_problems.load_environment(templates=["add", "divide"])
    with pytest.raises(ValueError, match="templates"):
        math_problems.load_environment(templates=[])


def test_off_by_one_demonstrations_are_one_off_and_score_zero():
    """The imperfect demonstrator of the example's warm-up: the same questions, a seeded share answered
    one more or one less than the right number, which the rubric scores 0."""
    args = dict(seed=4, difficulty=1, templates=["add"])
    clean = math_problems.sft_examples(400, **args)
    sloppy = math_problems.sft_examples(400, off_by_one_fraction=0.3, **args)
    assert sloppy == math_problems.sft_examples(400, off_by_one_fraction=0.3, **args)
    slipped = set()
    for good, bad in zip(clean, sloppy, strict=True):
        assert good["messages"][:2] == bad["messages"][:2]
        right = math_problems.last_boxed(good["messages"][2]["content"])
        given = math_problems.last_boxed(bad["messages"][2]["content"])
        if given != right:
            slipped.add(int(given) - int(right))
            assert reward(bad["messages"][2]["content"], right) == 0.0
    assert slipped == {-1, 1}
    assert 0.2 < sum(g != b for g, b in zip(clean, sloppy)) / 400 < 0.4
    with pytest.raises(ValueError, match="off_by_one_fraction"):
        math_problems.sft_examples(4, off_by_one_fraction=2)
