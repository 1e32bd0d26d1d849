"""The OpenAI-shaped client environments talk to, keeping the exact tokens of every turn.

An environment calls `await client.chat.completions.create(model=..., messages=..., tools=...,
**sampling_args)` as it would on `openai.AsyncOpenAI`. This client renders the conversation
with the tokenizer's chat template, sends the token ids to `POST /v1/generate` (token in,
token out, so nothing is re-tokenized between turns), and records a `Turn` with the prompt ids,
the sampled ids, their logprobs and the policy version. Its answer is an OpenAI-like object
(with vLLM's extra fields `prompt_token_ids`, `choices[i].token_ids`,
`choices[i].logprobs.content[j].logprob`, plus `weight_version`); Hermes `<tool_call>` blocks
become `message.tool_calls` when tools were offered.

One client serves one rollout: `turns` is that rollout's record, in call order.
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.models.chat import parse_tool_calls, render_chat
from tandem.orchestrator.inference_pool import InferencePool
from tandem.orchestrator.samples import Turn

_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos"}
# The server's request schema is strict about types: `temperature=1` must go out as 1.0.
_CASTS = {"temperature": float, "top_p": float, "min_p": float, "top_k": int, "seed": int}
# Keys that only shape an OpenAI response; this client always returns tokens and logprobs.
_IGNORED_KEYS = {
    "logprobs", "top_logprobs", "return_token_ids", "return_tokens_as_token_ids", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "parallel_tool_calls", "tool_choice",
    "user", "timeout", "extra_headers", "modalities", "stream_options",
}


@dataclass
class FunctionCall:
    name: str
    arguments: str


@dataclass
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class ChatMessage:
    content: str
    tool_calls: list[ToolCall] | None = None
    role: str = "assistant"


@dataclass
class TokenLogprob:
    token: str
    logprob: float


class ChoiceLogprobs:
    """`content`: one `TokenLogprob` per completion token, built when first read. Most environments never read
    it, and building it for every answer is a large share of the orchestrator's CPU
    (`benchmarks/results/rl-loop-h100-2026-12-05.json`)."""

    def __init__(self, token_ids: list[int], logprobs: list[float], tokenizer: Any):
        self._token_ids, self._logprobs, self._tokenizer = token_ids, logprobs, tokenizer

    @functools.cached_property
    def content(self) -> list[TokenLogprob]:
        tokens = self._tokenizer.convert_ids_to_tokens(self._token_ids) if self._token_ids else []
        return [TokenLogprob(str(t), lp) for t, lp in zip(tokens, self._logprobs)]


@dataclass
class Choice:
    index: int
    message: ChatMessage
    finish_reason: str
    token_ids: list[int]
    logprobs: ChoiceLogprobs
    weight_version: int | None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class ChatCompletion:
    id: str
    model: str
    choices: list[Choice]
    prompt_token_ids: list[int]
    usage: Usage
    weight_version: int | None
    created: int = field(default_factory=lambda: int(time.time()))
    object: str = "chat.completion"


class _Completions:
    def __init__(self, client: "TokenChatClient"):
        self._client = client

    async def create(self, *, model: str, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                     **kwargs: Any) -> ChatCompletion:
        return await self._client.complete(model, messages, tools, kwargs)


class _Chat:
    def __init__(self, client: "TokenChatClient"):
        self.completions = _Completions(client)


class TokenChatClient:
    def __init__(self, pool: InferencePool, tokenizer: Any, server: int, seq_len: int, return_routed_experts: bool = False):
        self.pool = pool
        self.return_routed_experts = return_routed_experts
        """Ask for each sampled token's experts (router replay) and keep them in the turns."""
        self.tokenizer = tokenizer
        self.server = server
        self.seq_len = seq_len
        self.chat = _Chat(self)
        self.turns: list[Turn] = []
        self.inference_s = 0.0
        """Seconds spent waiting on the inference servers."""

    async def complete(self, model: str, messages: list[dict[str, Any]], tools: list[dict] | None,
                       kwargs: dict[str, Any]) -> ChatCompletion:
        request = _generate_request(kwargs)
        if "seed" in request:
            request["seed"] = turn_seed(request["seed"], len(self.turns))
        prompt_ids = render_chat(self.tokenizer, messages, tools)
        budget = self.seq_len - len(prompt_ids)
        if budget <= 0:
            # The conversation already fills a training row: end the episode as cut off.
            return _completion(model, "", prompt_ids, [], [], "length", None, [], self.tokenizer)
        request["max_tokens"] = min(request.get("max_tokens", budget), budget)
        request["prompt_token_ids"] = prompt_ids
        if self.return_routed_experts:
            request["return_routed_experts"] = True
        start = time.monotonic()
        response = await self.pool.generate(request, self.server)
        self.inference_s += time.monotonic() - start
        choice = response["choices"][0]
        version = choice.get("weight_version", response.get("weight_version"))
        if version is None:
            raise ValueError("inference server answered without `weight_version`; is it a tandem-compatible server?")
        completion_ids = list(choice["token_ids"])
        self.turns.append(Turn(prompt_ids, completion_ids, [float(x) for x in choice["logprobs"]], int(version),
                               float(request.get("temperature", 1.0)), choice.get("routed_experts", []),
                               drafts_of(response.get("usage"))))
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        finish_reason = choice.get("finish_reason") or "stop"
        content, calls = parse_tool_calls(text) if tools else (text, [])
        tool_calls = [ToolCall(f"call_{len(self.turns)}_{i}", FunctionCall(c.name, c.arguments)) for i, c in enumerate(calls)]
        if tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return _completion(model, content, prompt_ids, completion_ids, self.turns[-1].logprobs, finish_reason,
                           int(version), tool_calls, self.tokenizer, response.get("id"))


def drafts_of(usage: dict[str, Any] | None) -> tuple[int, int] | None:
    """(drafted, accepted) from an answer's `usage.completion_tokens_details` (a speculating tandem server's
    accepted and rejected prediction tokens), or None where it has none."""
    details = (usage or {}).get("completion_tokens_details") or {}
    if "accepted_prediction_tokens" not in details:
        return None
    accepted = int(details["accepted_prediction_tokens"])
    return accepted + int(details.get("rejected_prediction_tokens", 0)), accepted


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (0 first) of a rollout seeded with `seed`. Environments pass the same
    sampling arguments at every turn; one seed for all would replay the same random draws at each, and a policy
    whose distribution barely moves between turns would then sample the same answer again (wordle's seeded
    evals repeated earlier guesses in most turns). Turn 0 keeps `seed`, so single-turn rollouts sample as asked."""
    return seed if turn == 0 else random.Random(f"{seed}:turn:{turn}").getrandbits(31)


def _generate_request(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/generate` fields of OpenAI-style keyword arguments (`extra_body` merged in)."""
    kwargs = dict(kwargs)
    kwargs.update(kwargs.pop("extra_body", None) or {})
    if kwargs.pop("stream", False):
        raise ValueError("streaming is not supported by the orchestrator's client")
    n = kwargs.pop("n", 1)
    if n != 1:
        raise ValueError(f"n = {n}: the orchestrator's client samples one choice per call (groups are separate rollouts)")
    request: dict[str, Any] = {"n": 1}
    max_completion_tokens, max_tokens = kwargs.pop("max_completion_tokens", None), kwargs.pop("max_tokens", None)
    limit = max_completion_tokens if max_completion_tokens is not None else max_tokens
    if limit is not None:
        request["max_tokens"] = int(limit)
    unknown = sorted(set(kwargs) - _SAMPLING_KEYS - _IGNORED_KEYS)
    if unknown:
        raise TypeError(f"chat.completions.create got unsupported argument(s) {unknown}; "
                        f"supported: max_tokens, n=1, {', '.join(sorted(_SAMPLING_KEYS))}")
    for key in _SAMPLING_KEYS & set(kwargs):
        if kwargs[key] is not None:
            request[key] = _CASTS.get(key, lambda v: v)(kwargs[key])
    if isinstance(request.get("stop"), str):
        request["stop"] = [request["stop"]]
    return request


def _completion(model: str, content: str, prompt_ids: list[int], completion_ids: list[int], logprobs: list[float],
                finish_reason: str, version: int | None, tool_calls: list[ToolCall], tokenizer: Any,
                response_id: str | None = None) -> ChatCompletion:
    choice = Choice(
        index=0,
        message=ChatMessage(content=content, tool_calls=tool_calls or None),
        finish_reason=finish_reason,
        token_ids=completion_ids,
        logprobs=ChoiceLogprobs(completion_ids, logprobs, tokenizer),
        weight_version=version,
    )
    usage = Usage(len(prompt_ids), len(completion_ids), len(prompt_ids) + len(completion_ids))
    return ChatCompletion(id=f"chatcmpl-{response_id or int(time.time() * 1e6)}", model=model, choices=[choice],
                          prompt_token_ids=prompt_ids, usage=usage, weight_version=version)
