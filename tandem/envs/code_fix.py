"""code_fix: repair the planted bug of a small Python repository, SWE-style.

Each rollout gets its own temporary directory holding a generated repository
(`code_fix_repos`) whose tests fail. Tools: `list_files`, `view_file`, `view_function` (one
function of a file), `replace_text` (one exact occurrence; tests/ is read-only) and `run_tests`. The episode ends when the model replies without
a tool call. Reward = 1 when the repository's original tests pass after the episode, else 0: test
files are restored before that last run, so editing them gains nothing.

Tests run in `sandbox.run_python_sandboxed` (limits and what is enforced: see there). A hostile
completion (fork bomb, deleting files outside, endless loop, huge output, memory hog) is killed
at its limit, fails the tests (reward 0), and each limit hit is recorded in
`state["sandbox_violations"]` and the `num_sandbox_violations` metric. Tool paths are confined to
the repository (no absolute paths, `..` or symlinks), so the tools, which run unconfined in this
process, never touch anything else. What a passing test run proves, and what it does not: see `code_fix_workspace`.
"""

import ast
import asyncio
import json
import shutil
import tempfile
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from tandem.envs.code_fix_repos import Repository, generate_repository
from tandem.envs.code_fix_workspace import Workspace
from tandem.envs.rubric import Rubric
from tandem.envs.sandbox import SandboxLimits
from tandem.envs.slips import slip_draws
from tandem.envs.splits import Row, draw_disjoint_splits
from tandem.envs.tool_env import ToolEnv, demo_tool_turn
from tandem.envs.tool_schema import tool_schema
from tandem.envs.types import Info, Messages, State

SYSTEM_PROMPT = (
    "You fix bugs in Python repositories with the tools list_files, view_file, view_function, "
    "replace_text and run_tests. Change the code in app/ (tests/ is read-only) until run_tests passes, then reply "
    "without a tool call."
)
MAX_VIEW_CHARS = 20_000
GIVE_UP_REPLY = "I could not find the bug."
# The rollout's temporary directory, set by `CodeFixEnv.rollout` for its `setup_state`, which
# the base loop calls without a way to pass it.
_workdir: ContextVar[Path] = ContextVar("code_fix_workdir")


def list_files(workspace: Workspace) -> str:
    """List the files of the repository."""
    files = [p for p in workspace.root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return "\n".join(sorted(str(p.relative_to(workspace.root)) for p in files))


def view_file(path: str, workspace: Workspace) -> str:
    """Show the content of a file of the repository.

    Args:
        path: The file's path from the repository root, e.g. app/text.py.
    """
    text = workspace.path(path).read_text(errors="replace")
    return text if len(text) <= MAX_VIEW_CHARS else text[:MAX_VIEW_CHARS] + "\n[... cut]"


def view_function(path: str, name: str, workspace: Workspace) -> str:
    """Show one function of a Python file of the repository.

    Args:
        path: The file's path from the repository root, e.g. app/text.py.
        name: The function's name, e.g. count_vowels.
    """
    source = workspace.path(path).read_text(errors="replace")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return ast.get_source_segment(source, node)
    raise ValueError(f"no function {name!r} in {path}")


def replace_text(path: str, old: str, new: str, workspace: Workspace) -> str:
    """Replace the one occurrence of a piece of text in a file of the repository.

    Args:
        path: The file's path from the repository root, e.g. app/text.py.
        old: The exact text to replace; it must occur exactly once in the file.
        new: The text to put in its place.
    """
    if Path(path).parts[:1] == ("tests",):
        raise ValueError("tests/ is read-only: fix the code, not the tests")
    target = workspace.path(path)
    text = target.read_text()
    count = text.count(old) if old else 0
    if count != 1:
        raise ValueError(f"the old text occurs {count} times in {path}; give text that occurs exactly once")
    target.write_text(text.replace(old, new))
    return f"Replaced 1 occurrence in {path}."


async def run_tests(workspace: Workspace) -> str:
    """Run the repository's tests."""
    return (await workspace.run_tests()).report


TOOLS = [list_files, view_file, view_function, replace_text, run_tests]
STATE_ARGS = ("workspace",)


class CodeFixEnv(ToolEnv):
    def __init__(self, limits: SandboxLimits, **kwargs: Any):
        super().__init__(tools=TOOLS, state_args=STATE_ARGS, **kwargs)
        self.limits = limits

    def setup_state(self, state: State, **kwargs: Any) -> State:
        state = super().setup_state(state)
        info = state["info"]
        workspace = Workspace(_workdir.get() / "repo", info["num_tests"], self.limits)
        workspace.write_files(info["files"])
        state["workspace"] = workspace
        return state

    def update_tool_args(self, name: str, args: dict[str, Any], state: State) -> dict[str, Any]:
        return {**args, "workspace": state["workspace"]}

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
        """The tool loop in a fresh temporary directory, then the final test run there; the
        directory is gone when this returns, whatever happened."""
        with tempfile.TemporaryDirectory(prefix="tandem-code-fix-", ignore_cleanup_errors=True) as workdir:
            token = _workdir.set(Path(workdir))
            try:
                completion, state = await super().rollout(client, model, prompt, answer, task, info, sampling_args)
            finally:
                _workdir.reset(token)
            await grade(state)
        return completion, state


async def grade(state: State) -> None:
    """Restore the original tests, run them, and record the outcome and every limit hit."""
    workspace: Workspace = state.pop("workspace")
    tests = workspace.root / "tests"
    if tests.is_symlink() or tests.is_file():
        tests.unlink()
    shutil.rmtree(tests, ignore_errors=True)
    for cache in workspace.root.rglob("__pycache__"):  # bytecode the code may have planted
        shutil.rmtree(cache, ignore_errors=True)
    files = state["info"]["files"]
    workspace.write_files({path: files[path] for path in state["info"]["test_files"]})
    final = await workspace.run_tests()
    state["tests_passed"] = final.passed
    state["final_test_report"] = final.report
    state["sandbox_violations"] = [run.sandbox.violation for run in workspace.runs if run.sandbox.violation]
    state["sandbox_enforced"] = final.sandbox.enforced


def tests_pass_reward(state: State) -> float:
    return float(state.get("tests_passed", False))


def num_sandbox_violations(state: State) -> float:
    """Test runs (the model's and the final one) stopped at a sandbox limit."""
    return float(len(state.get("sandbox_violations", [])))


def _row(repo: Repository) -> Row:
    modules = ", ".join(sorted(p for p in repo.files if p.startswith("app/") and p != "app/__init__.py"))
    question = f"The test {repo.failing_test} fails. The package has {modules}. Fix the bug."
    info = {"files": repo.files, "test_files": list(repo.test_files), "num_tests": repo.num_tests,
            "buggy_function": repo.buggy_function, "bug_kind": repo.bug_kind, "fix": list(repo.fix),
            "short_fix": list(repo.short_fix)}
    # The repository itself makes a question distinct: two rows differ iff their files do.
    return {"question": question, "answer": "", "task": "code_fix", "info": info,
            "key": json.dumps(repo.files, sort_keys=True)}


def _splits(num_train_examples: int, num_eval_examples: int, seed: int, num_functions: int) -> tuple[list[Row], list[Row]]:
    return draw_disjoint_splits(
        lambda rng: _row(generate_repository(rng, num_functions)), num_train_examples, num_eval_examples, seed,
        key="key",
    )


def load_environment(
    num_train_examples: int = 1000,
    num_eval_examples: int = 100,
    seed: int = 0,
    num_functions: int = 4,
    max_turns: int = 12,
    limits: dict[str, Any] | None = None,
    **kwargs: Any,
) -> CodeFixEnv:
    """`limits`: `SandboxLimits` fields (cpu_s, memory_mb, wall_s, output_bytes, ...)."""
    train, eval_rows = _splits(num_train_examples, num_eval_examples, seed, num_functions)
    rubric = Rubric(funcs=[tests_pass_reward, num_sandbox_violations], weights=[1.0, 0.0])
    return CodeFixEnv(
        limits=SandboxLimits(**(limits or {})),
        max_turns=max_turns,
        dataset=train,
        eval_dataset=eval_rows,
        system_prompt=SYSTEM_PROMPT,
        rubric=rubric,
        **kwargs,
    )


async def _demonstration(row: Row, limits: SandboxLimits, short_fix: bool, read_function: bool, gives_up: bool) -> Messages:
    """Run the tests, read the bugged module (`read_function`: only the bugged function), fix it
    (`short_fix`: by the shortest unique edit), run the tests again: with real replies. `gives_up`:
    stop after reading, without the edit."""
    info = row["info"]
    path, old, new = info["short_fix" if short_fix else "fix"]
    messages: Messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]
    with tempfile.TemporaryDirectory(prefix="tandem-code-fix-", ignore_cleanup_errors=True) as workdir:
        workspace = Workspace(Path(workdir) / "repo", info["num_tests"], limits)
        workspace.write_files(info["files"])
        messages += demo_tool_turn("call_1", "run_tests", {}, await run_tests(workspace))
        if read_function:
            name = info["buggy_function"]
            messages += demo_tool_turn("call_2", "view_function", {"path": path, "name": name},
                                       view_function(path, name, workspace))
        else:
            messages += demo_tool_turn("call_2", "view_file", {"path": path}, view_file(path, workspace))
        if gives_up:
            messages.append({"role": "assistant", "content": GIVE_UP_REPLY})
            return messages
        edit = {"path": path, "old": old, "new": new}
        messages += demo_tool_turn("call_3", "replace_text", edit, replace_text(path, old, new, workspace))
        messages += demo_tool_turn("call_4", "run_tests", {}, await run_tests(workspace))
        if not workspace.runs[-1].passed:
            raise RuntimeError(f"the demonstration fix did not pass the tests:\n{workspace.runs[-1].report}")
    messages.append({"role": "assistant", "content": "The tests pass."})
    return messages


def sft_examples(
    n: int, seed: int = 0, num_eval_examples: int = 100, num_functions: int = 4, short_fix: bool = False,
    read_function: bool = False, give_up_fraction: float = 0.0, max_concurrent: int = 4,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """`n` chats `{"messages": [...], "tools": [...]}` demonstrating the fix of the first `n`
    training repositories of `load_environment` with the same seed, `num_eval_examples` and
    `num_functions` (never an eval one), with the tools' real replies (each test run is a real
    sandboxed run, about 0.1 s). `progress(done)` after each demonstration: a thousand take minutes.

    `short_fix`: the edit replaces the shortest unique run of words around the bug (`-=` -> `+=`)
    instead of the whole buggy lines: a small model copies a few characters from the viewed file
    far more reliably than a line of code. `read_function`: read only the function the failing test
    names (`view_function`) instead of its whole module (`view_file`): fewer lines to find the bug in.

    `give_up_fraction`: the share of demonstrations (drawn at random, seeded) that stop after reading
    the code and reply without a fix (reward 0): an imperfect demonstrator whose slip the warm-up
    learns and RL's reward can remove (reverse_text's `misclosed_fraction` is the same idea)."""
    train, _ = _splits(n, num_eval_examples, seed, num_functions)
    slips = slip_draws(give_up_fraction, "give_up_fraction", f"give up {seed}")
    schemas = [tool_schema(tool, hidden=STATE_ARGS) for tool in TOOLS]
    done = 0

    async def all_demonstrations() -> list[Messages]:
        semaphore = asyncio.Semaphore(max_concurrent)

        async def bounded(row: Row, gives_up: bool) -> Messages:
            nonlocal done
            async with semaphore:
                messages = await _demonstration(row, SandboxLimits(), short_fix, read_function, gives_up)
            done += 1
            if progress is not None:
                progress(done)
            return messages

        return await asyncio.gather(*[bounded(row, slips()) for row in train])  # slips drawn in row order

    return [{"messages": messages, "tools": schemas} for messages in asyncio.run(all_demonstrations())]
