"""One SWE instance's repository on disk, and its tests run in the sandbox, test by test.

By default the tests run in `HARNESS`, which needs only the standard library (the sandbox runs
tandem's interpreter, not the repository's environment): it runs `unittest.TestCase` methods and plain
`test*` functions without arguments, by pytest node id (`path.py::Class::method`, `path.py::function`);
parametrized ids and pytest fixtures are not supported (such a test is reported missing). The repository
root and its `src/` folder, where present, are put on `sys.path`. With `pytest_python`, the repository's
own pytest runs them instead (`swe_pytest`).

What a harness result proves, as `code_fix_workspace` states for its harness: every `.py` file of the folders
holding the test files is read before any code runs, and imported from that copy, so code under test
that rewrites tests while they run changes nothing; outcomes come back on a line carrying a per-run
secret, so a fake printed report counts for nothing, and a run that dies early has no outcome (every
test failed). Code that patches `unittest` or digs the secret out of the harness could still fake a
pass: this guards against accidents and crude hacks, not a determined adversary.
"""

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from tandem.envs.code_fix_workspace import (
    _LIMIT_ERRORS,
    MAX_REPORT_CHARS,
    TestRun,
    Workspace,
)
from tandem.envs.sandbox import SandboxLimits, SandboxResult, run_python_sandboxed
from tandem.envs.swe_pytest import run_pytest

# stdin: the secret, then {"files": [...], "ids": [...] or null (every test of the files)}.
HARNESS = r'''
import contextlib, importlib, importlib.abc, importlib.util, inspect, io, json, os, sys, traceback, unittest
secret = sys.stdin.readline().strip()
request = json.loads(sys.stdin.readline())
root = os.getcwd()
sys.path[:0] = [root] + ([os.path.join(root, "src")] if os.path.isdir("src") else [])


def module_name(path):
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


pinned = {}
for folder in sorted({os.path.dirname(path) for path in request["files"]}):
    if not os.path.isdir(folder or "."):
        continue
    for entry in sorted(os.listdir(folder or ".")):
        path = os.path.join(folder, entry)
        if entry.endswith(".py") and os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as file:
                pinned[module_name(path)] = (os.path.join(root, path), file.read())


class PinnedLoader(importlib.abc.Loader):
    def __init__(self, filename, source):
        self.filename, self.source = filename, source

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec(compile(self.source, self.filename, "exec"), module.__dict__)


class PinnedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in pinned:
            return None
        filename, source = pinned[name]
        package = [os.path.dirname(filename)] if filename.endswith("__init__.py") else None
        return importlib.util.spec_from_file_location(name, filename, loader=PinnedLoader(filename, source),
                                                      submodule_search_locations=package)


sys.meta_path.insert(0, PinnedFinder())
outcomes, details = {}, {}


class Recorder(unittest.TestResult):
    def record(self, test, outcome, error=None):
        test_id = ids_of.get(id(test))
        if test_id is None:  # a class or module fixture failed: its tests get no outcome, hence "error"
            return
        if outcomes.get(test_id) in (None, "passed", "skipped"):
            outcomes[test_id] = outcome
        if error is not None:
            details[test_id] = "".join(traceback.format_exception(*error))[-1500:]

    def addSuccess(self, test):
        self.record(test, "passed")

    def addFailure(self, test, err):
        self.record(test, "failed", err)

    def addError(self, test, err):
        self.record(test, "error", err)

    def addSkip(self, test, reason):
        self.record(test, "skipped")

    def addExpectedFailure(self, test, err):
        self.record(test, "passed")

    def addUnexpectedSuccess(self, test):
        self.record(test, "failed")

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self.record(test, "failed" if issubclass(err[0], test.failureException) else "error", err)


def load(path):
    try:
        return importlib.import_module(module_name(path)), None
    except BaseException:
        return None, traceback.format_exc()[-1500:]


def collect(path, module):
    ids = []
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if isinstance(obj, type) and issubclass(obj, unittest.TestCase):
            ids += [f"{path}::{name}::{method}" for method in unittest.defaultTestLoader.getTestCaseNames(obj)]
        elif inspect.isfunction(obj) and name.startswith("test"):
            ids.append(f"{path}::{name}")
    return ids


def needs_arguments(function):
    # pytest would pass fixtures or parameters; this harness has none to give
    return any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in inspect.signature(function).parameters.values())


def run_function(test_id, function):
    try:
        function()
        outcomes[test_id] = "passed"
    except unittest.SkipTest:
        outcomes[test_id] = "skipped"
    except BaseException as error:
        outcomes[test_id] = "failed" if isinstance(error, AssertionError) else "error"
        details[test_id] = traceback.format_exc()[-1500:]


ids_of = {}
captured = io.StringIO()
with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
    modules = {path: load(path) for path in request["files"]}
    wanted = request["ids"]
    if wanted is None:
        wanted = []
        for path, (module, error) in modules.items():
            if module is None:
                outcomes[path], details[path] = "error", error
            else:
                wanted += collect(path, module)
    suite, functions = unittest.TestSuite(), []
    for test_id in wanted:
        path, *names = test_id.split("::")
        module, error = modules.get(path, (None, "not a test file of this run"))
        if module is None:
            outcomes[test_id], details[test_id] = "error", error
            continue
        owner = getattr(module, names[0], None) if names else None
        if len(names) == 2 and isinstance(owner, type) and issubclass(owner, unittest.TestCase) and hasattr(owner, names[1]):
            test = owner(names[1])
            ids_of[id(test)] = test_id
            suite.addTest(test)
        elif len(names) == 1 and inspect.isfunction(owner) and not needs_arguments(owner):
            functions.append((test_id, owner))
        else:
            outcomes[test_id] = "missing"
    suite.run(Recorder())
    for test_id, function in functions:
        run_function(test_id, function)
for test_id in wanted:
    outcomes.setdefault(test_id, "error")
sys.stdout.write(f"\n{secret} " + json.dumps({"outcomes": outcomes, "details": details}) + "\n")
sys.stdout.flush()
os._exit(0)  # threads a test left running must not hold the exit
'''


@dataclass
class TestOutcomes:
    outcomes: dict[str, str]
    """Test id -> passed, failed, error, skipped or missing (empty when the run ended early)."""
    details: dict[str, str]
    """Test id -> the tail of its traceback, for tests that did not pass."""


class SweWorkspace(Workspace):
    """The repository of one rollout, and the test runs made in it."""

    def __init__(self, root: Path, test_files: list[str], limits: SandboxLimits, pytest_python: str | None = None):
        super().__init__(root, num_tests=0, limits=limits)  # the count is code_fix's; here each test reports itself
        self.test_files = test_files
        self.pytest_python = pytest_python
        """None: tests run in the standard-library harness; a path: in that interpreter's pytest (`swe_pytest`)."""

    async def run_tests(self) -> TestRun:
        """The agent's test run: every test of the instance's test files as they stand."""
        return (await self.run(None))[1]

    async def run(self, ids: list[str] | None) -> tuple[TestOutcomes, TestRun]:
        """Run the tests `ids` (None: every test the test files define)."""
        # The agent's runs skip test files the test patch has yet to add.
        files = self.test_files if ids is not None else [f for f in self.test_files if (self.root / f).is_file()]
        if self.pytest_python is None:
            found, result = await self._run_harness(files, ids)
        else:
            found, result = await run_pytest(self.pytest_python, self.root, files, ids, self.limits)
        output = result.output.replace(f"{self.root}/", "").strip()
        outcomes = TestOutcomes({}, {})
        if found is not None and result.violation is None:
            details = {test_id: text.replace(f"{self.root}/", "") for test_id, text in found[1].items()}
            outcomes = TestOutcomes(found[0], details)
        if result.violation is None:  # RLIMIT_AS and RLIMIT_FSIZE make Python raise rather than die
            seen = output + "".join(outcomes.details.values())
            result.violation = next((name for error, name in _LIMIT_ERRORS.items() if error in seen), None)
        report = _report(outcomes, result.violation, output) if found is not None or result.violation else _ended_early(output)
        run = TestRun(result.violation is None and bool(outcomes.outcomes) and _all_pass(outcomes), report, result)
        self.runs.append(run)
        return outcomes, run

    async def _run_harness(self, files: list[str], ids: list[str] | None) -> tuple[tuple[dict[str, str], dict[str, str]] | None, SandboxResult]:
        """`HARNESS` in the sandbox: its (outcomes, details), None when it printed none; the run, its
        output without the report line."""
        secret = secrets.token_hex(16)
        request = json.dumps({"files": files, "ids": ids})
        result = await run_python_sandboxed(["-B", "-c", HARNESS], self.root, self.limits,
                                            stdin=f"{secret}\n{request}\n".encode())
        found = re.findall(rf"^{secret} (.*)$", result.output, re.MULTILINE)
        result.output = re.sub(rf"^{secret} .*$", "", result.output, flags=re.MULTILINE)
        if not found:
            return None, result
        record = json.loads(found[-1])
        return (record["outcomes"], record["details"]), result


def _ended_early(output: str) -> str:
    return f"FAILED: the test run ended early\n{output[-MAX_REPORT_CHARS:]}".strip()


def _all_pass(outcomes: TestOutcomes) -> bool:
    return all(outcome in ("passed", "skipped") for outcome in outcomes.outcomes.values())


def _report(outcomes: TestOutcomes, violation: str | None, output: str) -> str:
    """What the model reads: PASSED/FAILED with counts, then each test that did not pass and its traceback."""
    if violation is not None:
        return f"FAILED: stopped at the sandbox's {violation} limit\n{output[-MAX_REPORT_CHARS:]}".strip()
    if not outcomes.outcomes:
        return "FAILED: no test ran"
    counts: dict[str, int] = {}
    for outcome in outcomes.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    summary = ", ".join(f"{counts[name]} {name}" for name in ("passed", "failed", "error", "skipped", "missing") if name in counts)
    lines = [f"{'PASSED' if _all_pass(outcomes) else 'FAILED'}: {len(outcomes.outcomes)} tests ran: {summary}"]
    for test_id, outcome in outcomes.outcomes.items():
        if outcome not in ("passed", "skipped"):
            lines.append(f"{outcome.upper()}: {test_id}\n{outcomes.details.get(test_id, '').strip()}")
    return "\n".join(lines)[:MAX_REPORT_CHARS]
