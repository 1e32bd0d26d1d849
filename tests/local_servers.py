"""`tandem inference` as users run it, for tests: its own process on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tandem_inference(model: Path, log_path: Path, *flags: str, start_timeout_s: float = 120) -> Iterator[str]:
    """A `tandem inference` process serving `model` on the CPU (its URL while it is healthy), stopped on leaving;
    its output goes to `log_path`, whose tail is the error when it does not come up."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(model),
                                 "--server.port", str(port), "--engine.device", "cpu", *flags],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tandem inference did not start:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False
