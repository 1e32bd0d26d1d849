"""Servers in their own processes for tests, as users run them: started by the launcher's process wrapper,
ready once they answer `/health`, stopped (the whole process group) on leaving."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tandem.config.resolve import free_port
from tandem.launch.process import ManagedProcess
from tandem.launch.rl import wait_healthy


@contextlib.contextmanager
def serving(name: str, argv: list[str], url: str, log_path: Path, start_timeout_s: float = 120,
            env: dict[str, str] | None = None) -> Iterator[ManagedProcess]:
    """The process of `argv` (in this environment and `env`), once the server it starts answers `url`'s `/health`;
    `RunFailed` with the tail of `log_path` (its output) when it exits or stays silent for `start_timeout_s`."""
    proc = ManagedProcess(name, argv, log_path, {**os.environ, **(env or {})})
    try:
        wait_healthy(url, proc, start_timeout_s)
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def tandem_inference(model: Path, log_path: Path, *flags: str) -> Iterator[tuple[str, ManagedProcess]]:
    """A `tandem inference` process serving `model` on the CPU on a free loopback port: its URL and process."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(model), "--server.port", str(port),
            "--engine.device", "cpu", *flags]
    with serving("inference", argv, url, log_path) as proc:
        yield url, proc
