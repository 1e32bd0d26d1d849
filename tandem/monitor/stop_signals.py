"""Ctrl-C (SIGINT) and SIGTERM stop a tandem command cleanly: one line naming the signal, exit code 1.

Python's defaults do not: SIGINT raises `KeyboardInterrupt` wherever the program is (a traceback, exit code
130); SIGTERM ends the process at once (exit code 143, nothing said, no `finally` run, so no child process
stopped and no rank released). Under `stopping_on_signals()` the first of the two raises `Stopped` in the main
thread instead, so every `finally` on the way out runs. Raised anywhere, it could cut code that must be whole
(a thread made but not started, a process started but not yet recorded for the stop, a training step half
written): such code runs inside `held_signals()`, where a signal waits for the block's end. Invariants: a
command stops once, whatever number of signals arrive (later ones are ignored, so the clean-up runs to its end,
bounded by its own timeouts); code inside `held_signals()` is never cut by a signal.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)

STOP_GRACE_S = 10.0
"""How long a stopped process may take to end on its own (its clean-up is bounded by its own timeouts) before it is
ended for it: by the launcher's SIGKILL (`tandem.launch.process`), or, for a torchrun rank, by its own watchdog
(`tandem.trainer.parallel.watchdog`)."""


class Stopped(BaseException):
    """A stop signal was received. A `BaseException`, as `KeyboardInterrupt` is: no `except Exception` swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class _State:
    active = False
    stopping = False
    """`Stopped` was raised: further signals are ignored."""
    held = 0
    pending: int | None = None


def _on_signal(signum: int, frame) -> None:
    if _State.stopping:
        return
    if _State.held:
        _State.pending = _State.pending or signum
        return
    _State.stopping = True
    raise Stopped(signum)


@contextmanager
def stopping_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Stopped` in the main thread while inside (elsewhere than the main thread,
    where handlers cannot be set, nothing changes)."""
    if _State.active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    _State.active, _State.stopping, _State.held, _State.pending = True, False, 0, None
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _State.active = False


@contextmanager
def held_signals() -> Iterator[None]:
    """A block no signal may cut (a child process started and recorded, so that the stop reaches it; the
    stop of every child after a failure): a signal received inside is raised as `Stopped` at its end, unless
    an error is already on its way out, which then goes on."""
    _State.held += 1
    try:
        yield
    finally:
        _State.held -= 1
        if not _State.held and _State.pending is not None and not _State.stopping:
            _State.stopping = True
            if sys.exc_info()[1] is None:  # else an error is on its way out: the more telling of the two
                raise Stopped(_State.pending)


def stops_cleanly(command: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a command's entry point: run under `stopping_on_signals()`, and on a signal print
    `tandem <command>: stopped by SIGTERM` to stderr and return exit code 1."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                with stopping_on_signals():
                    return main(*args, **kwargs)
            except Stopped as err:
                print(f"tandem {command}: {err}", file=sys.stderr, flush=True)
                return 1

        return run

    return wrap
