"""A decode server's choice, per request, of where its prompt is prefilled, and its counts of that.

A prompt goes to a prefill server when at least `disaggregation.min_remote_prefill_tokens` of its tokens are not in
this server's prefix cache (a new rollout's prompt, a turn that brings a long tool output); else it is computed
here, where the hand-off would cost more than the few tokens do. A request that asks for its routed experts is
prefilled here: the experts of its first token's forward must be the ones it reports.

A handed prompt's blocks wait on this server until its engine has room for the request, so when prompts come faster
than the engine takes them in they pile up beside the cache. Their bytes are bounded
(`disaggregation.max_received_mib`): a prompt is asked for only when its estimated blocks fit beside those received
and not yet taken and those being fetched; until then it waits here (its tokens only), as it would in the engine's
queue. A prompt whose blocks alone pass the bound is prefilled here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from fastapi import APIRouter, Request

from tandem.inference.disaggregated.peers import PrefillPeers
from tandem.inference.engine.async_engine import AsyncEngine
from tandem.inference.engine.prefilled import PrefilledPrompt
from tandem.inference.engine.sampling_params import SamplingParams

log = logging.getLogger("tandem.inference")
router = APIRouter()


class RemotePrefill:
    def __init__(self, engine: AsyncEngine, peers: PrefillPeers, min_remote_prefill_tokens: int,
                 max_received_bytes: int):
        self.engine = engine
        self.peers = peers
        self.min_remote_prefill_tokens = min_remote_prefill_tokens
        self.max_received_bytes = max_received_bytes
        self.received_bytes = 0
        """Estimated bytes of the prompts being fetched and of those received that the engine has not taken yet."""
        self._released = asyncio.Event()

    async def fetch(self, prompt_token_ids: list[int], params: SamplingParams
                    ) -> tuple[PrefilledPrompt | None, Callable[[], None]]:
        """The prompt prefilled by a prefill server (None: prefill it here), and what to call once the engine has
        taken it in (its first output, or the request's end), once: it gives the prompt's bytes back."""
        if params.return_routed_experts:
            return None, _nothing
        block_manager = self.engine.engine.block_manager
        num_cached_blocks = block_manager.num_cached_blocks(prompt_token_ids)
        if len(prompt_token_ids) - num_cached_blocks * block_manager.block_size < self.min_remote_prefill_tokens:
            return None, _nothing
        num_bytes = self.engine.engine.kv_bytes(block_manager.num_blocks_for(len(prompt_token_ids)) - num_cached_blocks)
        if num_bytes > self.max_received_bytes:
            return None, _nothing
        while self.received_bytes + num_bytes > self.max_received_bytes:
            self._released.clear()
            await self._released.wait()
        self.received_bytes += num_bytes
        try:
            prefilled = await self.peers.prefill(prompt_token_ids, num_cached_blocks, self.engine.stats().weight_version)
        except BaseException:
            self._release(num_bytes)
            raise
        if prefilled is None:
            self._release(num_bytes)
            return None, _nothing
        return prefilled, functools.partial(self._release, num_bytes)

    def _release(self, num_bytes: int) -> None:
        self.received_bytes -= num_bytes
        self._released.set()

    def log_stats(self) -> None:
        """One line at the end, so a run's log says where its prompts were prefilled."""
        counts = self.stats()
        log.info("prompts handed over by prefill servers: %d; asked and not handed (prefilled here): %d; handed and "
                 "prefilled here again (another policy, blocks gone): %d; answers of a full prefill server (asked "
                 "again): %d", counts["num_prefills_handed"], counts["num_prefills_failed"],
                 counts["num_prefilled_refused"], counts["num_prefill_busy_answers"])

    def stats(self) -> dict[str, int]:
        return {"num_prefills_handed": self.peers.num_handed, "num_prefills_failed": self.peers.num_failed,
                "num_prefilled_taken": self.engine.engine.num_prefilled_taken,
                "num_prefilled_refused": self.engine.engine.num_prefilled_refused,
                "num_prefill_busy_answers": self.peers.num_busy}


@router.get("/disaggregation/stats")
async def stats(request: Request) -> dict[str, int]:
    """Where this decode server's prompts were prefilled: handed over by a prefill server (`handed`), asked and
    not handed (`failed`), continued here from a handed prompt (`taken`), handed but prefilled here again
    (`refused`: another policy, or the blocks it left out gone from this cache); and how often a prefill server
    answered that it was full for now (`busy_answers`, 429: the prompt waited and asked again)."""
    return request.app.state.served.remote_prefill.stats()


def _nothing() -> None:
    """The release of a prompt that holds nothing here."""

