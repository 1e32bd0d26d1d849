"""Build SWE-bench instances from a repository's own bug fixes, as SWE-bench was built, each checked
by running it; the shipped set of `swe` (`data/swe/`) is this script's output.

    python -m tandem.envs.swe_mining --out tandem/envs/data/swe \\
        --source tkem/cachetools=/path/to/cachetools.git --source PyCQA/pyflakes=/path/to/pyflakes.git

A candidate is a commit (not a merge) whose message says it fixes something and that changes source
files and test files. Its parent is the base commit, its message the problem statement, its changes to
test files the test patch, its changes to `.py` files outside the tests the gold patch. Its test files
run in the sandbox with `swe`'s harness, at the base with the test patch and again with the gold patch:
FAIL_TO_PASS = tests that do not pass before and pass after, PASS_TO_PASS = tests that pass both times.
A candidate is kept when FAIL_TO_PASS is not empty and `swe`'s grader, run as in training, scores the
gold patch 1, the base 0 and a wrong patch 0 (`wrong_patch`: tests rewritten to pass, the code left
alone). Writes `instances.json`, `repos/<owner>__<name>.bundle` (the history up to the kept base
commits) and `licenses/<owner>__<name>.txt` (the repository's license file at its newest commit).
"""

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from tandem.envs.sandbox import SandboxLimits
from tandem.envs.swe_grading import PreparedInstance, apply_to_workspace, grade, prepare
from tandem.envs.swe_instances import (
    InstanceSkipped,
    RepositoryStore,
    SweInstance,
    git,
    instance_from_record,
)
from tandem.envs.swe_workspace import SweWorkspace

FIX_MESSAGE = re.compile(r"\b(fix(e[sd])?|bug|bugfix)\b", re.IGNORECASE)
TEST_PATH = re.compile(r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_test\.py$|(^|/)conftest\.py$")
NOT_SOURCE = re.compile(r"^(setup\.py|docs?/|examples?/|benchmarks?/|scripts?/|bin/)")
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.rst", "LICENSE.md", "COPYING")


def candidates(git_dir: Path, max_patch_lines: int) -> list[tuple[str, list[str], list[str]]]:
    """(commit, test files, source files) of each fix commit, oldest first; gold patches of more than
    `max_patch_lines` changed lines are left out."""
    found = []
    for commit in git(git_dir, "rev-list", "--no-merges", "--reverse", "HEAD").decode().split():
        if not FIX_MESSAGE.search(git(git_dir, "log", "-1", "--format=%B", commit).decode()):
            continue
        changed = git(git_dir, "diff-tree", "--no-commit-id", "--name-only", "-r", "--root", commit).decode().split()
        tests = [path for path in changed if TEST_PATH.search(path)]
        sources = [path for path in changed if path.endswith(".py") and path not in tests and not NOT_SOURCE.search(path)]
        if not tests or not sources:
            continue
        numstat = git(git_dir, "diff", "--numstat", f"{commit}^", commit, "--", *sources).decode().split("\n")
        size = sum(int(a) + int(d) for a, d, *_ in (line.split("\t") for line in numstat if line) if a != "-")
        if size <= max_patch_lines:
            found.append((commit, tests, sources))
    return found


def test_modules(root: Path, tests: list[str]) -> list[str]:
    """The changed test modules (`test*.py`); for a changed helper of the tests (a mixin in
    `tests/__init__.py`), every test module beside it."""
    modules = set()
    for path in tests:
        if not path.endswith(".py") or not (root / path).is_file():
            continue
        if Path(path).name.startswith("test"):
            modules.add(path)
        else:
            modules |= {str(p.relative_to(root)) for p in (root / path).parent.glob("test*.py")}
    return sorted(modules)


def wrong_patch(workspace: SweWorkspace, instance: SweInstance) -> None:
    """Edits that would pass every FAIL_TO_PASS test if the grader trusted the workspace's tests: each
    test file of the instance rewritten so its tests do nothing, the code left as it is."""
    classes: dict[str, dict[str, list[str]]] = {}
    for test_id in instance.test_ids:
        path, *names = test_id.split("::")
        owner, method = (names + [""])[:2] if len(names) == 2 else ("", names[0])
        classes.setdefault(path, {}).setdefault(owner, []).append(method)
    for path, owners in classes.items():
        lines = ["import unittest"]
        for owner, methods in owners.items():
            if owner:
                lines += [f"class {owner}(unittest.TestCase):"] + [f"    def {m}(self): pass" for m in methods]
            else:
                lines += [f"def {m}(): pass" for m in methods]
        target = workspace.path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n")


async def verdicts(store: RepositoryStore, prepared: PreparedInstance, limits: SandboxLimits) -> dict[str, bool]:
    """Whether the grader resolves the instance with the gold patch, at the base, and with `wrong_patch`."""
    instance = prepared.instance
    results = {}
    for name in ("gold", "base", "wrong"):
        with tempfile.TemporaryDirectory(prefix="tandem-swe-mining-") as workdir:
            workspace = SweWorkspace(Path(workdir, "repo"), instance.test_files, limits)
            await store.extract(instance.repo, instance.base_commit, workspace.root)
            if name == "gold":
                apply_to_workspace(workspace, instance.patch)
            elif name == "wrong":
                wrong_patch(workspace, instance)
            results[name] = (await grade(workspace, prepared)).resolved
    return results


async def mine_commit(store: RepositoryStore, repo: str, commit: str, tests: list[str], sources: list[str],
                      limits: SandboxLimits, max_run_s: float) -> dict:
    """The instance of `commit`, as a SWE-bench record; InstanceSkipped with the reason it is not one."""
    git_dir = store.git_dir(repo)
    parent = git(git_dir, "rev-parse", f"{commit}^").decode().strip()
    test_patch = git(git_dir, "diff", "--binary", parent, commit, "--", *tests).decode()
    gold = git(git_dir, "diff", parent, commit, "--", *sources).decode()
    with tempfile.TemporaryDirectory(prefix="tandem-swe-mining-") as workdir:
        workspace = SweWorkspace(Path(workdir, "repo"), [], limits)
        await store.extract(repo, parent, workspace.root)
        apply_to_workspace(workspace, test_patch)
        workspace.test_files = test_modules(workspace.root, tests)
        if not workspace.test_files:
            raise InstanceSkipped("no test module to run")
        started = time.monotonic()
        before, _ = await workspace.run(None)
        apply_to_workspace(workspace, gold)
        after, run = await workspace.run(None)
        elapsed = (time.monotonic() - started) / 2
    if not after.outcomes:
        raise InstanceSkipped(f"the tests do not run with the fix: {run.report[:300]}")
    if elapsed > max_run_s:
        raise InstanceSkipped(f"a test run takes {elapsed:.1f} s")
    fail_to_pass = [i for i, o in after.outcomes.items() if o == "passed" and before.outcomes.get(i) != "passed"]
    pass_to_pass = [i for i, o in after.outcomes.items() if o == "passed" and before.outcomes.get(i) == "passed"]
    if not fail_to_pass:
        raise InstanceSkipped("no test fails before the fix and passes after it")
    message = git(git_dir, "log", "-1", "--format=%B", commit).decode().replace("\r\n", "\n").strip()
    created = git(git_dir, "log", "-1", "--format=%cI", commit).decode().strip()
    return {"instance_id": f"{repo.replace('/', '__')}-{commit[:8]}", "repo": repo, "base_commit": parent,
            "problem_statement": message, "FAIL_TO_PASS": fail_to_pass, "PASS_TO_PASS": pass_to_pass,
            "test_patch": test_patch, "patch": gold, "created_at": created, "fix_commit": commit}


async def mine(store: RepositoryStore, repo: str, max_patch_lines: int, limits: SandboxLimits, max_run_s: float,
               max_concurrent: int, exclude: list[str]) -> list[dict]:
    semaphore = asyncio.Semaphore(max_concurrent)

    async def one(commit: str, tests: list[str], sources: list[str]) -> dict | None:
        async with semaphore:
            try:
                record = await mine_commit(store, repo, commit, tests, sources, limits, max_run_s)
                instance = instance_from_record(record, f"{repo} {commit[:8]}")
                results = await verdicts(store, prepare(store, instance), limits)
            except InstanceSkipped as error:
                print(f"{repo} {commit[:8]}: skipped, {error}", file=sys.stderr)
                return None
            if results != {"gold": True, "base": False, "wrong": False}:
                print(f"{repo} {commit[:8]}: skipped, the grader gives {results}", file=sys.stderr)
                return None
            print(f"{repo} {commit[:8]}: kept, {len(record['FAIL_TO_PASS'])} FAIL_TO_PASS, "
                  f"{len(record['PASS_TO_PASS'])} PASS_TO_PASS", file=sys.stderr)
            return record

    found = [c for c in candidates(store.git_dir(repo), max_patch_lines) if not any(c[0].startswith(e) for e in exclude)]
    print(f"{repo}: {len(found)} candidate commits", file=sys.stderr)
    return [r for r in await asyncio.gather(*(one(*c) for c in found)) if r is not None]


def write_bundle(git_dir: Path, base_commits: list[str], bundle: Path) -> None:
    """A bundle whose branches `swe/<commit>` hold every base commit (a clone fetches branches only)."""
    with tempfile.TemporaryDirectory(prefix="tandem-swe-bundle-") as scratch:
        clone = Path(scratch, "repo.git")
        git(None, "clone", "--bare", "--no-local", "--quiet", str(git_dir), str(clone))
        for commit in base_commits:
            git(clone, "update-ref", f"refs/heads/swe/{commit}", commit)
        bundle.parent.mkdir(parents=True, exist_ok=True)
        git(clone, "bundle", "create", "--quiet", str(bundle), *(f"refs/heads/swe/{c}" for c in base_commits))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", required=True, metavar="OWNER/NAME=GIT_DIR",
                        help="a repository and the git directory (or checkout) holding its history")
    parser.add_argument("--out", type=Path, required=True, help="folder to write instances.json, repos/ and licenses/ into")
    parser.add_argument("--max-patch-lines", type=int, default=40, help="largest gold patch, in changed lines")
    parser.add_argument("--max-per-repo", type=int, default=25, help="newest kept instances per repository")
    parser.add_argument("--max-run-s", type=float, default=5.0, help="slowest test run of an instance")
    parser.add_argument("--max-concurrent", type=int, default=2)
    parser.add_argument("--exclude", action="append", default=[], metavar="COMMIT",
                        help="a fix commit (or its prefix) to leave out, e.g. one whose tests depend on the Python release")
    args = parser.parse_args(argv)
    limits = SandboxLimits(wall_s=60.0, output_bytes=4_000_000)
    with tempfile.TemporaryDirectory(prefix="tandem-swe-sources-") as links:
        sources = dict(source.split("=", 1) for source in args.source)
        for repo, git_dir in sources.items():  # the store's naming: owner__name
            Path(links, repo.replace("/", "__")).symlink_to(Path(git_dir).resolve())
        store = RepositoryStore(Path(links))
        records = []
        for repo in sources:
            kept = asyncio.run(mine(store, repo, args.max_patch_lines, limits, args.max_run_s, args.max_concurrent,
                                    args.exclude))
            kept = sorted(kept, key=lambda r: r["created_at"])[-args.max_per_repo:]
            records += kept
            name = repo.replace("/", "__")
            write_bundle(store.git_dir(repo), sorted({r["base_commit"] for r in kept}), args.out / "repos" / f"{name}.bundle")
            head_files = git(store.git_dir(repo), "ls-tree", "--name-only", "HEAD").decode().split()
            license_file = next(f for f in LICENSE_FILES if f in head_files)
            (args.out / "licenses").mkdir(parents=True, exist_ok=True)
            (args.out / "licenses" / f"{name}.txt").write_bytes(git(store.git_dir(repo), "show", f"HEAD:{license_file}"))
    (args.out / "instances.json").write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {len(records)} instances to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
