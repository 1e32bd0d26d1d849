"""`POST /v1/completions` and `POST /v1/chat/completions`, OpenAI-compatible, streaming or not.

Besides OpenAI's fields, responses carry vLLM's (`prompt_token_ids`, `choices[i].token_ids`
when `return_token_ids`) and tandem's `weight_version` (top level: the server's version when
answering; per choice: the oldest version that sampled any of its tokens).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.inference.chat import parse_tool_calls, render_chat
from tandem.inference.engine.llm_engine import SequenceOutput
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.errors import APIError, error_body, error_responses
from tandem.inference.protocol import ChatCompletionRequest, CompletionRequest
from tandem.inference.serving import JSON, Choice, Served, off_loop_if_large, random_id
from tandem.inference.stream_events import ChunkEvents, completion_choice, sse
from tandem.models.chat import streamable_content

router = APIRouter()

GENERATION_RESPONSES = {**error_responses(400, 404, 413, 500), 200: {
    "description": "The completion: JSON, or with `stream: true` server-sent events (`data: <chunk JSON>`, last `data: [DONE]`)",
    "content": {"text/event-stream": {"itemSchema": {  # OpenAPI 3.2's description of each event
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string", "description": "A chunk's JSON, an error's JSON, or `[DONE]`"},
                       "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer", "minimum": 0}}}}}}}


# ---- completions -------------------------------------------------------------------------------


def completion_prompts(served: Served, prompt: Any) -> list[list[int]]:
    """Normalize `prompt` (text, texts, token ids, lists of token ids) into token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    return [served.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def legacy_logprobs(served: Served, choice_tokens: list[int], logprobs: list[float], top: list[tuple[tuple[int, float], ...]], with_top: bool) -> dict:
    """The completions API's logprobs: parallel lists of tokens, their logprobs and text offsets."""
    tokens = served.token_texts(choice_tokens)
    offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=0)) if tokens else []
    top_maps = [dict(zip(served.token_texts([t for t, _ in alts]), (lp for _, lp in alts))) for alts in top] if with_top else None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_maps, "text_offset": offsets}


def prompt_size(prompt: Any) -> int:
    """Characters or token ids in a completions `prompt`, whichever it holds: the cost of tokenizing and checking it."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(1 if isinstance(p, int) else len(p) for p in prompt)


def checked_completion_prompts(served: Served, body: CompletionRequest) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = completion_prompts(served, body.prompt)
    return prompts, [served.sampling_params(body, body.max_tokens, p, body.logprobs or 0) for p in prompts]


# The answer is a dict that `JSON` encodes (the declared response_model only documents it); FastAPI's own path would
# validate it and then serialize it, or without a response_model walk it in Python (jsonable_encoder).
@router.post("/v1/completions", response_model=dict, responses=GENERATION_RESPONSES)
async def completions(body: CompletionRequest, request: Request):
    served: Served = request.app.state.served
    is_base = served.is_base(body.model)
    prompts, params = await off_loop_if_large(prompt_size(body.prompt), checked_completion_prompts, served, body)
    meta = {"id": f"cmpl-{random_id()}", "created": int(time.time()), "model": served.answer_model(is_base)}
    if body.stream:
        return StreamingResponse(_completion_stream(served, body, prompts, params, meta, is_base),
                                 media_type="text/event-stream")
    results = await asyncio.gather(*(served.complete(p, sp, body.n, is_base) for p, sp in zip(prompts, params)))
    choices = []
    for k, (prompt, prompt_choices) in enumerate(zip(prompts, results)):
        for c in prompt_choices:
            choice = {"index": k * body.n + c.index, "text": c.text, "finish_reason": c.finish_reason,
                      "logprobs": None, "weight_version": c.weight_version}
            if body.logprobs is not None:
                choice["logprobs"] = legacy_logprobs(served, c.token_ids, c.logprobs, c.top_logprobs, body.logprobs > 0)
            if body.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = prompt, c.token_ids
            choices.append(choice)
    response = {**meta, "object": "text_completion", "choices": choices, "weight_version": served.answer_version(is_base),
                "usage": served.usage(sum(map(len, prompts)), sum(len(c.token_ids) for r in results for c in r),
                                      [c for r in results for c in r])}
    if body.return_token_ids and len(prompts) == 1:
        response["prompt_token_ids"] = prompts[0]
    return JSON(response)


async def _merged(served: Served, prompts: list[list[int]], params: list, n: int,
                  is_base: bool) -> AsyncIterator[tuple[int, SequenceOutput]]:
    """Outputs of several prompts' streams as they come, tagged with the prompt's position."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int) -> None:
        try:
            async for out in served.stream(prompts[k], params[k], n, is_base=is_base):
                await queue.put((k, out))
        except Exception as err:
            await queue.put((k, err))
        await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k)) for k in range(len(prompts))]
    try:
        remaining = len(prompts)
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()


async def _completion_stream(served: Served, body: CompletionRequest, prompts, params, meta,
                             is_base: bool) -> AsyncIterator[str]:
    events = ChunkEvents(meta, "text_completion")
    counts = [0] * len(prompts)
    last: dict[int, SequenceOutput] = {}  # each choice's latest output: its draft counts run over all its steps
    started: set[int] = set()  # choices that had their first chunk

    def event(k: int, out: SequenceOutput) -> str:
        """The chunk of an output of prompt `k`."""
        counts[k] += len(out.token_ids)
        index = k * body.n + out.index
        last[index] = out
        logprobs = None
        if body.logprobs is not None:
            logprobs = legacy_logprobs(served, out.token_ids, out.logprobs, out.top_logprobs, body.logprobs > 0)
        first = index not in started
        started.add(index)
        return events.event(completion_choice(
            index, out.text, logprobs, out.finish_reason,
            out.token_ids if body.return_token_ids else None,
            prompts[k] if body.return_token_ids and first else None,
            out.weight_version if out.finish_reason is not None else None))

    try:
        if len(prompts) == 1:  # its stream as it comes: no generator between, which costs a resumption per token
            async for out in served.stream(prompts[0], params[0], body.n, is_base=is_base):
                yield event(0, out)
        else:
            async for k, out in _merged(served, prompts, params, body.n, is_base):
                yield event(k, out)
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**events.chunk, "choices": [], "usage": served.usage(sum(map(len, prompts)), sum(counts),
                                                                            last.values())})
    except APIError as err:
        yield sse(error_body(err.status, err.message, err.param))
    yield sse("[DONE]")


# ---- chat --------------------------------------------------------------------------------------


def chat_logprobs(served: Served, token_ids: list[int], logprobs: list[float], top: list[tuple[tuple[int, float], ...]]) -> dict:
    """One entry per token, built in one pass over cached token texts and bytes (a completion of thousands of
    tokens answers in milliseconds; no entry without alternatives builds anything but its own dict)."""
    def alternatives(alts: tuple[tuple[int, float], ...]) -> list[dict]:
        ids = [a for a, _ in alts]
        return [{"token": text, "logprob": lp, "bytes": raw}
                for text, raw, (_, lp) in zip(served.token_texts(ids), served.token_byte_lists(ids), alts)]

    return {"content": [{"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives(alts) if alts else []}
                        for text, raw, lp, alts in zip(served.token_texts(token_ids), served.token_byte_lists(token_ids),
                                                       logprobs, top)]}


def chat_prompt(served: Served, body: ChatCompletionRequest) -> list[int]:
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.uses_tools else None
    return render_chat(served.tokenizer, [m.for_template() for m in body.messages], tools,
                       body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)


def chat_message(body: ChatCompletionRequest, choice: Choice) -> tuple[dict, str | None]:
    """The assistant message and finish reason of one choice, tool calls parsed out when tools are on."""
    if body.uses_tools:
        content, calls = parse_tool_calls(choice.text)
        if calls:
            reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
            return {"role": "assistant", "content": content, "tool_calls": calls}, reason
    return {"role": "assistant", "content": choice.text}, choice.finish_reason


@router.post("/v1/chat/completions", response_model=dict, responses=GENERATION_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    served: Served = request.app.state.served
    is_base = served.is_base(body.model)
    prompt = await asyncio.to_thread(chat_prompt, served, body)  # the template and tokenizer: off the event loop
    names = {"prompt": "messages"}
    max_tokens = body.max_tokens
    if body.max_completion_tokens is not None:
        max_tokens, names["max_tokens"] = body.max_completion_tokens, "max_completion_tokens"
    num_top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
    params = await off_loop_if_large(len(prompt), served.sampling_params, body, max_tokens, prompt, num_top_logprobs, names)
    meta = {"id": f"chatcmpl-{random_id()}", "created": int(time.time()), "model": served.answer_model(is_base)}
    if body.stream:
        return StreamingResponse(_chat_stream(served, body, prompt, params, meta, is_base), media_type="text/event-stream")
    choices = []
    results = await served.complete(prompt, params, body.n, is_base)
    for c in results:
        message, reason = chat_message(body, c)
        choice = {"index": c.index, "message": message, "finish_reason": reason, "logprobs": None,
                  "weight_version": c.weight_version}
        if body.logprobs:
            choice["logprobs"] = chat_logprobs(served, c.token_ids, c.logprobs, c.top_logprobs)
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    response = {**meta, "object": "chat.completion", "choices": choices, "weight_version": served.answer_version(is_base),
                "usage": served.usage(len(prompt), sum(len(c.token_ids) for c in results), results)}
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt
    return JSON(response)


async def _chat_stream(served: Served, body: ChatCompletionRequest, prompt: list[int], params, meta,
                       is_base: bool) -> AsyncIterator[str]:
    events = ChunkEvents(meta, "chat.completion.chunk")
    chunk = events.chunk
    choices = [Choice(i) for i in range(body.n)]
    sent = [0] * body.n  # characters of content already streamed, per choice
    for i in range(body.n):
        first = {**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
        if body.return_token_ids and i == 0:
            first["prompt_token_ids"] = prompt
        yield sse(first)
    try:
        async for out in served.stream(prompt, params, body.n, is_base=is_base):
            c = choices[out.index]
            c.add(out)
            delta: dict[str, Any] = {}
            reason = None
            if out.finish_reason is None:
                visible = streamable_content(c.text) if body.uses_tools else c.text
            else:
                message, reason = chat_message(body, c)
                visible = (message["content"] or "") if "tool_calls" in message else c.text
                if "tool_calls" in message:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            if len(visible) > sent[out.index]:
                delta["content"] = visible[sent[out.index]:]
                sent[out.index] = len(visible)
            choice: dict[str, Any] = {"index": out.index, "delta": delta, "logprobs": None, "finish_reason": reason}
            if body.logprobs:
                choice["logprobs"] = chat_logprobs(served, out.token_ids, out.logprobs, out.top_logprobs)
            if body.return_token_ids:
                choice["token_ids"] = out.token_ids
            if reason is not None:
                choice["weight_version"] = out.weight_version
            if delta or reason is not None or body.logprobs or body.return_token_ids:  # else: text held back
                yield events.event(json.dumps(choice))
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**chunk, "choices": [], "usage": served.usage(len(prompt), sum(len(c.token_ids) for c in choices),
                                                                     choices)})
    except APIError as err:
        yield sse(error_body(err.status, err.message, err.param))
    yield sse("[DONE]")
