"""code_fix end to end with a scripted model: real repositories, real sandboxed test runs.

Hostile completions put their payload at the top of the bugged module, run the tests, and stop;
the final grading imports the module again. Limits are small so each case ends in seconds.
"""

import asyncio
import json
import socket
import tempfile
import uuid
from pathlib import Path

import pytest

from tandem.envs import code_fix, load_environment, sandbox

LIMITS = {"cpu_s": 1, "wall_s": 1.5, "memory_mb": 512, "output_bytes": 20_000, "max_processes": 16}


@pytest.fixture(scope="module")
def env():
    return load_environment("code-fix", num_train_examples=4, num_eval_examples=4, limits=LIMITS)


def play(env, scripted_client, calls: list[list[tuple[str, dict]]], example=None):
    example = example or env.get_eval_dataset(1)[0]
    replies = [{"tool_calls": [(f"c{i}{j}", name, args) for j, (name, args) in enumerate(turn)]} for i, turn in enumerate(calls)]
    client = scripted_client(replies + ["done"])
    return asyncio.run(env.run_rollout(client, "m", example))


def tool_replies(rollout) -> list[str]:
    return [m["content"] for m in rollout.completion if m["role"] == "tool"]


def sandbox_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("tandem-code-fix-*")}


def test_fixing_the_bug_passes_the_tests_and_scores_one(env, scripted_client):
    before = sandbox_dirs()
    example = env.get_eval_dataset(1)[0]
    path, old, new = example["info"]["fix"]
    rollout = play(env, scripted_client, [[("run_tests", {}), ("view_file", {"path": path})],
                                          [("replace_text", {"path": path, "old": old, "new": new})],
                                          [("run_tests", {})]], example)
    first, source, replaced, second = tool_replies(rollout)
    assert first.startswith("FAILED: 4 of 4 tests ran, 1 failed, 0 errors")
    assert f"FAIL: test_{example['info']['buggy_function']} " in first
    assert old in source
    assert replaced == f"Replaced 1 occurrence in {path}."
    assert second.startswith("PASSED: 4 of 4 tests ran, 0 failed, 0 errors")
    assert rollout.score.reward == 1.0 and rollout.state["tests_passed"] is True
    assert rollout.score.metrics["num_sandbox_violations"] == 0.0
    assert "workspace" not in rollout.state
    assert sandbox_dirs() == before  # the rollout's directory is gone


def test_a_rollout_that_does_nothing_scores_zero(env, scripted_client):
    rollout = play(env, scripted_client, [])
    assert rollout.score.reward == 0.0 and rollout.state["final_test_report"].startswith("FAILED")


def test_tools_stay_inside_the_repository(env, scripted_client):
    example = env.get_eval_dataset(1)[0]
    path = example["info"]["fix"][0]
    test_file = example["info"]["test_files"][0]
    rollout = play(env, scripted_client, [[
        ("view_file", {"path": "/etc/hostname"}),
        ("view_file", {"path": "../../etc/hostname"}),
        ("replace_text", {"path": test_file, "old": "assert", "new": "pass"}),
        ("replace_text", {"path": path, "old": "zzz-not-there", "new": ""}),
        ("view_file", {"path": "app/missing.py"}),
    ]], example)
    replies = tool_replies(rollout)
    assert "must be relative to the repository root" in replies[0] and "without '..'" in replies[1]
    assert "tests/ is read-only" in replies[2] and "occurs 0 times" in replies[3]
    assert replies[4].startswith("Error: view_file raised FileNotFoundError")
    assert rollout.score.metrics["num_tool_errors"] == 5.0


def payload_rollout(env, scripted_client, payload: str):
    example = env.get_eval_dataset(1)[0]
    path, function = example["info"]["fix"][0], example["info"]["buggy_function"]
    anchor = f"def {function}("
    return play(env, scripted_client, [[("replace_text", {"path": path, "old": anchor, "new": f"{payload}\n\n\n{anchor}"})],
                                       [("run_tests", {})]], example)


HOSTILE = {
    "infinite_loop": ("while True:\n    pass", {"cpu_time", "wall_time"}),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", {"cpu_time", "wall_time"}),
    "sleep": ("import time\ntime.sleep(600)", {"wall_time"}),
    "huge_output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", {"output_size"}),
    "memory_hog": ("hog = bytearray(8 * 2**30)", {"memory"}),
    "disk_filler": ("with open('big', 'wb') as f:\n    while True:\n        f.write(bytes(2**20))", {"file_size"}),
}


@pytest.fixture
def sandbox_uids(monkeypatch) -> list[int]:
    """The uids whose processes the test's sandboxes killed as they ended (a fresh uid a run, as root). Only these
    are the test's: tests running beside it have sandboxes of their own."""
    uids = []
    kill_uid = sandbox._kill_uid

    async def recording(uid: int) -> None:
        uids.append(uid)
        await kill_uid(uid)

    monkeypatch.setattr(sandbox, "_kill_uid", recording)
    return uids


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_code_is_stopped_scored_zero_and_recorded(env, scripted_client, confined, sandbox_uids, case):
    payload, violations = HOSTILE[case]
    rollout = payload_rollout(env, scripted_client, payload)
    report = tool_replies(rollout)[1]
    assert report.startswith("FAILED: stopped at the sandbox's"), report
    state = rollout.state
    assert len(state["sandbox_violations"]) == 2 and set(state["sandbox_violations"]) <= violations
    assert rollout.score.reward == 0.0 and rollout.score.metrics["num_sandbox_violations"] == 2.0
    assert sandbox_uids and not [pid for uid in sandbox_uids for pid in sandbox._live_pids_of_uid(uid)]


def test_code_cannot_delete_write_or_connect_outside(env, scripted_client, confined, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("still here")
    escape = Path(tempfile.gettempdir()) / f"tandem-escape-{uuid.uuid4().hex}"
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    payload = "\n".join([
        "import os, shutil, socket",
        f"shutil.rmtree({str(victim)!r}, ignore_errors=True)",
        "shutil.rmtree(os.path.abspath('..'), ignore_errors=True)",
        f"open({str(escape)!r}, 'w').write('escaped')",
        "try:",
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=0.5)",
        "except OSError:",
        "    pass",
    ])
    rollout = payload_rollout(env, scripted_client, payload)
    assert (victim / "keep.txt").read_text() == "still here"
    assert not escape.exists()
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert rollout.score.reward == 0.0 and rollout.state["sandbox_violations"] == []


def test_tests_rewritten_by_the_code_do_not_count(env, scripted_client):
    fake = "import unittest\\nclass T(unittest.TestCase):\\n    def test_a(self): pass\\n    def test_b(self): pass\\n    def test_c(self): pass\\n    def test_d(self): pass\\n"
    payload = "\n".join([
        "import pathlib",
        "for test in pathlib.Path('tests').glob('test_*.py'):",
        f"    test.write_text({json.dumps(fake)}.replace('\\\\n', chr(10)))",
    ])
    rollout = payload_rollout(env, scripted_client, payload)
    assert tool_replies(rollout)[1].startswith("FAILED: 4 of 4 tests ran, 1 failed")
    assert rollout.score.reward == 0.0


def test_splits_are_disjoint_and_seeded():
    env = code_fix.load_environment(num_train_examples=50, num_eval_examples=20, seed=1)
    key = lambda e: json.dumps(e["info"]["files"], sort_keys=True)  # noqa: E731
    train, evals = {key(e) for e in env.get_dataset()}, {key(e) for e in env.get_eval_dataset()}
    assert len(train) == 50 and len(evals) == 20 and not train & evals
    assert code_fix.load_environment(num_train_examples=50, num_eval_examples=20, seed=1).get_eval_dataset() == env.get_eval_dataset()


def test_sft_examples_demonstrate_a_passing_fix_on_training_repositories_only(byte_tokenizer):
    from tandem.trainer.sft.data import tokenize_record

    env = code_fix.load_environment(num_train_examples=3, num_eval_examples=10, seed=2)
    rows = code_fix.sft_examples(3, seed=2, num_eval_examples=10)
    assert [r["messages"][1]["content"] for r in rows] == [e["prompt"][-1]["content"] for e in env.get_dataset()]
    for row, example in zip(rows, env.get_dataset()):
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 4 + ["assistant"]
        replies = [m["content"] for m in messages if m["role"] == "tool"]
        assert replies[0].startswith("FAILED: 4 of 4 tests ran, 1 failed") and replies[3].startswith("PASSED")
        assert example["info"]["fix"][1] in replies[1]
        assert row["tools"] == env.oai_tools
        assert sum(tokenize_record(row, byte_tokenizer, ["assistant"], "row").loss_mask) > 0
    counts: list[int] = []
    assert rows == code_fix.sft_examples(3, seed=2, num_eval_examples=10, progress=counts.append)  # deterministic
    assert sorted(counts) == [1, 2, 3]


def test_short_fix_demonstrations_replace_a_few_words_and_pass(scripted_client):
    rows = code_fix.sft_examples(3, seed=2, num_eval_examples=10, short_fix=True)
    env = code_fix.load_environment(num_train_examples=3, num_eval_examples=10, seed=2)
    for row, example in zip(rows, env.get_dataset()):
        edit = json.loads(row["messages"][6]["tool_calls"][0]["function"]["arguments"])
        path, old, new = example["info"]["short_fix"]
        assert edit == {"path": path, "old": old, "new": new} and len(old) < len(example["info"]["fix"][1])
        assert row["messages"][9]["content"].startswith("PASSED")
    # the environment scores the short edit as any other: the original tests pass
    example = env.get_dataset()[0]
    path, old, new = example["info"]["short_fix"]
    rollout = play(env, scripted_client, [[("replace_text", {"path": path, "old": old, "new": new})]], example)
    assert rollout.score.reward == 1.0


def test_give_up_slips_stop_after_reading_the_module_in_a_seeded_share(scripted_client):
    rows = code_fix.sft_examples(12, seed=2, num_eval_examples=10, short_fix=True, give_up_fraction=0.5)
    gave_up = [row["messages"][-1]["content"] == code_fix.GIVE_UP_REPLY for row in rows]
    assert 0 < sum(gave_up) < 12
    for row, slipped in zip(rows, gave_up):
        names = [m["tool_calls"][0]["function"]["name"] for m in row["messages"] if m.get("tool_calls")]
        assert names == (["run_tests", "view_file"] if slipped else ["run_tests", "view_file", "replace_text", "run_tests"])
    assert rows == code_fix.sft_examples(12, seed=2, num_eval_examples=10, short_fix=True, give_up_fraction=0.5)
    fixed = code_fix.sft_examples(12, seed=2, num_eval_examples=10, short_fix=True)
    assert [r for r, slipped in zip(rows, gave_up) if not slipped] == [r for r, slipped in zip(fixed, gave_up) if not slipped]
    with pytest.raises(ValueError, match="give_up_fraction"):
        code_fix.sft_examples(1, give_up_fraction=1.5)


def test_view_function_shows_one_function_and_refuses_a_missing_one(env, scripted_client):
    example = env.get_eval_dataset(1)[0]
    path, function = example["info"]["fix"][0], example["info"]["buggy_function"]
    rollout = play(env, scripted_client, [[("view_function", {"path": path, "name": function}),
                                           ("view_function", {"path": path, "name": "no_such_function"}),
                                           ("view_function", {"path": "../x.py", "name": function})]], example)
    shown, missing, outside = tool_replies(rollout)
    module = example["info"]["files"][path]
    assert shown.startswith(f"def {function}(") and shown in module and len(shown) < len(module)
    assert shown.count("\ndef ") == 0  # no other function
    assert "no function 'no_such_function'" in missing and "without '..'" in outside


def test_read_function_demonstrations_view_only_the_bugged_function():
    rows = code_fix.sft_examples(3, seed=2, num_eval_examples=10, short_fix=True, read_function=True)
    env = code_fix.load_environment(num_train_examples=3, num_eval_examples=10, seed=2)
    for row, example in zip(rows, env.get_dataset()):
        view = json.loads(row["messages"][4]["tool_calls"][0]["function"]["arguments"])
        assert row["messages"][4]["tool_calls"][0]["function"]["name"] == "view_function"
        assert view == {"path": example["info"]["fix"][0], "name": example["info"]["buggy_function"]}
        assert example["info"]["short_fix"][1] in row["messages"][5]["content"]
        assert row["messages"][9]["content"].startswith("PASSED")
