"""swe: resolve SWE-bench instances (real issues of real repositories) with code_fix's tools.

Each rollout gets the instance's repository at its base commit in a temporary directory of its own (no
`.git`: see `swe_instances`) and the tools of `code_fix` (`list_files`, `view_file`, `view_function`,
`replace_text`, `run_tests`) plus `search_text`, within `max_turns` model turns and `time_budget_s`
seconds. `run_tests` runs every test of the instance's test files as the workspace has them (not the
hidden FAIL_TO_PASS tests, which the test patch adds). When the episode ends, `swe_grading` restores the
test files, applies the test patch and runs FAIL_TO_PASS and PASS_TO_PASS: reward 1 when the instance is
resolved (SWE-bench's rule), else 0; `partial_credit` scores the share of FAIL_TO_PASS tests that pass
instead (0 when a PASS_TO_PASS test breaks). Tests run in `sandbox.run_python_sandboxed` under `limits`,
by `test_runner`: `harness` (`swe_workspace`: tandem's interpreter, standard library only, no pytest
fixtures or parametrized ids) or `pytest` (`swe_pytest`: the pytest of the interpreter `python`, which
the user gives the repository's dependencies).

Instances come from a local file (SWE-bench's JSON fields), by default the set shipped in `data/swe/`
(real bug fixes of small MIT-licensed repositories, `swe_mining` builds it); repositories from
`repos_dir`. An instance whose repository or base commit is missing, whose test patch does not apply or
whose tests do not run at the base commit is skipped at load: its id and the reason are logged (the
orchestrator's log of a run) and kept in `SweEnv.skipped`.
"""

import ast
import asyncio
import logging
import re
import sys
import tempfile
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.envs.code_fix import (
    list_files,
    num_sandbox_violations,
    replace_text,
    run_tests,
    view_file,
    view_function,
)
from tandem.envs.code_fix_workspace import Workspace
from tandem.envs.rubric import Rubric
from tandem.envs.sandbox import SandboxLimits
from tandem.envs.splits import split_items
from tandem.envs.swe_grading import PreparedInstance, check_at_base, grade, prepare
from tandem.envs.swe_instances import (
    InstanceSkipped,
    RepositoryStore,
    SweInstance,
    apply_patch,
    patch_files,
    read_files,
    read_instances,
)
from tandem.envs.swe_pytest import check_pytest
from tandem.envs.swe_workspace import SweWorkspace
from tandem.envs.tool_env import ToolEnv, demo_tool_turn
from tandem.envs.tool_schema import tool_schema
from tandem.envs.types import Info, Messages, State

DATA_DIR = Path(__file__).with_name("data") / "swe"
SYSTEM_PROMPT = (
    "You resolve issues of Python repositories with the tools list_files, search_text, view_file, "
    "view_function, replace_text and run_tests. Change the code, not the tests, until the issue is "
    "resolved, then reply without a tool call."
)
MAX_SEARCH_MATCHES = 50
log = logging.getLogger(__name__)
# The rollout's workspace, set by `SweEnv.rollout` for its `setup_state`, which the base loop calls
# without a way to pass it.
_workspace: ContextVar[SweWorkspace] = ContextVar("swe_workspace")


def search_text(text: str, workspace: Workspace) -> str:
    """Find the lines of the repository's files that contain a piece of text.

    Args:
        text: The exact text to look for, e.g. def popitem.
    """
    if not text:
        raise ValueError("give a non-empty text to look for")
    matches = []
    for path in sorted(p for p in workspace.root.rglob("*") if "__pycache__" not in p.parts):
        relative = str(path.relative_to(workspace.root))
        try:  # the same files the other tools may open: no links, no folders
            lines = workspace.path(relative).read_text().splitlines() if path.is_file() else []
        except (ValueError, OSError):
            continue
        matches += [f"{relative}:{n}: {line.strip()[:200]}" for n, line in enumerate(lines, 1) if text in line]
    if not matches:
        return f"No line contains {text!r}."
    more = len(matches) - MAX_SEARCH_MATCHES
    return "\n".join(matches[:MAX_SEARCH_MATCHES] + ([f"[... {more} more]"] if more > 0 else []))


TOOLS = [list_files, search_text, view_file, view_function, replace_text, run_tests]
STATE_ARGS = ("workspace",)


class SweEnv(ToolEnv):
    def __init__(self, instances: dict[str, PreparedInstance], store: RepositoryStore, limits: SandboxLimits,
                 time_budget_s: float, skipped: dict[str, str], pytest_python: str | None = None, **kwargs: Any):
        kwargs.setdefault("tool_timeout_s", limits.wall_s + 15.0)  # a test run ends at its own wall limit first
        super().__init__(tools=TOOLS, state_args=STATE_ARGS, **kwargs)
        if time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0, got {time_budget_s}")
        self.instances, self.store, self.limits = instances, store, limits
        self.time_budget_s = time_budget_s
        self.pytest_python = pytest_python  # None: the standard-library harness runs the tests
        self.skipped = skipped  # instance id -> why it was left out at load

    def setup_state(self, state: State, **kwargs: Any) -> State:
        state = super().setup_state(state)
        state["workspace"] = _workspace.get()
        state["deadline"] = time.monotonic() + self.time_budget_s
        return state

    def update_tool_args(self, name: str, args: dict[str, Any], state: State) -> dict[str, Any]:
        return {**args, "workspace": state["workspace"]}

    def is_completed(self, messages: Messages, state: State, **kwargs: Any) -> bool:
        state["out_of_time"] = time.monotonic() > state["deadline"]
        return state["out_of_time"] or super().is_completed(messages, state)

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
        """The tool loop in the instance's repository, in a fresh temporary directory, then the grading
        there; the directory is gone when this returns, whatever happened."""
        prepared = self.instances[(info or {})["instance_id"]]
        with tempfile.TemporaryDirectory(prefix="tandem-swe-", ignore_cleanup_errors=True) as workdir:
            workspace = await _checkout(self.store, prepared, Path(workdir), self.limits, self.pytest_python)
            token = _workspace.set(workspace)
            try:
                completion, state = await super().rollout(client, model, prompt, answer, task, info, sampling_args)
            finally:
                _workspace.reset(token)
            verdict = await grade(state.pop("workspace"), prepared)
            state.update(resolved=verdict.resolved, final_test_report=verdict.report,
                         fail_to_pass_passed=len(verdict.fail_to_pass_passed),
                         num_fail_to_pass=len(prepared.instance.fail_to_pass),
                         pass_to_pass_broken=verdict.pass_to_pass_broken,
                         sandbox_violations=[run.sandbox.violation for run in workspace.runs if run.sandbox.violation],
                         sandbox_enforced=workspace.runs[-1].sandbox.enforced)
        return completion, state


async def _checkout(store: RepositoryStore, prepared: PreparedInstance, workdir: Path, limits: SandboxLimits,
                    pytest_python: str | None = None) -> SweWorkspace:
    instance = prepared.instance
    root = workdir / "repo"
    await store.extract(instance.repo, instance.base_commit, root)
    return SweWorkspace(root, instance.test_files, limits, pytest_python)


def resolved_reward(state: State) -> float:
    """1 when every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks (SWE-bench's "resolved")."""
    return float(state.get("resolved", False))


def fail_to_pass_reward(state: State) -> float:
    """The share of FAIL_TO_PASS tests that pass; 0 when a PASS_TO_PASS test breaks."""
    if state.get("pass_to_pass_broken") or not state.get("num_fail_to_pass"):
        return 0.0
    return state["fail_to_pass_passed"] / state["num_fail_to_pass"]


def num_pass_to_pass_broken(state: State) -> float:
    return float(len(state.get("pass_to_pass_broken", [])))


def _question(instance: SweInstance) -> str:
    return f"Repository {instance.repo}. Resolve this issue:\n\n{instance.problem_statement.strip()}"


def _row(prepared: PreparedInstance) -> dict[str, Any]:
    instance = prepared.instance
    return {"question": _question(instance), "answer": "", "task": "swe",
            "info": {"instance_id": instance.instance_id, "repo": instance.repo}}


async def _usable(store: RepositoryStore, instances: list[SweInstance], limits: SandboxLimits,
                  max_concurrent: int, pytest_python: str | None) -> tuple[dict[str, PreparedInstance], dict[str, str]]:
    """(instance id -> prepared instance, instance id -> why it was skipped), each checked at its base commit."""
    semaphore = asyncio.Semaphore(max_concurrent)

    async def check(instance: SweInstance) -> PreparedInstance:
        async with semaphore:
            prepared = prepare(store, instance)
            with tempfile.TemporaryDirectory(prefix="tandem-swe-", ignore_cleanup_errors=True) as workdir:
                await check_at_base(await _checkout(store, prepared, Path(workdir), limits, pytest_python), prepared)
            return prepared

    results = await asyncio.gather(*(check(i) for i in instances), return_exceptions=True)
    usable, skipped = {}, {}
    for instance, result in zip(instances, results):
        if isinstance(result, InstanceSkipped):
            skipped[instance.instance_id] = str(result)
        elif isinstance(result, BaseException):
            raise result
        else:
            usable[instance.instance_id] = result
    return usable, skipped


def _load(instances_path: str | Path | None, repos_dir: str | Path | None, instance_ids: list[str] | None,
          limits: SandboxLimits, max_concurrent_checks: int,
          pytest_python: str | None) -> tuple[RepositoryStore, dict[str, PreparedInstance], dict[str, str]]:
    path = Path(instances_path) if instances_path is not None else DATA_DIR / "instances.json"
    instances = read_instances(path)
    if instance_ids is not None:
        unknown = sorted(set(instance_ids) - {i.instance_id for i in instances})
        if unknown:
            raise ValueError(f"instance_ids: {unknown} are not in {path}")
        instances = [i for i in instances if i.instance_id in set(instance_ids)]
    store = RepositoryStore(Path(repos_dir) if repos_dir is not None else DATA_DIR / "repos")
    usable, skipped = asyncio.run(_usable(store, instances, limits, max_concurrent_checks, pytest_python))
    for instance_id, reason in skipped.items():
        log.warning("swe: skipped instance %s: %s", instance_id, reason)
    return store, usable, skipped


def _splits(usable: dict[str, PreparedInstance], num_eval_examples: int, seed: int) -> tuple[list[str], list[str]]:
    return split_items(sorted(usable), -1, num_eval_examples, seed, "swe has {} usable instances")


def load_environment(
    instances_path: str | None = None,
    repos_dir: str | None = None,
    instance_ids: list[str] | None = None,
    num_eval_examples: int = 8,
    seed: int = 0,
    max_turns: int = 16,
    time_budget_s: float = 600.0,
    partial_credit: bool = False,
    limits: dict[str, Any] | None = None,
    max_concurrent_checks: int = 4,
    test_runner: str = "harness",
    python: str | None = None,
    **kwargs: Any,
) -> SweEnv:
    """`instances_path`: a JSON or JSON Lines file of SWE-bench instances (default: the shipped set);
    `repos_dir`: the folder of their repositories (default: the shipped bundles); `instance_ids`: use only
    these. The usable instances are split, seeded, into `num_eval_examples` held out and the rest for
    training. `limits`: `SandboxLimits` fields (cpu_s, memory_mb, wall_s, ...); `max_concurrent_checks`:
    instances checked at their base commit at once while loading. `test_runner`: `harness` (tandem's
    interpreter, standard library only) or `pytest` (the repository's own pytest, run by `python`: an
    interpreter with the repository's dependencies and pytest; default tandem's own, `sys.executable`)."""
    sandbox_limits = SandboxLimits(**(limits or {}))
    pytest_python = _pytest_python(test_runner, python)
    store, usable, skipped = _load(instances_path, repos_dir, instance_ids, sandbox_limits, max_concurrent_checks,
                                   pytest_python)
    train, eval_ids = _splits(usable, num_eval_examples, seed)
    rubric = Rubric(funcs=[resolved_reward, fail_to_pass_reward, num_pass_to_pass_broken, num_sandbox_violations],
                    weights=[0.0, 1.0, 0.0, 0.0] if partial_credit else [1.0, 0.0, 0.0, 0.0])
    return SweEnv(
        instances=usable, store=store, limits=sandbox_limits, time_budget_s=time_budget_s, skipped=skipped,
        pytest_python=pytest_python,
        max_turns=max_turns,
        dataset=[_row(usable[i]) for i in train],
        eval_dataset=[_row(usable[i]) for i in eval_ids],
        system_prompt=SYSTEM_PROMPT,
        rubric=rubric,
        **kwargs,
    )


def _pytest_python(test_runner: str, python: str | None) -> str | None:
    """The interpreter whose pytest runs the tests (checked now, once), or None for the harness."""
    if test_runner == "harness":
        if python is not None:
            log.warning("swe: python = %r has no effect with test_runner = 'harness' (set test_runner = 'pytest')", python)
        return None
    if test_runner != "pytest":
        raise ValueError(f"swe: test_runner = {test_runner!r} is not a test runner: use 'harness' or 'pytest'")
    python = python if python is not None else sys.executable
    check_pytest(python)
    return python


class NotDemonstrable(Exception):
    """A gold patch the tools cannot replay (a new, deleted or renamed file; a hunk without unique text)."""


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str
    line: int
    """The number, in the file before the patch, of the first line `old` covers (for the function around it)."""


_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


def gold_edits(patch: str, files: dict[str, str]) -> list[Edit]:
    """The `replace_text` calls that turn `files` (path -> text before) into what `patch` makes of them,
    each `old` trimmed to the fewest lines of context that keep it unique in the file."""
    edits, texts = [], dict(files)
    for section in re.split(r"^diff --git ", patch, flags=re.MULTILINE)[1:]:
        rows = section.split("\n")
        starts = [i for i, row in enumerate(rows) if row.startswith("@@")]
        header = rows[: starts[0] if starts else len(rows)]
        if not starts or any(row.startswith(("new file", "deleted file", "rename from", "Binary files")) for row in header):
            raise NotDemonstrable(f"the patch creates, deletes or renames a file, or is binary: {rows[0]}")
        path = next(row[len("+++ b/"):] for row in header if row.startswith("+++ b/"))
        for start, end in zip(starts, starts[1:] + [len(rows)]):
            edit = _hunk_edit(path, rows[start], rows[start + 1 : end], texts[path])
            texts[path] = texts[path].replace(edit.old, edit.new, 1)
            edits.append(edit)
    if texts != apply_patch(dict(files), patch):
        raise NotDemonstrable("the edits do not reproduce the patch")
    return edits


def _hunk_edit(path: str, header: str, rows: list[str], text: str) -> Edit:
    lines = [(row[:1], row[1:]) for row in rows if row[:1] in (" ", "-", "+")]
    first_old = int(_HUNK.match(header).group(1))

    def old_new(part: list[tuple[str, str]]) -> tuple[str, str]:
        return ("".join(f"{t}\n" for tag, t in part if tag != "+"), "".join(f"{t}\n" for tag, t in part if tag != "-"))

    start, end = 0, len(lines)
    for trim_front in (True, False):  # drop context lines while what is left stays unique
        while True:
            s, e = (start + 1, end) if trim_front else (start, end - 1)
            part = lines[s:e]
            edge = lines[start] if trim_front else lines[end - 1]
            old, _ = old_new(part)
            if edge[0] != " " or not old or text.count(old) != 1:
                break
            start, end = s, e
    old, new = old_new(lines[start:end])
    if text.count(old) != 1:
        raise NotDemonstrable(f"hunk {header} of {path} has no text that occurs once")
    return Edit(path, old, new, first_old + sum(1 for tag, _ in lines[:start] if tag != "+"))


def _enclosing_function(source: str, line: int) -> str | None:
    """The innermost function around `line`, if its name is the only function of that name in the file
    (`view_function` shows the first of a name)."""
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    around = [n for n in functions if n.lineno <= line <= n.end_lineno]
    if not around:
        return None
    name = max(around, key=lambda n: n.lineno).name
    return name if sum(n.name == name for n in functions) == 1 else None


async def _demonstration(store: RepositoryStore, prepared: PreparedInstance, limits: SandboxLimits,
                         pytest_python: str | None) -> Messages:
    """Run the tests, view each function the gold patch changes, make its edits, run the tests again:
    with the tools' real replies."""
    instance = prepared.instance
    sources = read_files(store.git_dir(instance.repo), instance.base_commit, patch_files(instance.patch))
    if any(text is None for text in sources.values()):
        raise NotDemonstrable("the patch creates a file")
    edits = gold_edits(instance.patch, sources)
    messages: Messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": _question(instance)}]
    with tempfile.TemporaryDirectory(prefix="tandem-swe-", ignore_cleanup_errors=True) as workdir:
        workspace = await _checkout(store, prepared, Path(workdir), limits, pytest_python)
        calls = 0

        def turn(name: str, arguments: dict[str, Any], reply: str) -> None:
            nonlocal calls
            calls += 1
            messages.extend(demo_tool_turn(f"call_{calls}", name, arguments, reply))

        turn("run_tests", {}, await run_tests(workspace))
        viewed = []
        for edit in edits:
            name = _enclosing_function(sources[edit.path], edit.line)
            if name is not None and (edit.path, name) not in viewed:
                viewed.append((edit.path, name))
                turn("view_function", {"path": edit.path, "name": name}, view_function(edit.path, name, workspace))
        for edit in edits:
            arguments = {"path": edit.path, "old": edit.old, "new": edit.new}
            turn("replace_text", arguments, replace_text(edit.path, edit.old, edit.new, workspace))
        turn("run_tests", {}, await run_tests(workspace))
    messages.append({"role": "assistant", "content": f"I changed {', '.join(sorted(sources))} to resolve the issue."})
    return messages


def sft_examples(
    n: int, seed: int = 0, num_eval_examples: int = 8, instances_path: str | None = None, repos_dir: str | None = None,
    instance_ids: list[str] | None = None, limits: dict[str, Any] | None = None, max_concurrent: int = 4,
    progress: Callable[[int], None] | None = None, test_runner: str = "harness", python: str | None = None,
) -> list[dict[str, Any]]:
    """`n` chats `{"messages": [...], "tools": [...]}` replaying the gold patches of the training instances
    of `load_environment` with the same instances, seed, `num_eval_examples` (never an eval one) and
    `test_runner` and `python` (the same instances are usable), with
    the tools' real replies, in the split's order and over again until there are `n` (each instance's
    demonstration is made once). Instances whose patch the tools cannot replay (`NotDemonstrable`) are left
    out. `progress(done)` after each distinct demonstration, and `progress(n)` once all `n` rows are made."""
    sandbox_limits = SandboxLimits(**(limits or {}))
    pytest_python = _pytest_python(test_runner, python)
    store, usable, _ = _load(instances_path, repos_dir, instance_ids, sandbox_limits, max_concurrent, pytest_python)
    train, _ = _splits(usable, num_eval_examples, seed)
    schemas = [tool_schema(tool, hidden=STATE_ARGS) for tool in TOOLS]
    done = 0

    async def all_demonstrations() -> list[Messages | None]:
        semaphore = asyncio.Semaphore(max_concurrent)

        async def bounded(instance_id: str) -> Messages | None:
            nonlocal done
            async with semaphore:
                try:
                    messages = await _demonstration(store, usable[instance_id], sandbox_limits, pytest_python)
                except NotDemonstrable as error:
                    log.info("swe: no demonstration of %s: %s", instance_id, error)
                    messages = None
            done += 1
            if progress is not None:
                progress(done)
            return messages

        return await asyncio.gather(*(bounded(i) for i in train))

    demonstrations = [m for m in asyncio.run(all_demonstrations()) if m is not None]
    if not demonstrations:
        raise ValueError(f"none of the {len(train)} training instances has a patch the tools can replay")
    if progress is not None:
        progress(n)
    return [{"messages": demonstrations[i % len(demonstrations)], "tools": schemas} for i in range(n)]
