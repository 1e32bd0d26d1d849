"""Request state inside the engine: one `Sequence` per sample (a request with `n` = 4 is four).

Invariants:
- `token_ids` = prompt + completion as far as the host knows it; `num_pending` more tokens were
  sampled on the device by steps whose results the host has not read yet (0, 1 or 2: the engine
  launches a step before reading the previous one, see `llm_engine.py`). `num_tokens` counts both.
- The KV cache holds the first `num_computed_tokens` tokens. A step computes tokens
  [num_computed_tokens, num_tokens) (or a chunk) and, when that reaches the end, samples one
  token. So a decoding sequence has exactly one uncomputed token: the last one, which may still be
  pending (its id then comes from the previous step's tokens on the device, row `pending_row`).
- `block_table[i]` is the cache block holding tokens [i * block_size, (i + 1) * block_size).
- `logprobs[j]` belongs to completion token j and comes from the weights that sampled it;
  so does `routed_experts[j]` (when asked): the experts of the forward that sampled it.
- Speculative decoding: a step that verifies drafts emits the accepted drafts and then the policy's
  own token. Each accepted draft is appended as known and computed (the verifying forward wrote its
  keys and values) ahead of the pending token, so one token stays uncomputed throughout.
- A base sequence (`is_base`: the base model served beside a LoRA policy) is computed with the adapters
  subtracted (`lora_side_path.py`); its KV blocks are the base's, shared only with other base sequences.
- Preemption (recompute) frees the blocks and resets `num_computed_tokens`; the completion so far,
  with its logprobs, is kept and prefilled again as if it were prompt.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from tandem.inference.engine.detokenizer import IncrementalDetokenizer
from tandem.inference.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        generator: torch.Generator | None = None,
        incremental: bool = True,
        is_base: bool = False,
    ):
        self.request_id = request_id
        self.index = index
        """Which of the request's `n` samples this is."""
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.generator = generator
        """Per-sequence generator when the request has a seed; else the engine's shared one is used."""
        self.incremental = incremental
        """Whether the engine reports every token as it comes (streaming) or the completion at its end."""
        self.is_base = is_base
        """Sampled from the base model, not the LoRA policy (`server.base_model_name`)."""
        self.prefix_parent: Sequence | None = None
        """An earlier sequence with the same prompt prefix whose prefill this one waits for (set by the scheduler)."""
        self.hand_off_from_block: int | None = None
        """A prefill server's sequence: once its prompt is computed, its KV blocks from this one on and its last
        logits row are handed to a decode server instead of sampling (`LLMEngine.add_prefill`)."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0
        """Tokens sampled by launched steps that the host has not read yet (they follow `token_ids`)."""
        self.pending_row = -1
        """Row of this sequence's token in the latest launched step's sampled tokens (while `num_pending`)."""
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        """Chained hashes of the leading full blocks, extended as blocks fill (prefix caching)."""
        self.cache_epoch = -1
        """The block manager's cache epoch when this sequence's KV started; older KV is never shared."""
        self.logprobs: list[float] = []
        self.top_logprobs: list[tuple[tuple[int, float], ...]] = []
        self.routed_experts: list[list[list[int]]] = []
        """Per completion token, [MoE layer][k] expert ids (`params.return_routed_experts` only)."""
        self.oldest_weight_version: int | None = None
        self.finish_reason: str | None = None
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.text = ""
        """Completion text so far (cut at a stop string)."""
        self.num_text_sent = 0
        """Characters of `text` already handed out (the tail may be held back for stop strings)."""
        self.num_draft_tokens = 0
        """Drafted tokens the policy verified for this sequence (speculative decoding)."""
        self.num_accepted_tokens = 0
        """Of those, the tokens it accepted."""

    @property
    def num_tokens(self) -> int:
        """Known and pending tokens: what the cache must hold."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_completion_tokens(self) -> int:
        """Completion tokens the host knows (pending ones not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_in_flight(self) -> bool:
        """A pending token already reaches `max_tokens`: nothing more to compute for this sequence."""
        return self.num_pending > 0 and self.num_completion_tokens + self.num_pending >= self.params.max_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_prefilled_prompt(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def mark_pending(self, row: int) -> None:
        """A launched step samples this sequence's next token, into row `row` of its sampled tokens."""
        self.num_pending += 1
        self.pending_row = row

    def accept_draft(self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...], weight_version: int,
                     routed_experts: list[list[int]] | None = None) -> None:
        """The host read a drafted token the policy accepted, which comes before the step's pending token."""
        self.append_token(token_id, logprob, top, weight_version, routed_experts)
        self.num_pending += 1  # the step's own token still follows
        self.num_computed_tokens += 1

    def append_token(self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...], weight_version: int,
                     routed_experts: list[list[int]] | None = None) -> None:
        """The host read the oldest pending token (and, when asked, the experts that sampled it)."""
        assert self.num_pending > 0, "a token arrived that no step sampled"
        self.num_pending -= 1
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        if routed_experts is not None:
            self.routed_experts.append(routed_experts)
        if self.oldest_weight_version is None or weight_version < self.oldest_weight_version:
            self.oldest_weight_version = weight_version
