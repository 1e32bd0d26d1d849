"""Request state inside the engine: one `Sequence` per sample (a request with `n` = 4 is four).

Invariants:
- `token_ids` = prompt + completion; the KV cache holds the first `num_computed_tokens` of them.
  A step computes `token_ids[num_computed_tokens:]` (or a chunk of it) and, when that reaches the
  end, samples one token. So a decoding sequence has exactly one uncomputed token: the last one.
- `block_table[i]` is the cache block holding tokens [i * block_size, (i + 1) * block_size).
- `logprobs[j]` belongs to completion token j and comes from the weights that sampled it.
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
        self.prefix_parent: Sequence | None = None
        """An earlier sequence with the same prompt prefix whose prefill this one waits for (set by the scheduler)."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        """Chained hashes of the leading full blocks, extended as blocks fill (prefix caching)."""
        self.cache_epoch = -1
        """The block manager's cache epoch when this sequence's KV started; older KV is never shared."""
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.oldest_weight_version: int | None = None
        self.finish_reason: str | None = None
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.text = ""
        """Completion text so far (cut at a stop string)."""
        self.num_text_sent = 0
        """Characters of `text` already handed out (the tail may be held back for stop strings)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_prefilled_prompt(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int, logprob: float, top: list[tuple[int, float]], weight_version: int) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        if self.oldest_weight_version is None or weight_version < self.oldest_weight_version:
            self.oldest_weight_version = weight_version
