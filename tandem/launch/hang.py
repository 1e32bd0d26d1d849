"""Notice an inference server that hangs instead of dying.

A stopped or deadlocked server keeps its process alive, so the launcher's exit-code watch never fires, and
its clients wait out their request timeouts (minutes, with retries). The launcher asks `GET /health` every
few seconds instead; a server that has not answered for `hang_timeout_s` ends the run, named.
"""

from __future__ import annotations

import time

import httpx


class HangWatch:
    def __init__(self, base_url: str, timeout_s: float, every_s: float = 2.0):
        self.url = base_url.rstrip("/") + "/health"
        self.timeout_s = timeout_s
        self.every_s = every_s
        self.last_answer = self.last_check = time.monotonic()

    def silent_for(self) -> float | None:
        """Seconds since the server last answered, once that passes `timeout_s`; else None."""
        now = time.monotonic()
        if now - self.last_check < self.every_s:
            return None
        self.last_check = now
        try:
            if httpx.get(self.url, timeout=min(5.0, self.timeout_s)).status_code == 200:
                self.last_answer = time.monotonic()
                return None
        except httpx.HTTPError:
            pass
        silent = time.monotonic() - self.last_answer
        return silent if silent > self.timeout_s else None
