"""Request bodies of the HTTP API: OpenAI's fields, vLLM's extensions, tandem's `/v1/generate`.

Strict on purpose: an unknown field or a value of the wrong type is a 400 naming the field, so a
sampling setting the server does not honour is never silently ignored. OpenAI fields that tandem
does not implement (penalties, logit bias, ...) are accepted only at their neutral value.

These models are the API's schema: FastAPI generates `/openapi.json` from them, so every range the
server enforces is a constraint here (numbers finite, counts bounded, strings and lists non-empty
where the engine needs them), and the document states what the server accepts. What no JSON Schema
can say (a prompt plus `max_tokens` within the context, token ids below the vocabulary size) the
engine checks and reports with the field's name; the fields those bounds apply to carry a mark
(`BELOW_VOCAB_SIZE`, `WITHIN_CONTEXT`) from which the document states them with the served model's numbers
(`tandem.inference.openapi`).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    field_validator,
)

from tandem.inference.engine.sampling_params import (
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    TEMPERATURE_RANGE,
    SamplingParams,
    is_valid_temperature,
)
from tandem.inference.errors import BODY_FORMS


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)


BELOW_VOCAB_SIZE = "x-below-vocab-size"
"""Schema key marking token ids that must be below the served model's vocabulary size."""

WITHIN_CONTEXT = "x-within-context"
"""Schema key marking what counts toward the served model's context: prompt tokens plus completion tokens."""


def _integral(value: Any) -> Any:
    """JSON Schema calls 2.0 an integer, so the server does too (2.5 stays an error)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _integral_items(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """`_integral` for each item, only once the list failed: a prompt's many ids cost no Python call each."""
    try:
        return handler(value)
    except ValidationError:
        if not isinstance(value, list):
            raise
        return handler([_integral(item) for item in value])


MAX_SAFE_INTEGER = 2**53 - 1
"""Integers JSON carries exactly whatever the client's language (I-JSON, RFC 7493): the bound of every integer field."""


def integer(ge: int = -MAX_SAFE_INTEGER, le: int = MAX_SAFE_INTEGER) -> Any:
    """An integer field in [ge, le]; the bounds sit on the int itself, so the JSON schema states them."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


Int = integer()


def token_ids(min_length: int) -> Any:
    """A list of token ids (each below the vocabulary size too, which the engine checks: the schema cannot know it).

    fail_fast: a union tries each member, and a long list must not collect an error per id for each.
    """
    return Annotated[list[Annotated[int, Field(ge=0, le=MAX_SAFE_INTEGER)]],
                     Field(min_length=min_length, fail_fast=True, json_schema_extra={BELOW_VOCAB_SIZE: True}),
                     WrapValidator(_integral_items)]


def _temperature(value: float) -> float:
    if not is_valid_temperature(value):
        raise ValueError(f"must be {TEMPERATURE_RANGE}")
    return value


Temperature = Annotated[float, AfterValidator(_temperature), WithJsonSchema(
    {"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE}]})]


def neutral_only(kind: Any, neutral: Any) -> Any:
    """A field accepted for compatibility, only at its neutral value (or null)."""

    def check(value: Any) -> Any:
        if value is not None and value != neutral:
            raise ValueError(f"only {neutral!r} is supported by tandem's engine")
        return value

    values = [None] if neutral is None else [neutral, None]
    return Annotated[kind | None, AfterValidator(check), WithJsonSchema({"enum": values})]


class SamplingFields(Body):
    n: integer(1, 256) = 1
    max_tokens: integer(ge=1) | None = Field(None, json_schema_extra={WITHIN_CONTEXT: True})
    """Unset: whatever context is left after the prompt."""
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: integer(ge=-1) | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: integer() | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stop_token_ids: token_ids(0) | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    presence_penalty: neutral_only(float, 0.0) = None
    frequency_penalty: neutral_only(float, 0.0) = None
    repetition_penalty: neutral_only(float, 1.0) = None
    logit_bias: neutral_only(dict[str, float], None) = None
    min_tokens: neutral_only(Int, 0) = None

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
    # fail_fast: a union tries each member, and a long id list must not collect an error per id for `list[str]`.
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, fail_fast=True)]
             | token_ids(1)
             | Annotated[list[token_ids(1)], Field(min_length=1, fail_fast=True)]) = Field(
        json_schema_extra={WITHIN_CONTEXT: True})
    """A text, texts, token ids, or lists of token ids; each one a prompt."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: integer(0, MAX_TOP_LOGPROBS) | None = None
    """Legacy completions logprobs: how many alternatives per token (0 = the sampled token only)."""
    return_token_ids: bool = False
    echo: neutral_only(bool, False) = False
    best_of: neutral_only(Int, None) = None
    suffix: neutral_only(str, None) = None


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
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})
    model: str
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={WITHIN_CONTEXT: True})
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    """`required` and named tool choice need constrained decoding, which tandem does not do."""
    parallel_tool_calls: bool = True
    max_completion_tokens: integer(ge=1) | None = Field(None, json_schema_extra={WITHIN_CONTEXT: True})
    """Takes precedence over the older `max_tokens`."""
    logprobs: bool = False
    top_logprobs: integer(0, MAX_TOP_LOGPROBS) | None = None
    """Needs `logprobs: true` (the schema says so with `if`/`then`)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables of the chat template (e.g. `{"enable_thinking": false}` for Qwen3)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs `logprobs: true`")
        return value

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class GenerateRequest(SamplingFields):
    """`POST /v1/generate`: token ids in, token ids and logprobs out (no re-tokenization)."""

    prompt_token_ids: token_ids(1) = Field(json_schema_extra={WITHIN_CONTEXT: True})
    model: str | None = None
    return_routed_experts: bool = False
    """Add `routed_experts` to each choice: per completion token, [MoE layer][k] the expert ids that sampled
    it (router replay); a 400 for a model without experts."""

    def sampling_params(self, max_tokens: int, num_top_logprobs: int = 0) -> SamplingParams:
        params = super().sampling_params(max_tokens, num_top_logprobs)
        return dataclasses.replace(params, return_routed_experts=self.return_routed_experts)


class UpdateWeightsRequest(Body):
    path: str = Field(min_length=1)
    """A folder of HF-named safetensors (the trainer's `weights/step_N`)."""
    version: integer(ge=0) | None = None
    """The new weight version; unset = the current one + 1."""


class GroupInit(Body):
    """`init_info` of `POST /init_weight_transfer_engine` (`tandem.transport.broadcast_types.GroupInitInfo`)."""

    master_address: str = Field(min_length=1)
    """Trainer rank 0's host, where the group's rendezvous store listens."""
    master_port: integer(ge=1, le=65535)
    rank_offset: integer(ge=1)
    """Group rank of the server's first rank (the trainer is rank 0); below `world_size`."""
    world_size: integer(ge=2)


class InitWeightTransferRequest(Body):
    init_info: GroupInit


class UpdateInfo(Body):
    """`update_info` of `POST /update_weights` (`tandem.transport.broadcast_types.WeightUpdateInfo`)."""

    names: list[str]
    """HF parameter names, in the order they cross the group."""
    dtype_names: list[str]
    """`torch` dtype names (`bfloat16`, `float32`), one per name."""
    shapes: list[list[integer(ge=0)]]
    packed: bool = True
    """Tensors travel packed into buckets (tandem's engine receives packed buckets only)."""
    packed_buffer_size_bytes: integer(ge=1) = 2**30
    """Bucket size threshold."""


class BroadcastUpdateRequest(Body):
    update_info: UpdateInfo


FOLDER, BROADCAST = BODY_FORMS


def _update_form(value: Any) -> str:
    """The form of an `/update_weights` body, by key, so that a bad body's error names only that form's fields."""
    return BROADCAST if isinstance(value, dict) and "update_info" in value else FOLDER


UpdateWeightsBody = Annotated[Union[Annotated[UpdateWeightsRequest, Tag(FOLDER)],
                                    Annotated[BroadcastUpdateRequest, Tag(BROADCAST)]], Discriminator(_update_form)]
"""`POST /update_weights`: `{"path"}` reloads a folder (the filesystem weight transport), `{"update_info"}` receives
the broadcast weight transport's tensors, as vLLM's route of the same name does."""


class FinishWeightUpdateRequest(Body):
    weight_version: integer(ge=0) | Annotated[str, Field(pattern=r"^[0-9]{1,15}$")] | None = None
    """The new policy version (vLLM sends it as a string of digits); unset = the current one + 1."""
