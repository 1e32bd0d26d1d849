"""A decode server's client of its prefill servers: checked at start-up, asked for prompts, sent weight updates.

A prompt goes to the prefill server with the fewest prompts in flight from this decode server (ties in turn), among
those that have not failed in the last `disaggregation.peer_retry_s`. One that holds all the prompts it may for now
(429, `disaggregation.max_held_mib`) is asked again, it or another, after a pause that doubles each time: the
prompt waits for the prefill pool rather than being computed here beside the decoding sequences, which is what the
pools are apart for. Anything else that goes wrong with a prefill server (refused, unreachable, a failed transfer),
or no hand-off within `disaggregation.peer_timeout_s`, makes `prefill` return None: the decode server then prefills
the prompt itself, so no request is lost to a prefill server.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import httpx
import msgspec

from tandem.config.inference import DisaggregationConfig
from tandem.inference.disaggregated.kv_transport import KVTransport, TransferError
from tandem.inference.disaggregated.wire import PrefillAnswer, PrefillInfo
from tandem.inference.engine.prefilled import PrefilledPrompt

log = logging.getLogger("tandem.inference")

BUSY, REFUSED = object(), object()
"""`PrefillPeers._ask`'s answers other than a hand-off: full for now (429), refused (another 4xx)."""
BUSY_PAUSES_S = (0.01, 0.5)
"""The first pause before asking again after a 429, and the longest (each one doubles the last)."""


class PeerUnreachable(RuntimeError):
    """A prefill server did not answer at start-up, or cannot serve this decode server."""


class PrefillPeers:
    def __init__(self, config: DisaggregationConfig, transport: KVTransport, api_key: str | None = None):
        self.urls = [url.rstrip("/") for url in config.prefill_urls]
        self.forward_updates_to = [url.rstrip("/") for url in config.forward_updates_to]
        self.timeout_s = config.peer_timeout_s
        self.retry_s = config.peer_retry_s
        self.transport = transport
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        """Both pools share `server.api_key`."""
        self._client: httpx.AsyncClient | None = None
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._turn = itertools.count()
        self._connecting = {url: asyncio.Lock() for url in self.urls}
        """One join at a time per prefill server, when a failed transfer undid the last one."""
        self.num_handed = 0
        """Prompts a prefill server computed and handed over."""
        self.num_failed = 0
        """Prompts a prefill server was asked for and did not hand over (refused, failed, late)."""
        self.num_busy = 0
        """Answers that a prefill server was full for now (429): the prompt waited and asked again."""

    def check(self, model: str, block_size: int, cache_layout: str) -> None:
        """At start-up: every prefill server answers within `peer_timeout_s`, serves `model` with KV blocks of
        `block_size` tokens that hold what this server's do (`cache_layout`), and its KV transport is joined; else
        PeerUnreachable naming the address."""
        for url in self.urls:
            info = self._wait_for_info(url)
            if info.block_size != block_size or info.model != model:
                raise PeerUnreachable(f"the prefill server {url} serves {info.model!r} in KV blocks of {info.block_size} "
                                      f"tokens; this decode server serves {model!r} in blocks of {block_size} "
                                      "(`engine.block_size`, `model.name`): both pools must serve one model alike")
            if info.cache_layout != cache_layout:
                raise PeerUnreachable(f"the prefill server {url} keeps KV blocks of {info.cache_layout}; this decode "
                                      f"server keeps {cache_layout} (`model.name`, `engine.kv_cache_dtype`, "
                                      "`model.dtype`, `engine.speculative.method` = 'mtp', whose layer's entries are "
                                      "layers of a latent cache): both pools must serve one model alike")
            try:
                self.transport.connect(url, self.timeout_s, self.headers)
            except TransferError as err:
                raise PeerUnreachable(str(err)) from None

    def _wait_for_info(self, url: str) -> PrefillInfo:
        deadline = time.monotonic() + self.timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                response = httpx.get(f"{url}/prefill/info", headers=self.headers, timeout=min(5.0, self.timeout_s))
                if response.status_code == 404:
                    raise PeerUnreachable(f"{url} answers but is no prefill server (no `GET /prefill/info`): check "
                                          "`disaggregation.prefill_urls`")
                response.raise_for_status()
                return msgspec.json.decode(response.content, type=PrefillInfo)
            except (httpx.HTTPError, msgspec.DecodeError) as err:
                last_error = err
            time.sleep(0.2)
        raise PeerUnreachable(f"cannot reach the prefill server {url} (`disaggregation.prefill_urls`) within "
                              f"{self.timeout_s:.0f} s (`disaggregation.peer_timeout_s`): {last_error}")

    @property
    def client(self) -> httpx.AsyncClient:
        """Made on first use, in the serving event loop (a client belongs to the loop it first ran in)."""
        if self._client is None:
            self._client = httpx.AsyncClient(headers=self.headers, timeout=self.timeout_s,
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        return self._client

    def _pick(self) -> str | None:
        now = time.monotonic()
        up = [url for url in self.urls if self._down_until[url] <= now]
        if not up:
            return None
        turn = next(self._turn)
        return min(up, key=lambda url: (self._in_flight[url], (self.urls.index(url) - turn) % len(self.urls)))

    async def prefill(self, prompt_token_ids: list[int], first_block: int, weight_version: int) -> PrefilledPrompt | None:
        """`prompt_token_ids` prefilled by a prefill server under policy `weight_version`, its KV blocks from
        `first_block` on; None when no prefill server handed it over within `peer_timeout_s`."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        pause = BUSY_PAUSES_S[0]
        while (url := self._pick()) is not None:
            self._in_flight[url] += 1
            try:
                async with asyncio.timeout_at(deadline):
                    answer, tensors = await self._ask(url, prompt_token_ids, first_block, weight_version)
            except (httpx.HTTPError, TransferError, TimeoutError, msgspec.DecodeError, ValueError) as err:
                self.num_failed += 1
                self._down_until[url] = time.monotonic() + self.retry_s
                log.warning("prefill server %s failed a prompt (%s: %s); prefilling it here, and sending it nothing "
                            "for %.0f s", url, type(err).__name__, err, self.retry_s)
                return None
            finally:
                self._in_flight[url] -= 1
            if answer is BUSY:
                self.num_busy += 1
                if asyncio.get_running_loop().time() + pause < deadline:
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, BUSY_PAUSES_S[1])
                    continue
            if answer is BUSY or answer is REFUSED:
                self.num_failed += 1
                return None
            kv_blocks, logits, *draft_state = tensors
            self.num_handed += 1
            return PrefilledPrompt(kv_blocks, logits, answer.weight_version, answer.first_block,
                                   draft_state[0] if draft_state else None)
        return None

    async def _ask(self, url: str, prompt_token_ids: list[int], first_block: int, weight_version: int
                   ) -> tuple[PrefillAnswer | object, list]:
        """One `POST /prefill` to `url` and, where it answers, the transfer of what it holds: (answer, tensors), or
        (BUSY, []) on a 429, (REFUSED, []) on another 4xx (other weights there for now, a prompt it cannot take: not
        its failure, it keeps getting prompts). Raises what the exchange raises."""
        async with self._connecting[url]:
            if not self.transport.is_connected(url):
                await asyncio.to_thread(self.transport.connect, url, self.timeout_s, self.headers)
        response = await self.client.post(f"{url}/prefill", json={
            "prompt_token_ids": prompt_token_ids, "weight_version": weight_version, "first_block": first_block})
        if response.status_code == 429:
            return BUSY, []
        if 400 <= response.status_code < 500:
            return REFUSED, []
        response.raise_for_status()
        answer = msgspec.json.decode(response.content, type=PrefillAnswer)
        return answer, await self.transport.receive(self.client, url, answer)

    async def forward_update(self, path: str, version: int) -> None:
        """Have the prefill servers of `forward_updates_to` load `path` as policy `version`. One that fails keeps
        its old policy, so the version check sends it no prompt until a later update reaches it: logged, not raised
        (the decode server serves either way)."""
        async def one(url: str) -> None:
            try:
                response = await self.client.post(f"{url}/update_weights", json={"path": path, "version": version},
                                                  timeout=None)
                response.raise_for_status()
            except httpx.HTTPError as err:
                log.warning("the prefill server %s did not load policy %d from %s: %s", url, version, path, err)

        await asyncio.gather(*(one(url) for url in self.forward_updates_to))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        self.transport.close()
