"""A torchrun rank whose torchrun is killed ends on its own, even stuck in a collective whose peer never comes and
under a SIGTERM handler that cannot run there (`tandem.trainer.parallel.watchdog`). Real torchrun, real gloo."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.config.resolve import free_port
from tandem.monitor.stop_signals import STOP_GRACE_S
from tandem.trainer.parallel.watchdog import FLUSH_S, POLL_S

RANKS = Path(__file__).with_name("blocked_rank.py")

pytestmark = pytest.mark.slow  # seconds of waiting on the grace: handed out early, never the suite's tail


def is_running(pid: int) -> bool:
    """Not ended, nor ended and waiting to be reaped (a zombie: its new parent may reap late)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def seconds_until_ended(pid: int, started: float, limit_s: float) -> float:
    while is_running(pid) and time.monotonic() - started < limit_s:
        time.sleep(0.05)
    return time.monotonic() - started


def test_ranks_end_when_torchrun_is_killed_even_blocked_in_a_collective(tmp_path):
    log = tmp_path / "ranks.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(RANKS), str(tmp_path)]
    with open(log, "w") as out:
        torchrun = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank_{r}.pid").is_file() for r in (0, 1)):
            assert torchrun.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        pids = [int((tmp_path / f"rank_{r}.pid").read_text()) for r in (0, 1)]
        time.sleep(0.5)  # from writing its pid into the wait
        torchrun.kill()  # as the launcher's SIGKILL after its grace, or a lost node
        torchrun.wait()
        killed_at = time.monotonic()
        # each sends itself the SIGTERM torchrun would have sent, which its handler cannot take: after the grace the
        # handler had, the first to end is ended by its watchdog (its peer, losing it, may end either way)
        ended = sorted(seconds_until_ended(pid, killed_at, 60) for pid in pids)
        text = log.read_text()
        assert STOP_GRACE_S <= ended[0] and ended[1] < POLL_S + STOP_GRACE_S + FLUSH_S + 5, (ended, text[-3000:])
        assert text.count("is gone: stopping") == 2, text[-3000:]
        assert f"still running {STOP_GRACE_S:.0f} s after a stop signal" in text, text[-3000:]
    finally:
        for pid in [torchrun.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
