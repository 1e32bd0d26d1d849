"""A torchrun rank ends when its run ends, even while its main thread is stuck in a collective.

torchrun starts each rank in a session of its own, so stopping the launcher's process group reaches torchrun and
not its ranks; torchrun forwards a SIGTERM, but a torchrun killed first (the launcher's SIGKILL after its grace, a
lost node) forwards nothing. A rank whose peer died then waits in its gloo or NCCL collective for the backend's
timeout, half an hour, holding its memory and devices. And where a Python SIGTERM handler is set (the clean stops of
`tandem.monitor.stop_signals`), the handler runs only once the main thread is back in Python, which a collective
whose peer is gone never returns to.

A daemon thread covers both cases without the main thread:
- parent gone (reparented, so `os.getppid()` changed): the rank sends itself SIGTERM, the stop the parent would have
  sent; with no Python handler set that ends it at once;
- a SIGTERM seen by a Python handler (`signal.set_wakeup_fd`: the interpreter's C-level handler writes
  the signal's number to a pipe even while the main thread is in C++): the orderly stop gets `STOP_GRACE_S`, then
  the thread flushes the logs and ends the process with `os._exit(1)`.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time

from tandem.monitor.stop_signals import STOP_GRACE_S

POLL_S = 0.5
"""How often the parent is checked: a lost parent is noticed within this."""

FLUSH_S = 2.0
"""The most the last log lines may hold up the exit."""

_started = False
log = logging.getLogger(__name__)


def start_rank_watchdog() -> None:
    """Watch this process's parent and its stop signals (once per process; from the main thread, the only one
    that may set the wakeup fd)."""
    global _started
    if _started:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C-level handler must never block
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd, os.getppid()), name="rank-watchdog", daemon=True).start()
    _started = True


def _watch(read_fd: int, parent: int) -> None:
    stop_deadline: float | None = None
    while True:
        timeout = POLL_S if stop_deadline is None else max(0.0, min(POLL_S, stop_deadline - time.monotonic()))
        ready, _, _ = select.select([read_fd], [], [], timeout)
        received = os.read(read_fd, 64) if ready else b""
        # SIGTERM only, the stop torchrun and the launcher send: a SIGINT may be a debugger's, not a stop
        if stop_deadline is None and signal.SIGTERM in received:
            stop_deadline = time.monotonic() + STOP_GRACE_S  # a later stop does not move it
        if stop_deadline is not None and time.monotonic() >= stop_deadline:
            _end(f"still running {STOP_GRACE_S:.0f} s after a stop signal (the main thread is blocked, "
                 "likely in a collective whose peer is gone): exiting")
        if os.getppid() != parent:
            log.warning("parent process %d is gone: stopping", parent)
            parent = os.getppid()  # one stop: a later check compares with the new parent
            os.kill(os.getpid(), signal.SIGTERM)


def _end(message: str) -> None:
    """Log why and flush, then exit. The flush may wait on a lock the blocked main thread holds (a write into a pipe
    nobody reads): it gets `FLUSH_S`, and the exit does not wait for more."""
    flush = threading.Thread(target=_say_and_flush, args=(message,), name="rank-watchdog-flush", daemon=True)
    flush.start()
    flush.join(FLUSH_S)
    os._exit(1)


def _say_and_flush(message: str) -> None:
    log.error("%s", message)
    for handler in logging.getLogger("tandem").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
