"""SWE-bench's verdict on a workspace: after the agent's edits, the instance's test files are put back as
the base commit has them with the test patch applied, and its tests run. Resolved = every FAIL_TO_PASS
test passes and no PASS_TO_PASS test breaks (a skipped one does not break).

Whatever the agent left at a graded path (a file, a folder, a symlink, also in place of a parent folder)
is removed first, without following links, so edited or deleted tests count for nothing and nothing
outside the workspace is touched. `check_at_base` is the load-time check that an instance can be graded
at all.
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

from tandem.envs.swe_instances import (
    InstanceSkipped,
    RepositoryStore,
    SweInstance,
    apply_patch,
    patch_files,
    read_files,
)
from tandem.envs.swe_workspace import SweWorkspace, TestOutcomes


@dataclass(frozen=True)
class PreparedInstance:
    instance: SweInstance
    graded_files: dict[str, str | None]
    """Each graded path's text at the base commit with the test patch applied (None: absent there)."""


@dataclass
class Verdict:
    resolved: bool
    fail_to_pass_passed: list[str]
    pass_to_pass_broken: list[str]
    outcomes: TestOutcomes
    report: str
    """The final test run's report (what `run_tests` would show)."""


def prepare(store: RepositoryStore, instance: SweInstance) -> PreparedInstance:
    """The instance with its graded files; InstanceSkipped when its repository or base commit is
    missing or its test patch does not apply."""
    store.check_commit(instance.repo, instance.base_commit)
    paths = instance.graded_files
    base = read_files(store.git_dir(instance.repo), instance.base_commit, paths)
    try:
        return PreparedInstance(instance, apply_patch(base, instance.test_patch))
    except InstanceSkipped as error:
        raise InstanceSkipped(f"test_patch: {error}") from None


async def grade(workspace: SweWorkspace, prepared: PreparedInstance) -> Verdict:
    restore_files(workspace, prepared.graded_files)
    for cache in workspace.root.rglob("__pycache__"):  # bytecode the code may have planted
        shutil.rmtree(cache, ignore_errors=True)
    instance = prepared.instance
    outcomes, run = await workspace.run(list(instance.test_ids))
    passed = [i for i in instance.fail_to_pass if outcomes.outcomes.get(i) == "passed"]
    broken = [i for i in instance.pass_to_pass if outcomes.outcomes.get(i) not in ("passed", "skipped")]
    resolved = bool(outcomes.outcomes) and len(passed) == len(instance.fail_to_pass) and not broken
    return Verdict(resolved, passed, broken, outcomes, run.report)


def restore_files(workspace: SweWorkspace, files: dict[str, str | None]) -> None:
    for relative, text in files.items():
        _clear_path(workspace.root, Path(relative))
        if text is not None:
            workspace.write_files({relative: text})


def _clear_path(root: Path, relative: Path) -> None:
    """Remove what is at `root / relative`, and any link or file standing where one of its parent
    folders should be, never following a symlink (unlink removes the link, not its target)."""
    current = root
    for part in relative.parts:
        current = current / part
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            current.unlink()
            return
        if not current.exists():
            return
    shutil.rmtree(current)  # a real folder where the file belongs


async def check_at_base(workspace: SweWorkspace, prepared: PreparedInstance) -> None:
    """InstanceSkipped unless, at the base commit with the test patch, every PASS_TO_PASS test passes
    and every FAIL_TO_PASS test runs and fails: otherwise no edit could ever be scored right."""
    verdict = await grade(workspace, prepared)
    outcomes = verdict.outcomes.outcomes
    if not outcomes:
        raise InstanceSkipped(f"the tests do not run at the base commit: {verdict.report[:500]}")
    missing = [i for i in prepared.instance.test_ids if outcomes.get(i) == "missing"]
    if missing:
        raise InstanceSkipped(f"tests not found at the base commit (ids the harness cannot run?): {missing[:5]}")
    if verdict.pass_to_pass_broken:
        raise InstanceSkipped(f"PASS_TO_PASS tests fail at the base commit: {verdict.pass_to_pass_broken[:5]}")
    if verdict.fail_to_pass_passed:
        raise InstanceSkipped(f"FAIL_TO_PASS tests pass at the base commit already: {verdict.fail_to_pass_passed[:5]}")


def apply_to_workspace(workspace: SweWorkspace, patch: str) -> None:
    """`git apply` of `patch` to the workspace's files (in a scratch folder: see `apply_patch`);
    InstanceSkipped when it does not apply."""
    paths = patch_files(patch)
    current = {path: _read(workspace, path) for path in paths}
    restore_files(workspace, apply_patch(current, patch))


def _read(workspace: SweWorkspace, relative: str) -> str | None:
    path = workspace.path(relative)
    return path.read_text() if path.is_file() else None
