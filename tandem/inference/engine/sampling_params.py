"""How one request samples: every knob the API exposes, checked once here.

The server's request models state the same ranges (they are the API's schema) and refuse a bad value
first; these checks guard every other caller of the engine. An `InvalidRequest` names its field, which
the server reports as the error's `param`.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20
"""Largest `top_logprobs` a request may ask for (OpenAI's limit)."""

MIN_TEMPERATURE = 0.01
"""Smallest temperature above 0 (vLLM's floor): logits / T must stay finite in float32, else logprobs are NaN."""

MAX_TEMPERATURE = 100.0
"""Largest temperature: far past uniform sampling, and exactly representable on the device (float32)."""


TEMPERATURE_RANGE = f"0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]"


def is_valid_temperature(temperature: float) -> bool:
    return temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE


class InvalidRequest(ValueError):
    """A value the engine cannot run with; `field` names what is at fault (`prompt`, `max_tokens`, ...)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    """Most completion tokens; the server fills it from the context left when a request omits it."""
    temperature: float = 1.0
    """0 is greedy decoding; else in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) keeps the whole vocabulary."""
    min_p: float = 0.0
    seed: int | None = None
    """Seeds a generator of this sequence alone, so its samples do not depend on the batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end the completion (kept in its token ids, as EOS is)."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion; the text is cut before the first one."""
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    """Whether special tokens (EOS, chat markers) are left out of the text (never of the token ids)."""
    num_top_logprobs: int = 0
    """How many most likely alternatives to report per sampled token."""
    return_routed_experts: bool = False
    """Report, per sampled token, the expert ids each MoE layer chose in the forward that sampled it
    (router replay in the trainer)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"`max_tokens` must be at least 1, got {self.max_tokens}", "max_tokens")
        if not is_valid_temperature(self.temperature):
            raise InvalidRequest(f"`temperature` must be {TEMPERATURE_RANGE}, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"`top_p` must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequest(f"`top_k` must be -1 (off) or a positive count, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"`min_p` must be in [0, 1], got {self.min_p}", "min_p")
        if not 0 <= self.num_top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {self.num_top_logprobs}",
                                 "top_logprobs")
        if any(not s for s in self.stop):
            raise InvalidRequest("`stop` strings must not be empty", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"`stop_token_ids` must be token ids (>= 0), got {list(self.stop_token_ids)}", "stop_token_ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_filtering(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution (greedy needs none)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)
