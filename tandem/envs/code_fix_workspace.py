"""One `code_fix` rollout's repository on disk: paths confined to it, and sandboxed test runs.

The test harness runs in the same interpreter as the code it tests. It reads every test file
before running any, prints a per-run secret with the counts, and a run passes only with that line,
all `num_tests` tests run, none failed, and exit status 0: exiting early, printing a fake summary,
or rewriting the tests fails. In-process tricks are not defended: code that patches `unittest`,
returns an object equal to everything, or digs the secret out of the harness's frames could fake
a pass. This guards against accidents and crude hacks, not a determined adversary.
"""

import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from tandem.envs.sandbox import SandboxLimits, SandboxResult, run_python_sandboxed

# Test sources are read before any of them runs (and so before the code under test is
# imported): code that rewrites tests/ while the tests run changes nothing.
HARNESS = """
import pathlib, sys, types, unittest
secret = sys.stdin.readline().strip()
sources = [(p.stem, p.read_text()) for p in sorted(pathlib.Path("tests").glob("test_*.py"))]
sys.path.insert(0, "")


def failed_import(name, error):
    def test():
        raise error
    return unittest.FunctionTestCase(test, description=f"import tests/{name}.py")


suite = unittest.TestSuite()
for name, source in sources:
    module = types.ModuleType(f"tests.{name}")
    try:
        exec(compile(source, f"tests/{name}.py", "exec"), module.__dict__)
    except Exception as error:
        suite.addTest(failed_import(name, error))
    else:
        suite.addTests(unittest.defaultTestLoader.loadTestsFromModule(module))
result = unittest.TextTestRunner(stream=sys.stdout, verbosity=1).run(suite)
print(f"{secret} run={result.testsRun} failures={len(result.failures)} errors={len(result.errors)}", flush=True)
"""
MAX_REPORT_CHARS = 2_000
_TIMING = re.compile(r"^(Ran \d+ tests?) in [\d.]+s$", re.MULTILINE)
_LIMIT_ERRORS = {"MemoryError": "memory", "[Errno 27] File too large": "file_size"}


@dataclass
class TestRun:
    passed: bool
    report: str
    """What the model reads: PASSED/FAILED, the counts or the limit hit, and the output's tail."""
    sandbox: SandboxResult


class Workspace:
    """One rollout's repository on disk, and the test runs made in it."""

    def __init__(self, root: Path, num_tests: int, limits: SandboxLimits):
        self.root = root.resolve()
        self.num_tests = num_tests
        self.limits = limits
        self.runs: list[TestRun] = []

    def path(self, relative: str) -> Path:
        """`relative` inside the repository; anything that would leave it is refused."""
        candidate = Path(self.root, relative)
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise ValueError(f"path {relative!r} must be relative to the repository root, without '..'")
        if candidate.resolve() != candidate or not candidate.is_relative_to(self.root):
            raise ValueError(f"path {relative!r} leaves the repository (a symlink?)")
        if candidate.is_file() and candidate.stat().st_nlink > 1:
            raise ValueError(f"path {relative!r} is a hard link; only plain files of the repository are open")
        return candidate

    def write_files(self, files: dict[str, str]) -> None:
        for relative, content in files.items():
            target = self.path(relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)

    async def run_tests(self) -> TestRun:
        secret = secrets.token_hex(16)
        # -B: no bytecode caches, which a same-size edit within the same second would leave stale
        result = await run_python_sandboxed(["-B", "-c", HARNESS], self.root, self.limits, stdin=f"{secret}\n".encode())
        summary = re.compile(rf"^{secret} run=(\d+) failures=(\d+) errors=(\d+)$", re.MULTILINE)
        counts = summary.findall(result.output)
        output = summary.sub("", result.output).replace(f"{self.root}/", "")
        output = _TIMING.sub(r"\1", output).strip()  # the same run reads the same every time
        if result.violation is None:
            # RLIMIT_AS and RLIMIT_FSIZE make Python raise (it ignores SIGXFSZ) rather than die.
            result.violation = next((name for error, name in _LIMIT_ERRORS.items() if error in output), None)
        if result.violation is not None:
            passed, status = False, f"FAILED: stopped at the sandbox's {result.violation} limit"
        elif not counts:
            passed, status = False, f"FAILED: the test run ended early (exit status {result.returncode})"
        else:
            num_run, failures, errors = map(int, counts[-1])
            passed = result.returncode == 0 and (num_run, failures, errors) == (self.num_tests, 0, 0)
            verdict = "PASSED" if passed else "FAILED"
            status = f"{verdict}: {num_run} of {self.num_tests} tests ran, {failures} failed, {errors} errors"
        tail = output[-MAX_REPORT_CHARS:]
        run = TestRun(passed, f"{status}\n{tail}".strip(), result)
        self.runs.append(run)
        return run
