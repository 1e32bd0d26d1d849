"""swe end to end on the shipped instances: real repositories (git bundles), real sandboxed test runs.

Every shipped instance's gold, base and wrong patches are graded here, as `tandem.envs.swe_mining` grades them
when it builds the set (three sandboxed grading runs each). Hostile completions put their payload at the top of
the module the tests import, and stop; the grading imports it again.
"""

import asyncio
import json
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tandem.envs import load_environment, swe
from tandem.envs.sandbox import SandboxLimits
from tandem.envs.swe_grading import prepare
from tandem.envs.swe_instances import (
    RepositoryStore,
    patch_files,
    read_files,
    read_instances,
)
from tandem.envs.swe_mining import verdicts

INSTANCES = read_instances(swe.DATA_DIR / "instances.json")
BY_ID = {i.instance_id: i for i in INSTANCES}
PYTHON_311_ONLY = "PyCQA__pyflakes-d875b028"
"""Skipped at load under Python 3.12 and later (its PASS_TO_PASS tests fail at the base commit there)."""
# tests/test_keys.py of cachetools: four tests, 0.1 s of CPU
KEYS = "tkem__cachetools-462e8679"
LIMITS = {"cpu_s": 1, "wall_s": 2, "memory_mb": 512, "output_bytes": 200_000, "max_processes": 16}


@pytest.fixture(scope="module")
def env():
    return load_environment("swe", instance_ids=[KEYS], num_eval_examples=1, limits=LIMITS)


def play(env, scripted_client, calls: list[list[tuple[str, dict]]]):
    replies = [{"tool_calls": [(f"c{i}{j}", name, args) for j, (name, args) in enumerate(turn)]} for i, turn in enumerate(calls)]
    return asyncio.run(env.run_rollout(scripted_client(replies + ["done"]), "m", env.get_eval_dataset(1)[0]))


def gold_calls(instance) -> list[tuple[str, dict]]:
    store = RepositoryStore(swe.DATA_DIR / "repos")
    sources = read_files(store.git_dir(instance.repo), instance.base_commit, patch_files(instance.patch))
    return [("replace_text", {"path": e.path, "old": e.old, "new": e.new}) for e in swe.gold_edits(instance.patch, sources)]


def tool_replies(rollout) -> list[str]:
    return [m["content"] for m in rollout.completion if m["role"] == "tool"]


def test_the_shipped_set_is_real_licensed_and_within_its_size_budget():
    assert 20 <= len(INSTANCES) <= 50 and len(BY_ID) == len(INSTANCES)
    data = swe.DATA_DIR
    assert sum(p.stat().st_size for p in data.rglob("*") if p.is_file()) <= 3_000_000
    for repo in {i.repo for i in INSTANCES}:
        name = repo.replace("/", "__")
        assert (data / "repos" / f"{name}.bundle").is_file()
        assert "Permission is hereby granted" in (data / "licenses" / f"{name}.txt").read_text()  # MIT
        assert repo in (data / "README.md").read_text()
    for instance in INSTANCES:
        assert instance.fail_to_pass and instance.patch and instance.test_patch and instance.problem_statement


def test_every_shipped_instance_is_resolved_by_its_gold_patch_only():
    """SWE-bench's check of a dataset, on every shipped instance: the gold patch scores 1, the base and a wrong
    patch (tests rewritten to pass, the code left alone) score 0. Two instances at a time (one per core)."""
    store = RepositoryStore(swe.DATA_DIR / "repos")

    async def check_all() -> dict[str, dict[str, bool]]:
        slots = asyncio.Semaphore(2)

        async def check(instance) -> tuple[str, dict[str, bool]]:
            async with slots:
                return instance.instance_id, await verdicts(store, prepare(store, instance), SandboxLimits())
        return dict(await asyncio.gather(*(check(instance) for instance in INSTANCES)))

    results = asyncio.run(check_all())
    assert len(results) == len(INSTANCES) == 38
    wrong = {k: v for k, v in results.items() if v != {"gold": True, "base": False, "wrong": False}}
    if sys.version_info >= (3, 12):  # its PASS_TO_PASS tests (test_invalidEscape among them) fail at its base there
        wrong.pop(PYTHON_311_ONLY, None)
    assert wrong == {}


def test_replaying_the_fix_with_the_tools_scores_one(env, scripted_client, monkeypatch):
    folders, checkout = [], swe._checkout

    async def recorded(store, prepared, workdir, *rest):
        folders.append(workdir)
        return await checkout(store, prepared, workdir, *rest)

    monkeypatch.setattr(swe, "_checkout", recorded)
    calls = gold_calls(BY_ID[KEYS])
    rollout = play(env, scripted_client, [[("run_tests", {}), ("search_text", {"text": "_kwmark"})], calls, [("run_tests", {})]])
    first, found, *replaced, last = tool_replies(rollout)
    assert first == "PASSED: 3 tests ran: 3 passed"  # the hidden FAIL_TO_PASS test is not there yet
    assert found.startswith("cachetools/keys.py:") and "_kwmark = (object(),)" in found
    assert all(r.startswith("Replaced 1 occurrence in cachetools/keys.py") for r in replaced)
    assert last == "PASSED: 3 tests ran: 3 passed"
    state = rollout.state
    assert rollout.score.reward == 1.0 and state["resolved"] is True and state["pass_to_pass_broken"] == []
    assert state["final_test_report"] == "PASSED: 4 tests ran: 4 passed"
    assert rollout.score.metrics["num_sandbox_violations"] == 0.0 and "workspace" not in state
    assert len(folders) == 1 and not folders[0].exists()  # the rollout's folder is gone


def test_doing_nothing_scores_zero_and_partial_credit_is_an_option(env, scripted_client):
    rollout = play(env, scripted_client, [])
    assert rollout.score.reward == 0.0 and rollout.state["resolved"] is False
    assert rollout.state["final_test_report"].startswith("FAILED: 4 tests ran: 3 passed, 1 failed")
    partial = load_environment("swe", instance_ids=["PyCQA__pyflakes-d8591997"], num_eval_examples=1, partial_credit=True)
    instance = BY_ID["PyCQA__pyflakes-d8591997"]
    calls = gold_calls(instance)
    assert len(calls) > 1 and len(instance.fail_to_pass) == 6
    scores = [play(partial, scripted_client, [c]).score for c in ([], calls[:1], calls)]
    assert [s.metrics["resolved_reward"] for s in scores] == [0.0, 0.0, 1.0]
    assert scores[0].reward == 0.0 and 0.0 < scores[1].reward < 1.0 and scores[2].reward == 1.0


def test_the_time_budget_ends_the_episode(env, scripted_client, monkeypatch):
    monkeypatch.setattr(env, "time_budget_s", 1e-9)
    client = scripted_client([{"tool_calls": [("c0", "run_tests", {})]}, "done"])
    rollout = asyncio.run(env.run_rollout(client, "m", env.get_eval_dataset(1)[0]))
    assert client.calls == [] and rollout.state["out_of_time"] is True and rollout.score.reward == 0.0


def test_editing_or_deleting_the_tests_gains_nothing(env, scripted_client):
    test_file = "tests/test_keys.py"
    rollout = play(env, scripted_client, [[
        ("view_file", {"path": "../../etc/hostname"}),
        ("replace_text", {"path": test_file, "old": "import unittest", "new": "import unittest\nraise SystemExit"}),
    ]])
    outside, edit = tool_replies(rollout)
    assert "without '..'" in outside and "tests/ is read-only" in edit
    assert rollout.score.reward == 0.0


def payload_rollout(env, scripted_client, payload: str):
    """The payload at the top of cachetools/keys.py, which every test of the instance imports."""
    anchor = "__all__ = ('hashkey', 'typedkey')"
    return play(env, scripted_client, [[("replace_text", {"path": "cachetools/keys.py", "old": anchor,
                                                           "new": f"{payload}\n\n\n{anchor}"})]])


HOSTILE = {
    "hangs": ("import time\ntime.sleep(600)", {"wall_time"}),
    "forks": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", {"cpu_time", "wall_time"}),
    "loops": ("while True:\n    pass", {"cpu_time", "wall_time"}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_suite_that_hangs_or_forks_is_stopped_scored_zero_and_recorded(env, scripted_client, confined, case):
    payload, violations = HOSTILE[case]
    rollout = payload_rollout(env, scripted_client, payload)
    state = rollout.state
    assert state["final_test_report"].startswith("FAILED: stopped at the sandbox's")
    assert len(state["sandbox_violations"]) == 1 and set(state["sandbox_violations"]) <= violations
    assert rollout.score.reward == 0.0 and rollout.score.metrics["num_sandbox_violations"] == 1.0


def test_a_suite_that_writes_outside_or_deletes_files_harms_nothing_outside(env, scripted_client, confined, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("still here")
    escape = Path(tempfile.gettempdir()) / f"tandem-escape-{uuid.uuid4().hex}"
    payload = "\n".join([
        "import os, shutil",
        f"shutil.rmtree({str(victim)!r}, ignore_errors=True)",
        f"open({str(escape)!r}, 'w').write('escaped')",
        "shutil.rmtree(os.getcwd(), ignore_errors=True)",  # the whole repository, tests included
    ])
    rollout = payload_rollout(env, scripted_client, payload)
    assert (victim / "keep.txt").read_text() == "still here" and not escape.exists()
    assert rollout.score.reward == 0.0 and rollout.state["sandbox_violations"] == []
    assert rollout.state["final_test_report"].startswith("FAILED")


def test_code_that_rewrites_the_tests_while_they_run_changes_nothing(env, scripted_client):
    fake = "import unittest\nclass CacheKeysTest(unittest.TestCase):\n    def test_pickle(self): pass\n"
    payload = f"import pathlib\npathlib.Path('tests/test_keys.py').write_text({fake!r})"
    rollout = payload_rollout(env, scripted_client, payload)
    assert rollout.state["final_test_report"].startswith("FAILED: 4 tests ran: 3 passed, 1 failed")
    assert rollout.score.reward == 0.0


def test_bad_instances_are_skipped_with_their_reason_and_the_rest_load(tmp_path, caplog):
    good = json.loads((swe.DATA_DIR / "instances.json").read_text())
    record = next(r for r in good if r["instance_id"] == KEYS)
    broken_tests = record["test_patch"].replace("+    def test_pickle", "+raise ImportError('no')\n+    def test_pickle")
    broken_tests = broken_tests.replace("@@ -43,3 +43,16 @@", "@@ -43,3 +43,17 @@")
    bad = [
        {**record, "instance_id": "no-repo", "repo": "nobody/nothing"},
        {**record, "instance_id": "no-commit", "base_commit": "0" * 40},
        {**record, "instance_id": "no-run", "test_patch": broken_tests},
        {**record, "instance_id": "no-apply", "test_patch": record["test_patch"].replace("(1, 2, 3) + key(4", "(7, 8, 9) + key(4")},
        {**record, "FAIL_TO_PASS": json.dumps(record["FAIL_TO_PASS"])},  # SWE-bench's files hold JSON strings
    ]
    path = tmp_path / "instances.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    swe.log.addHandler(caplog.handler)  # the `tandem` logger may not propagate to the root's capture
    try:
        env = load_environment("swe", instances_path=str(path), repos_dir=str(swe.DATA_DIR / "repos"), num_eval_examples=0)
    finally:
        swe.log.removeHandler(caplog.handler)
    assert sorted(env.skipped) == ["no-apply", "no-commit", "no-repo", "no-run"]
    assert "repository nobody/nothing not found" in env.skipped["no-repo"]
    assert f"base commit {'0' * 40} is not in repository" in env.skipped["no-commit"]
    assert "PASS_TO_PASS tests fail at the base commit" in env.skipped["no-run"]
    assert "test_patch" in env.skipped["no-apply"]
    assert [e["info"]["instance_id"] for e in env.get_dataset()] == [KEYS]
    for instance_id, reason in env.skipped.items():
        assert f"skipped instance {instance_id}: {reason}" in caplog.text


def test_instance_files_name_the_bad_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"instance_id": "x", "repo": "a/b"}]))
    with pytest.raises(ValueError, match=r"bad.json: instance 'x' lacks the field\(s\) \['base_commit'"):
        read_instances(path)
    record = json.loads((swe.DATA_DIR / "instances.json").read_text())[0]
    path.write_text(json.dumps([{**record, "PASS_TO_PASS": ["../../etc/passwd::x"]}]))
    with pytest.raises(ValueError, match="must be a relative path without '..'"):
        read_instances(path)


def test_sft_examples_replay_the_fixes_of_training_instances_only(byte_tokenizer):
    from tandem.trainer.sft.data import tokenize_record

    ids = [KEYS, "tkem__cachetools-57d2e481"]
    env = load_environment("swe", instance_ids=ids, num_eval_examples=1)
    rows = swe.sft_examples(3, instance_ids=ids, num_eval_examples=1)
    train = [e["prompt"][-1]["content"] for e in env.get_dataset()]
    assert len(train) == 1 and [r["messages"][1]["content"] for r in rows] == train * 3  # made once, repeated
    for row in rows:
        names = [m["tool_calls"][0]["function"]["name"] for m in row["messages"] if m.get("tool_calls")]
        assert names[0] == "run_tests" and names[-1] == "run_tests" and "replace_text" in names
        assert row["messages"][-2]["content"].startswith("PASSED") and row["tools"] == env.oai_tools
        assert sum(tokenize_record(row, byte_tokenizer, ["assistant"], "row").loss_mask) > 0
    assert rows == swe.sft_examples(3, instance_ids=ids, num_eval_examples=1)  # deterministic
