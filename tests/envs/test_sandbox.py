"""The sandbox's always-on limits, with the root-only confinement switched off (`isolate=False`),
as on a machine where the kernel refuses namespaces; the full confinement is exercised by the
hostile-completion tests of test_code_fix.py."""

import asyncio
import sys
import time

from tandem.envs.sandbox import SandboxLimits, run_python_sandboxed

UNCONFINED = {"network": False, "private_tmp": False, "own_uid": False, "max_processes": False}


def run(tmp_path, code: str, **limits):
    return asyncio.run(run_python_sandboxed(["-c", code], tmp_path, SandboxLimits(isolate=False, **limits)))


def test_without_namespaces_the_limits_still_hold_and_the_report_says_what_did_not(tmp_path):
    ok = run(tmp_path, "print('hi')")
    assert (ok.returncode, ok.violation, ok.output.strip(), ok.enforced) == (0, None, "hi", UNCONFINED)
    start = time.monotonic()
    loop = run(tmp_path, "while True: pass", cpu_s=1, wall_s=10)
    assert loop.violation == "cpu_time" and loop.returncode < 0 and time.monotonic() - start < 10  # the CPU limit, before the wall limit
    chatty = run(tmp_path, "while True: print('x' * 1000)", output_bytes=5000)
    assert chatty.violation == "output_size" and chatty.returncode is None and len(chatty.output) <= 5000
    slow = run(tmp_path, "import time; time.sleep(60)", wall_s=0.5)
    assert slow.violation == "wall_time" and slow.returncode is None
    hog = run(tmp_path, "x = bytearray(2 * 2**30)", memory_mb=256)
    assert hog.returncode == 1 and "MemoryError" in hog.output
    big = run(tmp_path, "open('f', 'wb').write(bytes(10**6))", file_bytes=1000)
    assert "File too large" in big.output and (tmp_path / "f").stat().st_size <= 1000


def test_input_reaches_the_program(tmp_path):
    echo = asyncio.run(run_python_sandboxed(["-c", "import sys; print(sys.stdin.read()[::-1])"], tmp_path,
                                            SandboxLimits(isolate=False), stdin=b"abc"))
    assert echo.output.strip() == "cba" and echo.violation is None


def test_another_interpreter_runs_with_its_packages_and_may_write_the_report_folder(tmp_path):
    """What `swe`'s pytest runner relies on, with the full confinement where this process may set it up."""
    work, reports = tmp_path / "work", tmp_path / "reports"
    work.mkdir()
    reports.mkdir()
    code = "import sys, pytest; print(sys.path[0] == ''); open(sys.argv[1], 'w').write('ok')"
    result = asyncio.run(run_python_sandboxed(["-c", code, str(reports / "r.txt")], work, SandboxLimits(),
                                              interpreter=sys.executable, report_dir=reports))
    assert (result.violation, result.output.strip()) == (None, "True")  # the working directory comes first
    assert (reports / "r.txt").read_text() == "ok"
