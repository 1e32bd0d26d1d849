"""Request bodies of the HTTP API: OpenAI's fields, vLLM's extensions, tandem's `/v1/generate`.

Strict on purpose: an unknown field or a value of the wrong type is a 400 naming the field, so a
sampling setting the server does not honour is never silently ignored. OpenAI fields that tandem
does not implement (penalties, logit bias, ...) are accepted only at their neutral value.
Value ranges (temperature, top_p, ...) are checked once, by `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.inference.engine.sampling_params import SamplingParams


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None,
           "best_of": None, "suffix": None, "echo": False, "min_tokens": 0}
"""Fields accepted for compatibility only at these values (anything else is a 400)."""


class SamplingFields(Body):
    n: int = Field(1, ge=1, le=256)
    max_tokens: int | None = None
    """Unset: whatever context is left after the prompt."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None

    @model_validator(mode="after")
    def _neutral_only(self) -> "SamplingFields":
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name, neutral)
            if value is not None and value != neutral:
                raise ValueError(f"`{name}` = {value!r} is not supported by tandem's engine (only {neutral!r})")
        return self

    def sampling_params(self, max_tokens: int, num_top_logprobs: int = 0) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            num_top_logprobs=num_top_logprobs,
        )


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    """Legacy completions logprobs: how many alternatives per token (0 = the sampled token only)."""
    return_token_ids: bool = False
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; keys beyond these (tool_calls, name, reasoning_content...) go to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(Body):
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    """`required` and named tool choice need constrained decoding, which tandem does not do."""
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    """Takes precedence over the older `max_tokens`."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables of the chat template (e.g. `{"enable_thinking": false}` for Qwen3)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class GenerateRequest(SamplingFields):
    """`POST /v1/generate`: token ids in, token ids and logprobs out (no re-tokenization)."""

    prompt_token_ids: list[int]
    model: str | None = None
    return_routed_experts: bool = False
    """Add `routed_experts` to each choice: per completion token, [MoE layer][k] the expert ids that sampled
    it (router replay); a 400 for a model without experts."""

    def sampling_params(self, max_tokens: int, num_top_logprobs: int = 0) -> SamplingParams:
        params = super().sampling_params(max_tokens, num_top_logprobs)
        return dataclasses.replace(params, return_routed_experts=self.return_routed_experts)


class UpdateWeightsRequest(Body):
    path: str
    """A folder of HF-named safetensors (the trainer's `weights/step_N`)."""
    version: int | None = None
    """The new weight version; unset = the current one + 1."""
