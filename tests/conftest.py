"""How the suite shares CI's two cores when pytest-xdist runs it on two workers (`make test`).

Each worker computes at one torch thread, and so do the processes its tests start (OMP_NUM_THREADS is inherited):
at torch's default of a thread per core, two workers' threads would outnumber the cores, and every small op of
one would wait for the other's threads to get a core back.

A module's tests run on one worker (`--dist loadscope`): its module fixtures, such as a server or a run that
several tests read, are then made once.

A test marked `alone` (a check on timing) runs while the other worker runs nothing: it waits for the other's
test to end, and the other starts no test until it is done. Workers hold a file lock for each test, shared, or
exclusive for `alone`; a turnstile lock in front makes a waiting `alone` test stop new shared holders, which would
otherwise keep it waiting for as long as the other worker has tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if is_worker(config):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules holding `slow` tests first, each module's order kept: the worker that finishes first takes the next
    module (`--no-loadscope-reorder` keeps this order), so the last modules handed out are short ones, and
    neither worker is left alone with a long test at the end. A test of tens of seconds that starts no process
    (one that compiles, say) is `slow` for this too: in the alphabetical order, tests/trainer and tests/transport
    come last."""
    if is_worker(config):
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not is_worker(item.config):
        return (yield)
    # Each worker's base folder is `popen-<worker>` in the session's: the lock files live in the latter.
    with machine_share(Path(item.config.getoption("basetemp")).parent, item.get_closest_marker("alone") is not None):
        return (yield)


@contextlib.contextmanager
def machine_share(folder: Path, alone: bool) -> Iterator[None]:
    """Hold the machine for one test: shared, or, `alone`, exclusive."""
    with open(folder / "turnstile.lock", "a") as turnstile, open(folder / "machine.lock", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield
