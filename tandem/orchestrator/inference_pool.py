"""HTTP client of the inference servers: retries, backoff, and failover between servers.

Transport errors (refused or dropped connections, timeouts) and 5xx answers are retried with
exponential backoff, each retry on the next server; a 4xx is the caller's mistake and raises
at once. A request that still fails raises `InferenceUnavailableError`, and the caller records
its rollout as failed.

Invariant: no request goes to a server that holds other weights than the run's current
policy. A server that misses a weight update (it died, say) is excluded until `readmit` loads
the current policy into it; a weight update that reaches no server at all raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Any

import httpx

from tandem.config.orchestrator import ClientConfig
from tandem.orchestrator.server_dialect import dialect_of

log = logging.getLogger("tandem.orchestrator")


class InferenceRequestError(Exception):
    """A server refused a request (4xx): retrying the same request cannot help."""


class InferenceUnavailableError(Exception):
    """A request failed on every attempt (transport errors or 5xx)."""


CLIENT_SHARDS = 16
"""HTTP clients (connection pools) the requests are spread over: 256 requests in flight leave 16 connections in each."""


class InferencePool:
    def __init__(self, config: ClientConfig, policy_name: str | None = None):
        """`policy_name`: the served name of the policy (`model.name`), which vLLM's requests name."""
        self.config = config
        self.base_urls = [url.rstrip("/") for url in config.base_urls]
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # No pool limit: concurrency is bounded by the orchestrator, and a cap here would
        # queue requests invisibly inside httpx. Several clients: httpcore's pool walks all its connections
        # at every request and answer, so one pool of hundreds of connections spends most of the orchestrator's
        # CPU there (`benchmarks/results/rl-loop-h100-2026-12-05-before.json`); requests take the clients in turn,
        # each holding a share.
        tls = httpx.create_ssl_context()  # one for all: each client would load the CA bundle again (25 ms each)
        self._clients = [
            httpx.AsyncClient(headers=headers, timeout=config.timeout_s, verify=tls,
                              limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
            for _ in range(CLIENT_SHARDS)
        ]
        self._next_client = itertools.count()
        self._round_robin = itertools.count()
        self.excluded: set[int] = set()
        """Servers that missed a weight update: no requests go there until `readmit`."""
        self.num_retries = 0
        """Retried attempts so far (a metric)."""
        self.dialect = dialect_of(config.backend, policy_name)
        self.versions = [0] * len(self.base_urls)
        """The policy each server holds, as its last update finished (`server_dialect`)."""
        self._serving = [asyncio.Event() for _ in self.base_urls]
        """Cleared while a server receives a broadcast update: new generation requests wait."""
        for event in self._serving:
            event.set()

    @property
    def num_servers(self) -> int:
        return len(self.base_urls)

    def next_server(self) -> int:
        """A server index, round robin: the caller keeps it for a group so prompts share a prefix cache."""
        return next(self._round_robin) % self.num_servers

    async def generate(self, payload: dict[str, Any], server: int) -> dict[str, Any]:
        """Token-in generation (tandem's `/v1/generate` shapes, whatever the backend), starting on
        `server` and failing over to the others."""
        body, version = await self._post(self.dialect.generate_path, self.dialect.to_request(payload),
                                          first_server=server, failover=True)
        return self.dialect.from_response(body, version)

    async def update_weights(self, path: str, version: int) -> None:
        """Load `path` as policy `version` on every server. Servers that cannot are excluded;
        raises `InferenceUnavailableError` when none could."""
        servers = list(range(self.num_servers))
        results = await asyncio.gather(*(self._update(i, path, version, self.config.max_retries) for i in servers),
                                       return_exceptions=True)
        self._settle_update(results, version)

    async def init_weight_transfer(self, init_infos: list[dict[str, Any]]) -> None:
        """Have server i join the broadcast group with `init_infos[i]`, all at once (the group forms
        only when every rank joined). Not retried: a second join of one group cannot succeed."""
        await asyncio.gather(*(self._post("/init_weight_transfer_engine", {"init_info": info}, first_server=i,
                                          failover=False, max_retries=0) for i, info in enumerate(init_infos)))

    async def broadcast_update(self, update_info: dict[str, Any], version: int) -> None:
        """Have every server receive policy `version` from the broadcast group, all at once (the
        collective needs every receiver): excluded servers too, and one that takes it is re-admitted.
        Servers that fail are excluded; raises `InferenceUnavailableError` when none took it."""
        results = await asyncio.gather(*(self._receive(i, update_info, version) for i in range(self.num_servers)),
                                       return_exceptions=True)
        self._settle_update(results, version)

    async def _receive(self, server: int, update_info: dict[str, Any], version: int) -> None:
        """vLLM's weight-transfer sequence on one server, paused (`_paused`)."""
        once = {"first_server": server, "failover": False, "max_retries": 0}
        async with self._paused(server, once):
            await self._post("/start_weight_update", {}, **once)
            await self._post("/update_weights", {"update_info": update_info}, **once)
            await self._post("/finish_weight_update", {"weight_version": str(version)}, **once)
            self.versions[server] = version

    @contextlib.asynccontextmanager
    async def _paused(self, server: int, retry: dict[str, Any]):
        """New generation requests to `server` wait here, and the server holds its in-flight ones
        (`/pause?mode=keep`: none is lost) until the body is done, whether it succeeded or not."""
        self._serving[server].clear()
        try:
            await self._post("/pause?mode=keep", {}, **retry)
            try:
                yield
            finally:
                await self._post("/resume", {}, **retry)
        finally:
            self._serving[server].set()

    def _settle_update(self, results: list[Any], version: int) -> None:
        """Exclude the servers that were unavailable; raise if none loaded it, or one refused it (a 4xx)."""
        failed = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
        for error in failed.values():
            if not isinstance(error, InferenceUnavailableError):
                raise error
        if len(failed) == self.num_servers:
            raise InferenceUnavailableError(f"no server loaded policy {version}: {next(iter(failed.values()))}")
        for i, error in failed.items():
            log.warning("excluding %s until it loads policy %d: %s", self.base_urls[i], version, error)
        self.excluded = set(failed)

    async def readmit(self, path: str, version: int) -> None:
        """Try once to load the current policy into each excluded server; those that take it serve again."""
        for i in sorted(self.excluded):
            try:
                await self._update(i, path, version, max_retries=0)
            except InferenceUnavailableError:
                continue
            self.excluded.discard(i)
            log.info("%s is back with policy %d", self.base_urls[i], version)

    async def _update(self, server: int, path: str, version: int, max_retries: int) -> None:
        """Load the folder `path` into `server` the backend's way (`server_dialect`); each call is retried
        (loading one folder twice does no harm)."""
        retry = {"first_server": server, "failover": False, "max_retries": max_retries}
        route, body = self.dialect.folder_update(path, version)
        paused = self._paused(server, retry) if self.dialect.pauses_for_folder_update else contextlib.nullcontext()
        async with paused:
            await self._post(route, body, **retry)
            self.versions[server] = version

    async def wait_healthy(self) -> None:
        """Block until every server answers `GET /health` with 200, or `client.health_timeout_s` passes."""
        deadline = time.monotonic() + self.config.health_timeout_s
        for url in self.base_urls:
            while True:
                try:
                    if (await self._client().get(f"{url}/health", timeout=5.0)).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise InferenceUnavailableError(
                        f"inference server {url} not healthy after {self.config.health_timeout_s:.0f}s "
                        "(GET /health); is it running? (`client.base_urls`)"
                    )
                await asyncio.sleep(0.2)

    async def max_model_len(self) -> int | None:
        """The shortest `max_model_len` the servers report on `GET /v1/models` (tandem's server and vLLM's
        both do); None when none reports one."""
        lengths: list[int] = []
        for url in self.base_urls:
            try:
                response = await self._client().get(f"{url}/v1/models", timeout=10.0)
                models = response.json().get("data", []) if response.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            lengths += [m["max_model_len"] for m in models if isinstance(m, dict) and isinstance(m.get("max_model_len"), int)]
        return min(lengths, default=None)

    def _client(self) -> httpx.AsyncClient:
        return self._clients[next(self._next_client) % CLIENT_SHARDS]

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self._clients))

    async def _post(self, path: str, payload: dict[str, Any], first_server: int, failover: bool,
                    max_retries: int | None = None) -> tuple[dict[str, Any], int]:
        """The answer's body, and the version the answering server held when it was sent."""
        attempts = (self.config.max_retries if max_retries is None else max_retries) + 1
        if failover:
            live = [(first_server + i) % self.num_servers for i in range(self.num_servers)]
            live = [i for i in live if i not in self.excluded]
            if not live:
                raise InferenceUnavailableError("every inference server is excluded (they missed a weight update)")
        else:
            live = [first_server]
        last_error = ""
        for attempt in range(attempts):
            server = live[attempt % len(live)]
            url = f"{self.base_urls[server]}{path}"
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(min(self.config.backoff_s * 2 ** (attempt - 1), self.config.max_backoff_s))
            if failover:  # a generation request: never sent to a server in the middle of an update
                await self._serving[server].wait()
            version = self.versions[server]
            try:
                response = await self._client().post(url, json=payload)
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
            # vLLM answers some admin routes with plain text (`/v1/load_lora_adapter`): their body says nothing more.
            is_json = response.headers.get("content-type", "").startswith("application/json")
            return (response.json() if is_json else {}), version
        raise InferenceUnavailableError(f"POST {path} failed {attempts} times; last: {last_error}")
