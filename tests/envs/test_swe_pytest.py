"""swe with `test_runner = "pytest"`: a tiny git repository built here (a bug, tests with a pytest fixture, a
test class and parametrized tests, the fix commit), an instance of it in SWE-bench's format, graded by pytest
in the sandbox, in tandem's own interpreter (which has pytest)."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.envs import load_environment, swe
from tandem.envs.sandbox import SandboxLimits
from tandem.envs.swe_pytest import outcomes_from_junit
from tandem.envs.swe_workspace import SweWorkspace

BUGGY = "def add(a, b):\n    return a + b\n\n\ndef clamp(x, low, high):\n    return max(low, x)\n"
FIXED = BUGGY.replace("return max(low, x)", "return max(low, min(x, high))")
TESTS = """import pytest

from calc.ops import add, clamp


@pytest.fixture
def numbers():
    return (2, 3)


def test_add(numbers):
    assert add(*numbers) == 5


class TestAdd:
    def test_zero(self, numbers):
        assert add(numbers[0], 0) == 2


@pytest.mark.parametrize("x,expected", [(1, 1), (-5, 0)])
def test_clamp_low(x, expected):
    assert clamp(x, 0, 10) == expected
"""
NEW_TESTS = """

@pytest.mark.parametrize("x,expected", [(11, 10), (99, 10)])
def test_clamp_high(x, expected):
    assert clamp(x, 0, 10) == expected
"""
FILE = "tests/test_ops.py"
FAIL_TO_PASS = [f"{FILE}::test_clamp_high[11-10]", f"{FILE}::test_clamp_high[99-10]"]
PASS_TO_PASS = [f"{FILE}::test_add", f"{FILE}::TestAdd::test_zero", f"{FILE}::test_clamp_low[1-1]",
                f"{FILE}::test_clamp_low[-5-0]"]


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture(scope="module")
def instance_files(tmp_path_factory) -> tuple[Path, Path]:
    """(the instances file, the repositories folder) of one instance, `acme/calc`."""
    root = tmp_path_factory.mktemp("swe-pytest")
    repo = root / "repos" / "acme__calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text(BUGGY)
    (repo / FILE).write_text(TESTS)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "calc")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc" / "ops.py").write_text(FIXED)
    (repo / FILE).write_text(TESTS + NEW_TESTS)
    git(repo, "commit", "-qam", "clamp: respect the upper bound")
    record = {
        "instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
        "problem_statement": "clamp(99, 0, 10) returns 99; it should return 10.",
        "FAIL_TO_PASS": json.dumps(FAIL_TO_PASS), "PASS_TO_PASS": json.dumps(PASS_TO_PASS),
        "patch": git(repo, "diff", base, "HEAD", "--", "calc"), "test_patch": git(repo, "diff", base, "HEAD", "--", "tests"),
    }
    path = root / "instances.json"
    path.write_text(json.dumps([record]))
    return path, root / "repos"


def wrapper(folder: Path, name: str, line: str) -> Path:
    """An executable `python` for the env arg: a shell script that runs tandem's interpreter."""
    script = folder / name
    script.write_text(f"#!/bin/sh\n{line}\n")
    script.chmod(0o755)
    return script


def fast_python(folder: Path) -> Path:
    """tandem's interpreter without the heavy pytest plugins (hypothesis, schemathesis) its virtual
    environment autoloads, which this repository does not use: a test run takes a fraction of the time."""
    return wrapper(folder, "python", f'PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 exec {sys.executable} "$@"')


@pytest.fixture(scope="module")
def env(instance_files):
    path, repos = instance_files
    return load_environment("swe", instances_path=str(path), repos_dir=str(repos), num_eval_examples=1,
                            test_runner="pytest", python=str(fast_python(path.parent)))


def play(env, scripted_client, calls: list[tuple[str, dict]]):
    replies = [{"tool_calls": [(f"c{i}", name, args)]} for i, (name, args) in enumerate(calls)]
    return asyncio.run(env.run_rollout(scripted_client(replies + ["done"]), "m", env.get_eval_dataset(1)[0]))


def edit_clamp(new: str) -> tuple[str, dict]:
    return "replace_text", {"path": "calc/ops.py", "old": "return max(low, x)", "new": new}


def test_gold_scores_one_base_and_wrong_fixes_zero_with_parametrized_ids(env, scripted_client):
    assert env.skipped == {}
    gold = play(env, scripted_client, [("run_tests", {}), edit_clamp("return max(low, min(x, high))")])
    first = [m["content"] for m in gold.completion if m["role"] == "tool"][0]
    assert first == "PASSED: 4 tests ran: 4 passed"  # the FAIL_TO_PASS tests come with the test patch
    assert gold.score.reward == 1.0 and gold.state["final_test_report"] == "PASSED: 6 tests ran: 6 passed"
    base = play(env, scripted_client, [])
    assert base.score.reward == 0.0 and base.state["pass_to_pass_broken"] == []
    report = base.state["final_test_report"]
    assert report.startswith("FAILED: 6 tests ran: 4 passed, 2 failed")
    assert f"FAILED: {FAIL_TO_PASS[0]}\n" in report and "assert 11 == 10" in report
    wrong = play(env, scripted_client, [edit_clamp("return min(x, high)")])  # fixes the top, breaks the bottom
    assert wrong.score.reward == 0.0 and wrong.state["pass_to_pass_broken"] == [f"{FILE}::test_clamp_low[-5-0]"]
    assert wrong.state["fail_to_pass_passed"] == 2


def test_a_report_forged_by_the_code_under_test_changes_nothing(env, scripted_client):
    cases = "".join(f'<testcase classname="tests.test_ops" name="{i.split("::")[-1]}" />' for i in FAIL_TO_PASS)
    forged = f'<?xml version="1.0"?><testsuites><testsuite>{cases}</testsuite></testsuites>'
    payload = "\n".join([
        "import glob, os",
        f"print({forged!r})",
        f"open('report.xml', 'w').write({forged!r})",
        "for folder in glob.glob('/tmp/tandem-swe-report-*'):",  # the report's folder is there, not its name
        f"    open(os.path.join(folder, 'report.xml'), 'w').write({forged!r})",
    ])
    rollout = play(env, scripted_client, [("replace_text", {"path": "calc/ops.py", "old": "def add(a, b):",
                                                             "new": f"{payload}\n\n\ndef add(a, b):"})])
    assert rollout.score.reward == 0.0 and rollout.state["fail_to_pass_passed"] == 0
    assert rollout.state["final_test_report"].startswith("FAILED: 6 tests ran: 4 passed, 2 failed")


def test_the_stdlib_harness_cannot_run_fixture_or_parametrized_tests(instance_files):
    path, repos = instance_files
    env = load_environment("swe", instances_path=str(path), repos_dir=str(repos), num_eval_examples=0)
    reason = env.skipped["acme__calc-1"]
    # every one of them is missing: the reason names the first five
    assert reason.startswith("tests not found at the base commit") and str([*FAIL_TO_PASS, *PASS_TO_PASS][:5]) in reason


def test_junit_cases_map_back_to_node_ids():
    report = """<testsuites><testsuite>
      <testcase classname="tests.test_ops.TestAdd" name="test_zero" />
      <testcase classname="tests.test_ops" name="test_x[a.b-1]"><failure message="m">trace</failure></testcase>
      <testcase classname="tests.test_ops" name="test_x[a.b-1]"><error message="teardown">boom</error></testcase>
      <testcase classname="tests.test_ops" name="test_gone"><skipped type="pytest.skip" /></testcase>
      <testcase classname="tests.test_ops" name="test_known_bug"><skipped type="pytest.xfail" /></testcase>
      <testcase classname="" name="tests.test_other"><error message="collection failure">ImportError</error></testcase>
    </testsuite></testsuites>"""
    outcomes, details = outcomes_from_junit(report, [FILE, "tests/test_other.py"])
    assert outcomes == {f"{FILE}::TestAdd::test_zero": "passed", f"{FILE}::test_x[a.b-1]": "error",
                        f"{FILE}::test_gone": "skipped", f"{FILE}::test_known_bug": "passed",
                        "tests/test_other.py": "error"}
    assert details == {f"{FILE}::test_x[a.b-1]": "boom", "tests/test_other.py": "ImportError"}


def test_unknown_runners_and_interpreters_without_pytest_are_refused(instance_files, tmp_path):
    path, repos = instance_files
    with pytest.raises(ValueError, match="test_runner = 'nose' is not a test runner: use 'harness' or 'pytest'"):
        load_environment("swe", instances_path=str(path), repos_dir=str(repos), test_runner="nose")
    no_site = wrapper(tmp_path, "python-without-packages", f'exec {sys.executable} -S "$@"')  # no site-packages: no pytest
    with pytest.raises(ValueError, match=f"python '{no_site}' cannot import pytest"):
        load_environment("swe", instances_path=str(path), repos_dir=str(repos), test_runner="pytest", python=str(no_site))
    with pytest.raises(ValueError, match="does not run"):
        load_environment("swe", instances_path=str(path), repos_dir=str(repos), test_runner="pytest",
                         python=str(tmp_path / "nothing"))


def test_demonstrations_replay_the_fix_under_pytest(instance_files):
    path, repos = instance_files
    [row] = swe.sft_examples(1, instances_path=str(path), repos_dir=str(repos), num_eval_examples=0,
                             test_runner="pytest", python=str(fast_python(path.parent)))
    replies = [m["content"] for m in row["messages"] if m["role"] == "tool"]
    assert replies[0] == replies[-1] == "PASSED: 4 tests ran: 4 passed" and "Replaced 1 occurrence" in replies[-2]


def test_a_run_before_the_test_patch_adds_the_only_test_file_runs_nothing(tmp_path):
    workspace = SweWorkspace(tmp_path, ["tests/test_new.py"], SandboxLimits(), pytest_python=sys.executable)
    assert asyncio.run(workspace.run_tests()).report == "FAILED: no test ran"
