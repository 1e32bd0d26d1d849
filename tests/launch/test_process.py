"""ManagedProcess: output teed to the log, the whole process tree stopped."""

from __future__ import annotations

import os
import sys
import time

from tandem.launch.process import ManagedProcess


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_output_is_teed_and_exit_code_kept(tmp_path):
    proc = ManagedProcess("echo", [sys.executable, "-c", "print('hello'); import sys; sys.exit(3)"], tmp_path / "echo.log", dict(os.environ))
    assert proc.wait(30) == 3
    assert proc.tail() == ["hello"]
    proc.stop()
    assert (tmp_path / "echo.log").read_text() == "hello\n"


def test_stop_kills_the_whole_tree_even_if_sigterm_is_ignored(tmp_path):
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = ManagedProcess("stubborn", [sys.executable, "-c", script], tmp_path / "s.log", dict(os.environ))
    deadline = time.monotonic() + 30
    while not proc.tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(proc.tail()[0])
    assert alive(child)
    start = time.monotonic()
    proc.stop(grace=1.0)
    assert time.monotonic() - start < 10
    assert proc.poll() is not None and not alive(child)


def test_children_die_with_a_killed_launcher(tmp_path):
    """A launcher killed by SIGKILL cannot clean up: its children must still not outlive it."""
    launcher = (
        "import os, sys, time\n"
        "from tandem.launch.process import ManagedProcess\n"
        f"p = ManagedProcess('child', [sys.executable, '-c', 'import time; time.sleep(600)'], {str(tmp_path / 'c.log')!r}, dict(os.environ))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert alive(child)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)
