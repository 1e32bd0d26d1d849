"""A prompt prefilled by one engine and continued by another (prefill/decode disaggregation): what moves.

The prefill engine computes the prompt as it would for itself and stops before sampling: it hands over the
prompt's KV blocks and the logits row of its last token. The decode engine writes the blocks into its own cache
and samples the first token from that row with its own sampler, so a seeded sequence draws every token, the first
included, from its own generator, exactly as when one engine does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefilledPrompt:
    kv_blocks: torch.Tensor
    """The prompt's blocks from `first_block` on, as the cache exports them (`KVCache.export_blocks`: keys and
    values, FP8 caches as bytes with the scales; `LatentCache.export_blocks`: latent entries and indexer keys, FP8
    caches as bytes with the scales)."""
    logits: torch.Tensor
    """[vocab]: the logits row of the prompt's last token, in the model's dtype."""
    weight_version: int
    """The weights that computed both; a decode engine holding others prefills the prompt itself."""
    first_block: int = 0
    """Leading blocks left out: the decode engine said its prefix cache held them."""
    draft_state: torch.Tensor | None = None
    """What the decode engine's speculative draft needs besides the blocks (`Proposer.handed_state`: the MTP
    layer's, the policy's hidden state at the last prompt position); None where the prefill engine keeps none."""
    ready: torch.cuda.Event | None = None
    """The prefill engine's (CUDA): recorded on its stream once the tensors above were made. An engine that overlaps
    steps hands a prompt over before reading the step that exported it; waiting for this event waits for that export
    alone, not for the steps queued after it, so a sender can copy the tensors on a stream of its own."""
