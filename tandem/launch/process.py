"""A child process of a run: its own process group, output teed into its log file.

Each child starts a new session so that stopping it reaches its whole tree: SIGTERM to the group, a grace period,
then SIGKILL. torchrun's ranks are the exception, in sessions of their own: torchrun forwards the SIGTERM, and a rank
whose torchrun is gone ends itself (`tandem.trainer.parallel.watchdog`).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tandem.monitor.stop_signals import STOP_GRACE_S

_PR_SET_PDEATHSIG = 1
# Resolved here, in the parent: the child between fork and exec must take no loader locks.
_prctl = ctypes.CDLL(None).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RunFailed(Exception):
    """A process of the run failed; the message names it."""


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._log = open(self.log_path, "a", buffering=1)
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, text=True, errors="replace",
            preexec_fn=_die_with_parent if _prctl is not None else None,
        )
        self._reader = threading.Thread(target=self._pump, name=f"tee-{name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._tail.append(line.rstrip("\n"))
        self._log.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def tail(self, n: int = 20) -> list[str]:
        self._reader.join(timeout=1.0)
        return list(self._tail)[-n:]

    def wait(self, timeout: float | None = None) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout=5.0)
        return code

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the whole group, wait `grace` seconds, then SIGKILL whatever is left."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not group_alive(self.proc.pid):
                    break
                time.sleep(0.1)
            else:
                continue
            break
        self.proc.poll()
        self._reader.join(timeout=5.0)
        self._log.close()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
