"""The policy version the inference servers hold, and the watcher that moves it forward.

`PolicyTracker.version` is the newest policy loaded into *every* server: the trainer published
policy N (`weights/step_N/STABLE`, or its broadcast announcement), the watcher had each server
load it (`policy_source`), and only then recorded N. The async gate reads it; a watcher failure is
stored and re-raised to every waiter, so a run whose servers cannot load weights stops instead of
waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tandem.orchestrator.inference_pool import InferencePool
from tandem.orchestrator.policy_source import PolicySource

log = logging.getLogger("tandem.orchestrator")


class PolicyTracker:
    def __init__(self, version: int = 0):
        self.version = version
        self._changed = asyncio.Condition()
        self._error: BaseException | None = None

    async def set(self, version: int) -> None:
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def fail(self, error: BaseException) -> None:
        async with self._changed:
            self._error = error
            self._changed.notify_all()

    async def wait_newer_than(self, version: int, timeout_s: float | None = None) -> int:
        """Block until a policy newer than `version` is loaded; returns it."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version > version or self._error is not None),
                                       timeout_s)
            except TimeoutError:
                raise TimeoutError(f"no policy newer than {version} was published within {timeout_s:.0f}s "
                                   "(`weights.wait_timeout_s`); is the trainer running?") from None
            if self._error is not None:
                raise RuntimeError("loading new weights into the inference servers failed") from self._error
            return self.version


class WeightWatcher:
    """Polls `source` for new policies and loads them into the servers.

    `on_loaded(version)` runs after each load (and once at start for the current version), inside
    the watcher: no newer weights are loaded while it runs, so an eval sees one policy.
    """

    def __init__(self, source: PolicySource, pool: InferencePool, policy: PolicyTracker, poll_interval_s: float,
                 on_loaded: Callable[[int], Awaitable[None]]):
        self.source = source
        self.pool = pool
        self.policy = policy
        self.poll_interval_s = poll_interval_s
        self.on_loaded = on_loaded
        self.handled_version = -1
        self._handled = asyncio.Condition()
        self.update_s = 0.0
        """Seconds spent loading policies into the servers so far."""

    async def load_next(self) -> bool:
        """Load the next policy the source offers (the newest folder; the next announced broadcast);
        True when it loaded one."""
        version = self.source.next_version(self.policy.version)
        if version is None:
            return False
        start = time.monotonic()
        await self.source.load(self.pool, version)
        self.update_s += time.monotonic() - start
        log.info("loaded policy %d into %d server(s) in %.2fs", version, self.pool.num_servers, time.monotonic() - start)
        await self.policy.set(version)
        return True

    async def run(self) -> None:
        try:
            await self._handle(self.policy.version)
            while True:
                if await self.load_next():
                    await self._handle(self.policy.version)
                    continue
                if self.pool.excluded:
                    await self.source.readmit(self.pool, self.policy.version)
                await asyncio.sleep(self.poll_interval_s)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            await self.policy.fail(err)
            raise

    async def wait_handled(self, version: int) -> None:
        """Block until policy `version` (or a newer one) was loaded and `on_loaded` finished for it."""
        async with self._handled:
            await self._handled.wait_for(lambda: self.handled_version >= version)

    async def _handle(self, version: int) -> None:
        await self.on_loaded(version)
        async with self._handled:
            self.handled_version = version
            self._handled.notify_all()
