"""SWE-bench instances, and the git repositories they name, read from local files only.

An instance has SWE-bench's own fields: `instance_id`, `repo` ("owner/name"), `base_commit`,
`problem_statement`, `FAIL_TO_PASS` and `PASS_TO_PASS` (lists of test ids, or JSON strings of lists
as SWE-bench's published files hold them), `test_patch`, `patch`, and where present `version` and
`environment_setup_commit` (kept, not used: the tests run in tandem's own interpreter). Test ids are
pytest node ids, `path/to/test_file.py::Class::method` or `path/to/test_file.py::function`.

A repository `owner/name` is `<repos_dir>/owner__name` (a git checkout or bare repository, SWE-bench's
naming) or `<repos_dir>/owner__name.bundle` (a `git bundle`, cloned once into a private folder). The
environment never downloads: users with a network fetch repositories and instances themselves.

Invariant: no workspace holds a `.git`. Files come out of `git archive` into a plain folder and test
patches are applied in a scratch folder of our own, so code run in a sandbox can never plant git
configuration or hooks that a later git command of this (unconfined) process would run.
"""

import asyncio
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

# git reads no configuration of the machine's user or system: only the repository's own.
_GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0"}
_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


class InstanceSkipped(Exception):
    """An instance the environment cannot use; the message is the reason recorded for it."""


@dataclass(frozen=True)
class SweInstance:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_patch: str
    patch: str
    version: str | None = None
    environment_setup_commit: str | None = None

    @property
    def test_ids(self) -> tuple[str, ...]:
        return self.fail_to_pass + self.pass_to_pass

    @property
    def test_files(self) -> list[str]:
        """The files the instance's tests live in: what the agent's test runs run."""
        return sorted({test_id.split("::", 1)[0] for test_id in self.test_ids})

    @property
    def graded_files(self) -> list[str]:
        """Files restored before grading: those of the tests and those the test patch touches."""
        return sorted(set(self.test_files) | set(patch_files(self.test_patch)))


def patch_files(patch: str) -> list[str]:
    """Every path a git diff touches (both sides of a rename)."""
    return sorted({path for pair in _DIFF_HEADER.findall(patch) for path in pair})


def read_instances(path: Path) -> list[SweInstance]:
    """Instances of a JSON file (a list of objects) or a JSON Lines file (one object a line)."""
    text = Path(path).read_text()
    try:
        records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON or JSON Lines ({error})") from None
    return [instance_from_record(record, f"{path}: instance {record.get('instance_id', i)!r}") for i, record in enumerate(records)]


def instance_from_record(record: dict, where: str) -> SweInstance:
    """`record` (SWE-bench's field names) as an instance; errors name `where` and the field."""
    missing = [key for key in ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS",
                               "PASS_TO_PASS", "test_patch", "patch") if key not in record]
    if missing:
        raise ValueError(f"{where} lacks the field(s) {missing}")
    instance = SweInstance(
        instance_id=str(record["instance_id"]), repo=str(record["repo"]), base_commit=str(record["base_commit"]),
        problem_statement=str(record["problem_statement"]),
        fail_to_pass=_test_ids(record["FAIL_TO_PASS"], f"{where}, field FAIL_TO_PASS"),
        pass_to_pass=_test_ids(record["PASS_TO_PASS"], f"{where}, field PASS_TO_PASS"),
        test_patch=str(record["test_patch"]), patch=str(record["patch"]),
        version=None if record.get("version") is None else str(record["version"]),
        environment_setup_commit=record.get("environment_setup_commit"),
    )
    for path in instance.graded_files:  # the grader removes and rewrites these paths
        if not path or Path(path).is_absolute() or ".." in Path(path).parts:
            raise ValueError(f"{where}: test file {path!r} (of a test id or the test_patch) must be a relative path without '..'")
    return instance


def _test_ids(value: str | list, where: str) -> tuple[str, ...]:
    ids = json.loads(value) if isinstance(value, str) else value
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"{where} must be a list of test ids (or a JSON string of one), got {value!r}")
    return tuple(ids)


def git(git_dir: Path | None, *args: str) -> bytes:
    """Output of `git [--git-dir <git_dir>] <args>`; InstanceSkipped with git's message on failure."""
    where = [] if git_dir is None else ["--git-dir", str(git_dir)]
    result = subprocess.run(["git", *where, *args], capture_output=True, env={**os.environ, **_GIT_ENV})
    if result.returncode != 0:
        raise InstanceSkipped(f"git {args[0]} failed: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def read_files(git_dir: Path, commit: str, paths: list[str]) -> dict[str, str | None]:
    """The text of each path at `commit`; None for a path the commit does not have."""
    listed = git(git_dir, "ls-tree", "-r", "--name-only", "-z", commit, "--", *paths).decode().split("\0")
    present = set(listed) - {""}
    return {path: git(git_dir, "show", f"{commit}:{path}").decode() if path in present else None for path in paths}


def apply_patch(files: dict[str, str | None], patch: str) -> dict[str, str | None]:
    """`files` (path -> text, None = absent) after `git apply` of `patch`, done in a scratch folder of our
    own that no git repository encloses. InstanceSkipped when the patch does not apply."""
    with tempfile.TemporaryDirectory(prefix="tandem-swe-patch-") as scratch:
        root = Path(scratch, "tree")
        for path, text in files.items():
            if text is not None:
                Path(root, path).parent.mkdir(parents=True, exist_ok=True)
                Path(root, path).write_text(text)
        root.mkdir(exist_ok=True)
        result = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=root, input=patch.encode(),
                                capture_output=True, env={**os.environ, **_GIT_ENV, "GIT_CEILING_DIRECTORIES": scratch})
        if result.returncode != 0:
            raise InstanceSkipped(f"the patch does not apply: {result.stderr.decode(errors='replace').strip()}")
        return {path: Path(root, path).read_text() if Path(root, path).is_file() else None for path in files}


class RepositoryStore:
    """The git repositories of `repos_dir`; bundles are cloned, once, into a folder removed with the store."""

    def __init__(self, repos_dir: Path):
        self.repos_dir = Path(repos_dir)
        self._clones = Path(tempfile.mkdtemp(prefix="tandem-swe-repos-"))
        weakref.finalize(self, shutil.rmtree, self._clones, True)
        self._git_dirs: dict[str, Path] = {}

    def git_dir(self, repo: str) -> Path:
        """The git directory of `repo`; InstanceSkipped when `repos_dir` has neither form of it."""
        if repo not in self._git_dirs:
            folder = self.repos_dir / repo.replace("/", "__")
            bundle = folder.with_name(folder.name + ".bundle")
            if (folder / ".git").exists():
                self._git_dirs[repo] = folder / ".git"
            elif (folder / "HEAD").is_file() and (folder / "objects").is_dir():
                self._git_dirs[repo] = folder
            elif bundle.is_file():
                clone = self._clones / f"{folder.name}.git"
                git(None, "clone", "--bare", "--quiet", str(bundle), str(clone))
                self._git_dirs[repo] = clone
            else:
                raise InstanceSkipped(f"repository {repo} not found: neither {folder} (a git checkout) nor {bundle}")
        return self._git_dirs[repo]

    def check_commit(self, repo: str, commit: str) -> None:
        git_dir = self.git_dir(repo)
        try:
            git(git_dir, "cat-file", "-e", f"{commit}^{{commit}}")
        except InstanceSkipped:
            raise InstanceSkipped(f"base commit {commit} is not in repository {repo}") from None

    async def extract(self, repo: str, commit: str, dest: Path) -> None:
        """The tree of `commit` written into `dest` (no `.git`): `git archive`, extracted with tarfile's
        `data` filter (no absolute paths, no links leading out of `dest`)."""
        proc = await asyncio.create_subprocess_exec(
            "git", "--git-dir", str(self.git_dir(repo)), "archive", "--format=tar", commit,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, **_GIT_ENV})
        archive, error = await proc.communicate()
        if proc.returncode != 0:
            raise InstanceSkipped(f"git archive {commit} failed: {error.decode(errors='replace').strip()}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
