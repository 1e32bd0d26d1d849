"""HTTP client of the inference servers: retries, backoff, and failover between servers.

Transport errors (refused or dropped connections, timeouts) and 5xx answers are retried with
exponential backoff, each retry on the next server; a 4xx is the caller's mistake and raises
at once. The pool never decides a run's fate: a request that still fails raises
`InferenceUnavailableError`, and the caller records its rollout as failed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import httpx

from tandem.config.orchestrator import ClientConfig

log = logging.getLogger("tandem.orchestrator")


class InferenceRequestError(Exception):
    """A server refused a request (4xx): retrying the same request cannot help."""


class InferenceUnavailableError(Exception):
    """A request failed on every attempt (transport errors or 5xx)."""


class InferencePool:
    def __init__(self, config: ClientConfig):
        self.config = config
        self.base_urls = [url.rstrip("/") for url in config.base_urls]
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # No pool limit: concurrency is bounded by the orchestrator, and a cap here would
        # queue requests invisibly inside httpx.
        self._http = httpx.AsyncClient(
            headers=headers, timeout=config.timeout_s, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)
        )
        self._round_robin = itertools.count()
        self.num_retries = 0
        """Retried attempts so far (a metric)."""

    @property
    def num_servers(self) -> int:
        return len(self.base_urls)

    def next_server(self) -> int:
        """A server index, round robin: the caller keeps it for a group so prompts share a prefix cache."""
        return next(self._round_robin) % self.num_servers

    async def generate(self, payload: dict[str, Any], server: int) -> dict[str, Any]:
        """`POST /v1/generate`, starting on `server` and failing over to the others."""
        return await self._post("/v1/generate", payload, first_server=server, failover=True)

    async def update_weights(self, path: str, version: int) -> None:
        """Load `path` as policy `version` on every server; raises if one of them cannot."""
        payload = {"path": path, "version": version}
        await asyncio.gather(
            *(self._post("/update_weights", payload, first_server=i, failover=False) for i in range(self.num_servers))
        )

    async def wait_healthy(self) -> None:
        """Block until every server answers `GET /health` with 200, or `client.health_timeout_s` passes."""
        deadline = time.monotonic() + self.config.health_timeout_s
        for url in self.base_urls:
            while True:
                try:
                    if (await self._http.get(f"{url}/health", timeout=5.0)).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise InferenceUnavailableError(
                        f"inference server {url} not healthy after {self.config.health_timeout_s:.0f}s "
                        "(GET /health); is it running? (`client.base_urls`)"
                    )
                await asyncio.sleep(0.2)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, payload: dict[str, Any], first_server: int, failover: bool) -> dict[str, Any]:
        attempts = self.config.max_retries + 1
        last_error = ""
        for attempt in range(attempts):
            server = (first_server + attempt) % self.num_servers if failover else first_server
            url = f"{self.base_urls[server]}{path}"
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(min(self.config.backoff_s * 2 ** (attempt - 1), self.config.max_backoff_s))
            try:
                response = await self._http.post(url, json=payload)
            except httpx.TransportError as err:
                last_error = f"{url}: {type(err).__name__}: {err}"
                log.debug("retrying after %s", last_error)
                continue
            if response.status_code >= 500:
                last_error = f"{url}: HTTP {response.status_code}: {response.text[:300]}"
                log.debug("retrying after %s", last_error)
                continue
            if response.status_code >= 400:
                raise InferenceRequestError(f"{url}: HTTP {response.status_code}: {response.text[:1000]}")
            return response.json()
        raise InferenceUnavailableError(f"POST {path} failed {attempts} times; last: {last_error}")
