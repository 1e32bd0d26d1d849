"""A decode server's choice, per request, of where its prompt is prefilled, and its counts of that.

A prompt goes to a prefill server when at least `disaggregation.min_remote_prefill_tokens` of its tokens are not in
this server's prefix cache (a new rollout's prompt, a turn that brings a long tool output); else it is computed
here, where the hand-off would cost more than the few tokens do. A request that asks for its routed experts is
prefilled here: the experts of its first token's forward must be the ones it reports.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from tandem.inference.disaggregated.peers import PrefillPeers
from tandem.inference.engine.async_engine import AsyncEngine
from tandem.inference.engine.prefilled import PrefilledPrompt
from tandem.inference.engine.sampling_params import SamplingParams

log = logging.getLogger("tandem.inference")
router = APIRouter()


class RemotePrefill:
    def __init__(self, engine: AsyncEngine, peers: PrefillPeers, min_remote_prefill_tokens: int):
        self.engine = engine
        self.peers = peers
        self.min_remote_prefill_tokens = min_remote_prefill_tokens

    async def fetch(self, prompt_token_ids: list[int], params: SamplingParams) -> PrefilledPrompt | None:
        """The prompt prefilled by a prefill server, or None to prefill it here."""
        if params.return_routed_experts:
            return None
        block_manager = self.engine.engine.block_manager
        num_cached_blocks = block_manager.num_cached_blocks(prompt_token_ids)
        if len(prompt_token_ids) - num_cached_blocks * block_manager.block_size < self.min_remote_prefill_tokens:
            return None
        return await self.peers.prefill(prompt_token_ids, num_cached_blocks, self.engine.stats().weight_version)

    def log_stats(self) -> None:
        """One line at the end, so a run's log says where its prompts were prefilled."""
        counts = self.stats()
        log.info("prompts handed over by prefill servers: %d; asked and not handed (prefilled here): %d; handed and "
                 "prefilled here again (another policy, blocks gone): %d", counts["num_prefills_handed"],
                 counts["num_prefills_failed"], counts["num_prefilled_refused"])

    def stats(self) -> dict[str, int]:
        return {"num_prefills_handed": self.peers.num_handed, "num_prefills_failed": self.peers.num_failed,
                "num_prefilled_taken": self.engine.engine.num_prefilled_taken,
                "num_prefilled_refused": self.engine.engine.num_prefilled_refused}


@router.get("/disaggregation/stats")
async def stats(request: Request) -> dict[str, int]:
    """Where this decode server's prompts were prefilled: handed over by a prefill server (`handed`), asked and
    not handed (`failed`), continued here from a handed prompt (`taken`), handed but prefilled here again
    (`refused`: another policy, or the blocks it left out gone from this cache)."""
    return request.app.state.served.remote_prefill.stats()
