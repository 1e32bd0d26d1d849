"""A SWE instance's tests run by the repository's own pytest, in the sandbox, with outcomes read back
from pytest's JUnit XML report as pytest node ids: fixtures, parametrized ids (`test_x[1-2]`), conftest
files and the repository's pytest configuration all work as they do for the repository's developers.

The interpreter is the user's (`python`: one with the repository's dependencies and pytest); the run is
`python -m pytest` in the workspace, whose folder comes first on `sys.path`, so the agent's copy of the
code is the one imported even where the repository is also installed. The instance's test files are
run whole, as SWE-bench's harness does, and the ids wanted are picked from the report: an id that pytest
could not select on its command line (spaces, odd parameters) still gets its outcome, and an id absent
from the report is `missing`.

What the report proves: it is written to a fresh random file name in a fresh folder outside the
repository and read after the run, without following links, so a report printed by the code under
test, or a file it leaves in the repository, or one an earlier run planted, counts for nothing. The
code under test runs in pytest's own process, though, and pytest imports what the workspace holds: code
that reads pytest's command line or patches pytest's reporting, or that an earlier run used to leave a
`conftest.py` or a module named like pytest's in the workspace (whose folder comes first on `sys.path`),
could still fake a pass. This guards against accidents and crude hacks, not a determined adversary (as
the standard-library harness of `swe_workspace`).
"""

import os
import secrets
import shutil
import stat
import subprocess
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from tandem.envs.sandbox import SandboxLimits, SandboxResult, run_python_sandboxed

MAX_DETAIL_CHARS = 1500
_WORST_FIRST = ("error", "failed", "skipped", "passed")
"""When one test id has several cases (a failed call and an error at teardown), the first of these wins."""


def check_pytest(python: str) -> None:
    """ValueError naming `python` unless it can import pytest."""
    try:
        result = subprocess.run([python, "-c", "import pytest"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"swe: python {python!r} (for test_runner = 'pytest') does not run: {error}") from None
    if result.returncode != 0:
        raise ValueError(f"swe: python {python!r} cannot import pytest, which test_runner = 'pytest' needs: "
                         f"{result.stderr.decode(errors='replace').strip()[-500:]}")


async def run_pytest(python: str, root: Path, files: list[str], ids: list[str] | None,
                     limits: SandboxLimits) -> tuple[tuple[dict[str, str], dict[str, str]] | None, SandboxResult]:
    """Run `files` under pytest: ((node id -> outcome, node id -> failure text) of `ids`, or of every
    test the report has when `ids` is None; None when the run left no readable report), the run."""
    if not files:  # pytest given no file runs every test it finds: none of the instance's files exist yet
        return ({}, {}), SandboxResult(returncode=0, output="")
    report_dir = Path(tempfile.mkdtemp(prefix="tandem-swe-report-"))
    report = report_dir / f"{secrets.token_hex(16)}.xml"
    try:
        args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir=.", f"--junitxml={report}", *files]
        result = await run_python_sandboxed(args, root, limits, interpreter=python, report_dir=report_dir)
        text = _read_regular_file(report, limits.file_bytes)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    if text is None:
        return None, result
    try:
        outcomes, details = outcomes_from_junit(text, files)
    except ElementTree.ParseError:
        return None, result
    if ids is None:
        return (outcomes, details), result
    return _pick(ids, outcomes, details), result


def _pick(ids: list[str], outcomes: dict[str, str], details: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The outcomes of `ids`; the tests of a file that failed to import share its error."""
    picked, picked_details = {}, {}
    for test_id in ids:
        source = test_id if test_id in outcomes else test_id.split("::", 1)[0]
        picked[test_id] = outcomes.get(source, "missing")
        if source in details:
            picked_details[test_id] = details[source]
    return picked, picked_details


def _read_regular_file(path: Path, limit: int) -> str | None:
    """The text of `path` if it is a regular file: a link or a pipe the sandboxed code put there is not
    followed or waited on."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(handle, "rb") as file:
        return file.read(limit).decode(errors="replace") if stat.S_ISREG(os.fstat(handle).st_mode) else None


def outcomes_from_junit(text: str, files: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(node id -> outcome, node id -> failure text) from a JUnit XML report. pytest writes a node id `a/b.py::C::t[x]` as
    classname `a.b.C`, name `t[x]`; the file part is found again among `files` (a test file that
    failed to import appears as a case named after its module, and is reported as that file's error)."""
    outcomes: dict[str, str] = {}
    details: dict[str, str] = {}
    for case in ElementTree.fromstring(text).iter("testcase"):
        test_id = _node_id(case.get("classname", ""), case.get("name", ""), files)
        outcome, detail = _case_outcome(case)
        previous = outcomes.get(test_id)
        if previous is None or _WORST_FIRST.index(outcome) < _WORST_FIRST.index(previous):
            outcomes[test_id] = outcome
        if detail:
            details[test_id] = detail[-MAX_DETAIL_CHARS:]
    return outcomes, details


def _node_id(classname: str, name: str, files: list[str]) -> str:
    for path in sorted(files, key=len, reverse=True):  # the longest module name that fits
        module = path.removesuffix(".py").replace("/", ".")
        if not classname and name == module:  # the file failed to import
            return path
        if classname == module or classname.startswith(module + "."):
            classes = classname[len(module) + 1:].split(".") if classname != module else []
            return "::".join([path, *classes, name])
    return f"{classname}::{name}" if classname else name


def _case_outcome(case: ElementTree.Element) -> tuple[str, str]:
    """(outcome, the failure's text); an expected failure (pytest.xfail) passes, as SWE-bench counts it."""
    for tag, outcome in (("error", "error"), ("failure", "failed")):
        element = case.find(tag)
        if element is not None:
            return outcome, (element.text or element.get("message", "")).strip()
    skipped = case.find("skipped")
    if skipped is not None:
        return ("passed" if skipped.get("type") == "pytest.xfail" else "skipped"), ""
    return "passed", ""
